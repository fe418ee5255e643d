"""The algorithms of docs/USAGE.md "Algorithms and recipes", each trained on the tiny model through its own term: GSPO's
sequence ratio, CISPO's clipped weights, on-policy distillation's teacher KL, DAPO's clip-higher bound, refill rounds
and overlong punishment (in rounds and streaming), and the rollout-correction menu. The objectives themselves are
checked by hand in tests/test_losses.py."""

import math

import pytest
import torch

from common.cli import parse_args
from common.experience import collate
from tests.conftest import TINY, assert_trained, run_in_process
from tests.test_algos import _args, _experiences

pytestmark = pytest.mark.timeout(300)


def coin(response: str, task: dict) -> float:
    """0 or 1 by the parity of the response's code points: a group of 2 has equal rewards about half the time."""
    return float(sum(map(ord, response)) % 2)


@pytest.mark.parametrize("algo,metric", [("gspo", "gspo/seq_ratio_mean"), ("cispo", "clip_frac")])
def test_gspo_and_cispo_train_from_their_configs(tmp_path, algo, metric):
    out = tmp_path / "run"
    proc = run_in_process("train_sync.py", *TINY, "--config", f"configs/{algo}.yaml", "--steps", "2",
                          "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = assert_trained(out, steps=2)
    # --ppo-epochs 2: the second pass sees ratios away from 1, which the configs' clip ranges bound
    assert all(metric in r for r in rows) and any(r["clip_frac"] > 0 for r in rows)


def _teacher(tmp_path, extra_token: bool = False) -> str:
    """A tiny model of other weights than the student's (seed 123), with the student's tokenizer (or one more
    token)."""
    from common.model import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    folder = tmp_path / ("other-vocab" if extra_token else "teacher")
    build_tiny_model(tokenizer, seed=123).save_pretrained(folder)
    if extra_token:
        tokenizer.add_tokens(["<not-in-the-student>"])
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_distill_trains_through_the_teachers_kl(tmp_path):
    out = tmp_path / "run"
    proc = run_in_process("train_sync.py", *TINY, "--algo", "distill", "--teacher", _teacher(tmp_path), "--steps", "2",
                          "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = assert_trained(out, steps=2)  # advantages come from the teacher only (--distill-reward-coef 0)
    assert all(r["distill/reverse_kl"] > 0 for r in rows)  # two random models disagree
    assert all("filter/zero_signal_frac" in r and r["filter/zero_signal_frac"] == 0 for r in rows)  # kept whole


def test_distill_refuses_a_teacher_with_another_tokenizer_or_none_and_a_bad_teacher_device(tmp_path):
    from train_sync import Args

    other = _teacher(tmp_path, extra_token=True)
    for flags, message in [(["--algo", "distill", "--teacher", other], f"--teacher {other}: its tokenizer differs"),
                           (["--algo", "distill"], "--algo distill needs --teacher"),
                           (["--teacher", other], "--teacher MODEL is needed by --algo distill, and only by it"),
                           (["--teacher-device", "cpu"], "--teacher-device places --teacher"),
                           (["--algo", "distill", "--teacher", "tiny", "--teacher-device", "gpu1"],
                            "--teacher-device 'gpu1' is neither cpu nor cuda:N"),
                           (["--algo", "distill", "--teacher", "tiny", "--teacher-device", "cpu", "--trainer-devices",
                             "cpu,cpu"], "--teacher-device with 2 trainers")]:
        with pytest.raises(SystemExit, match=f"^error: {message}"):
            parse_args(Args, ["--model", "tiny", *flags])


def test_a_teacher_on_its_own_device_gives_the_same_logprobs_on_the_trainers(tmp_path):
    """--teacher-device: the teacher loads whole there, the batch goes to its device and its log-probs come back
    (tests/fake_device.py raises where a GPU would on a tensor left behind, and marks what is on the device); padded
    and packed micro-batches. The tiny teacher has the student's own weights: equal log-probs."""
    from fake_device import FAKE, FakeDevice, on_device

    from common.trainer.forward import batch_logprobs
    from common.trainer.teacher import teacher_logprobs
    from common.trainer.trainer import Trainer

    for flags in (["--max-tokens-per-micro-batch", "64"], []):
        args = _args(tmp_path, "--algo", "distill", "--teacher", "tiny", "--teacher-device", "cpu", *flags)
        trainer = Trainer(args, torch.device("cpu"))
        batch = collate(_experiences(trainer, [1.0, 0.0] * 4), trainer.tokenizer.pad_token_id)
        here = batch_logprobs(trainer.model, batch, args)
        assert torch.allclose(teacher_logprobs(trainer.teacher, batch, args), here, atol=1e-5)
    with FakeDevice():
        teacher = trainer.teacher.to(FAKE)
        there = teacher_logprobs(teacher, batch, args)
        assert not on_device(there) and all(on_device(p) for p in teacher.parameters())
    assert torch.allclose(here, there, atol=1e-5)


def test_clip_higher_trains_where_the_symmetric_clip_stops(tmp_path):
    """Behaviour log-probs set so that rewarded samples have ratio 1.25 and unrewarded 0.75: a symmetric 0.2 clip
    clips every token (no gradient), --clip-eps-high 0.28 lets the rewarded ones rise."""
    def grad_norm(*flags):
        from common.trainer.trainer import Trainer

        trainer = Trainer(_args(tmp_path, "--ppo-epochs", "1", *flags), torch.device("cpu"))
        exps = _experiences(trainer, [1.0, 0.0] * 4)
        for e in exps:
            e.logprobs = [lp - math.log(1.25 if e.reward else 0.75) for lp in e.logprobs]
        return trainer.train_step(exps)["grad_norm"]

    assert grad_norm() == 0
    assert grad_norm("--clip-eps-high", "0.28") > 0


@pytest.mark.parametrize("script", ["train_sync.py", "train_async.py"])
def test_dapo_refills_zero_signal_groups(tmp_path, script):
    """configs/dapo.yaml: every row counts its zero-signal groups and extra rounds (streaming: groups admitted in
    their place, in rounds of --tasks-per-step), trains only groups with a signal, and punishes long responses."""
    out = tmp_path / "run"
    proc = run_in_process(script, *TINY, "--config", "configs/dapo.yaml", "--overlong-buffer", "4", "--steps", "3",
                          "--reward-fn", "tests.test_recipes:coin", "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = assert_trained(out, steps=3)
    assert all(0 <= r["rollout/zero_signal_frac"] < 1 and r["rollout/refill_rounds"] <= 3 for r in rows)
    assert sum(r["rollout/refill_rounds"] for r in rows) > 0  # some groups had no signal and were replaced
    assert all(r["reward/overlong_mean"] < 0 for r in rows)  # the tiny model runs into --max-new-tokens
    # the trainer's filter found nothing left to drop where the rounds sufficed
    assert any(r["filter/zero_signal_frac"] == 0 and r["rollout/refill_rounds"] > 0 for r in rows)


def test_refill_needs_group_signal():
    from train_sync import Args

    with pytest.raises(SystemExit, match="^error: --refill-rounds replaces zero-signal groups"):
        parse_args(Args, ["--model", "tiny", "--refill-rounds", "2", "--no-drop-zero-signal-groups"])
    with pytest.raises(SystemExit, match="^error: --overlong-buffer"):
        parse_args(Args, ["--model", "tiny", "--overlong-buffer", "48"])


# Rows 0-3 as sampled; rows 4-5 with behaviour log-probs 3 higher (token ratio e^-3), rows 6-7 3 lower (e^3).
FAR = {4: 3.0, 5: 3.0, 6: -3.0, 7: -3.0}
LOW, HIGH = math.exp(-3), 2.0  # a far token's weight where truncated at --correction-cap 2


@pytest.mark.parametrize("preset,weight_mean", [
    ("tis", (4 + 2 * LOW + 2 * HIGH) / 8),     # token x truncate
    ("decoupled", (4 + 2 * LOW) / 8),          # token x mask (above the cap)
    ("icepop", 4 / 8),                         # token band [0.5, 2]: both sides masked
    ("seq_tis", (4 + 0 + 2 * HIGH) / 8),       # sequence x truncate: e^-24 or the cap
    ("seq_mask", 4 / 8),                       # sequence x mask: e^-24 kept (~0), e^24 masked
    ("k3_reject", 4 / 8),                      # every far row's mean k3 is far above 0.01
])
def test_rollout_correction_presets_weight_and_train(preset, weight_mean):
    from tests.test_mismatch import step  # (its `conftest` import works under pytest only: not at module level,
                                          # where the reward workers import `coin` from here)

    out = step(["--off-policy-correction", preset], shift=lambda i: FAR.get(i, 0.0))
    assert out["mismatch/logp_abs_mean"] == pytest.approx(1.5, abs=1e-3)  # the proximal pass saw every row
    assert out["correction/weight_mean"] == pytest.approx(weight_mean, abs=1e-3)
    assert out["grad_norm"] > 0


def test_bypass_is_the_behaviour_policy_as_proximal():
    """bypass: no proximal forward pass and no weights, the ratio's denominator is mu itself: the same update as
    none (the default), named as verl names it."""
    from tests.test_mismatch import step

    bypass, none = (step(["--off-policy-correction", mode], shift=lambda i: FAR.get(i, 0.0))
                    for mode in ("bypass", "none"))
    assert "correction/weight_mean" not in bypass and bypass["grad_norm"] > 0
    assert bypass["loss"] == none["loss"] and bypass["grad_norm"] == none["grad_norm"]


def test_a_correction_preset_trains_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = run_in_process("train_offpolicy.py", *TINY, "--off-policy-correction", "icepop", "--steps", "2",
                          "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = assert_trained(out, steps=2)
    assert all(0 < r["correction/weight_mean"] <= 2 for r in rows)
