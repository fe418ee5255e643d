"""--algo ppo (critic, warm-up, checkpoints), the reference model (KL in the reward, reference reset) and the
experience filters: in-process on the tiny model with hand-made experiences, and end to end in every entry script."""

import hashlib
from types import SimpleNamespace

import pytest
import torch

from common.cli import parse_args
from common.experience import Experience, collate
from common.trainer import checkpoints as ckpt
from common.trainer.filters import PROCESSORS, build_processors, drop_stale, process
from common.trainer.forward import batch_logprobs
from common.trainer.trainer import Trainer
from tests.conftest import TINY, assert_trained, run_in_process


def _args(tmp_path, *flags):
    from train_sync import Args

    return parse_args(Args, [*TINY, "--out-dir", str(tmp_path / "run"), *flags])


def _experiences(trainer, rewards, finish_reasons=None, infos=None):
    """Random prompts/responses (pairs share a group) whose behaviour log-probs are the trainer's own."""
    g = torch.Generator().manual_seed(0)
    exps = []
    for i, r in enumerate(rewards):
        prompt = torch.randint(0, 250, (5,), generator=g).tolist()
        response = torch.randint(0, 250, (3 + i % 3,), generator=g).tolist()
        exps.append(Experience(prompt, response, [0.0] * len(response), [1] * len(response), r, group_id=i // 2,
                               task_id=str(i // 2), policy_version=trainer.version,
                               reward_info=(infos or {}).get(i, {}),
                               finish_reason=(finish_reasons or {}).get(i, "stop")))
    logprobs = batch_logprobs(trainer.model, collate(exps, trainer.tokenizer.pad_token_id), trainer.args)
    for i, e in enumerate(exps):
        p = len(e.prompt_ids)
        e.logprobs = logprobs[i, p - 1: p - 1 + len(e.response_ids)].tolist()
    return exps


def _hash(module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def test_experience_processors_by_hand():
    def exp(reward, finish="stop", info=None, group=0):
        return Experience([1], [2, 3], [0.0, 0.0], [1, 1], reward, group, "t", 0, info or {}, finish)

    def args(**kw):
        base = dict(mask_truncated=True, drop_failed_rewards=True, drop_zero_signal_groups=True, algo="grpo",
                    max_staleness=2)
        return SimpleNamespace(**{**base, **kw})

    batch = [exp(1.0), exp(float("nan")), exp(float("inf")), exp(0.0, info={"failed": True}), exp(0.0, "length"),
             exp(0.5, group=1), exp(0.5, group=1)]
    kept, counts = process(batch, args(), build_processors())
    assert counts == {"filter/invalid_dropped": 3, "filter/failed_dropped/verifier": 1,
                      "filter/truncated_masked": 1, "filter/zero_signal_frac": 0.5}
    assert [e.reward for e in kept] == [1.0, 0.0] and [e.loss_mask for e in kept] == [[1, 1], [0, 0]]
    assert batch[4].loss_mask == [1, 1]  # the input is not modified
    kept, counts = process(batch, args(mask_truncated=False, drop_failed_rewards=False,
                                       drop_zero_signal_groups=False), build_processors())
    assert counts["filter/invalid_dropped"] == 2 and counts["filter/zero_signal_frac"] == 0  # non-finite: always
    assert [e.loss_mask for e in kept][-3] == [1, 1]
    kept, _ = process(batch, args(algo="ppo"), build_processors())  # a critic learns from uniform groups
    assert len(kept) == 4
    assert list(PROCESSORS) == ["invalid_rewards", "truncated", "zero_signal"]


def test_staleness_counts_the_oldest_trained_token():
    """An experience is as old as the oldest weights among the tokens it trains (per-token versions where the loss
    mask is 1): older context tokens with mask 0 do not count; without per-token versions, its policy_version."""
    def exp(versions, mask, policy_version=9):
        return Experience([1], [2] * len(mask), [0.0] * len(mask), mask, 1.0, 0, "t", policy_version,
                          segment_versions=versions)

    batch = [exp([3, 3, 5], [0, 0, 1]),   # only the last segment trained: age 6 - 5 = 1
             exp([3, 4, 5], [1, 1, 1]),   # every segment trained: as old as version 3: age 3
             exp([], [1, 1], 4),          # no per-token versions: policy_version 4, age 2
             exp([6, 6], [1, 1])]         # fresh
    kept, counts = drop_stale(batch, SimpleNamespace(max_staleness=2), version=6)
    assert kept == [batch[0], batch[2], batch[3]]
    assert counts == {"filter/stale_dropped": 1, "staleness/mean": 1.0, "staleness/max": 2,
                      "staleness/dropped_min": 3}
    kept, counts = drop_stale(batch, SimpleNamespace(max_staleness=0), version=6)
    assert kept == [batch[3]] and counts["staleness/dropped_min"] == 1


def test_filters_are_counted_in_the_train_step(tmp_path):
    trainer = Trainer(_args(tmp_path, "--mask-truncated", "--no-drop-zero-signal-groups"), torch.device("cpu"))
    exps = _experiences(trainer, [1.0, 0.0, float("nan"), 0.0, 1.0, 0.5], finish_reasons={4: "length"},
                        infos={5: {"failed": True, "reason": "timeout"}})
    metrics = trainer.train_step(exps)
    assert metrics["filter/invalid_dropped"] == 2 and metrics["filter/truncated_masked"] == 1
    # Tokens counted are those still trained: samples 0, 1, 3 (3 + 4 + 3 tokens); sample 4 is masked.
    assert metrics["response/tokens_mean"] == pytest.approx((3 + 4 + 3 + 0) / 4)
    assert metrics["reward/mean"] == pytest.approx(0.5)  # over the finite rewards the explorer sent
    assert metrics["loss"] != 0 and metrics["grad_norm"] > 0


def test_ppo_critic_trains_and_its_checkpoint_restores(tmp_path):
    args = _args(tmp_path, "--algo", "ppo", "--critic-lr", "1e-3")
    trainer = Trainer(args, torch.device("cpu"))
    fresh = _hash(trainer.critic.model)
    for _ in range(2):
        metrics = trainer.train_step(_experiences(trainer, [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]))
    assert metrics["value_loss"] > 0 and metrics["value/mean"] != 0
    trained = _hash(trainer.critic.model)
    assert trained != fresh
    ckpt.save(trainer, args.out_dir)
    restored = Trainer(args, torch.device("cpu"))
    assert _hash(restored.critic.model) == fresh
    ckpt.resume(restored, args.out_dir)
    assert restored.step == 2 and _hash(restored.critic.model) == trained
    steps = {s["step"].item() for s in restored.critic.optimizer.state_dict()["state"].values()}
    assert steps == {4.0}  # the critic's Adam state came back too (2 steps x --ppo-epochs 2 in TINY)


@pytest.mark.filterwarnings("error::UserWarning")  # torch's lr_scheduler-before-optimizer warning: a skip is by design
def test_critic_warmup_keeps_the_policy_fixed(tmp_path):
    trainer = Trainer(_args(tmp_path, "--algo", "ppo", "--critic-warmup-steps", "1"), torch.device("cpu"))
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    policy, critic = _hash(trainer.model), _hash(trainer.critic.model)
    metrics = trainer.train_step(_experiences(trainer, rewards))
    assert metrics["actor_frozen"] == 1.0 and _hash(trainer.model) == policy and _hash(trainer.critic.model) != critic
    metrics = trainer.train_step(_experiences(trainer, rewards))
    assert metrics["actor_frozen"] == 0.0 and _hash(trainer.model) != policy


def test_kl_in_the_reward_and_reference_reset(tmp_path):
    args = _args(tmp_path, "--kl-coef", "0.1", "--kl-mode", "reward", "--ref-reset-every", "2")
    trainer = Trainer(args, torch.device("cpu"))
    rewards = [1.0, 0.0, 0.0, 1.0]
    trainer.train_step(_experiences(trainer, rewards))
    assert _hash(trainer.ref_model) != _hash(trainer.model)  # step 1: the reference is still the initial model
    metrics = trainer.train_step(_experiences(trainer, rewards))
    assert metrics["kl"] > 0  # the behaviour policy (after step 1) differs from the reference
    assert metrics["ref_reset"] == 1.0 and _hash(trainer.ref_model) == _hash(trainer.model)
    ckpt.save(trainer, args.out_dir)
    restored = Trainer(args, torch.device("cpu"))
    ckpt.resume(restored, args.out_dir)
    assert _hash(restored.ref_model) == _hash(trainer.ref_model)


@pytest.mark.parametrize("flags,field", [
    (["--algo", "ppo2"], "--algo"), (["--kl-mode", "reward"], "--kl-mode"), (["--ref-reset-every", "2"],
                                                                              "--ref-reset-every"),
    (["--critic-model", "tiny"], "--critic-model"), (["--algo", "ppo", "--lam", "1.5"], "--lam"),
    (["--algo", "ppo", "--value-clip-eps", "-1"], "--value-clip-eps"),
])
def test_bad_algo_fields_name_the_field(tmp_path, flags, field):
    with pytest.raises(SystemExit, match=f"^error: {field}"):  # ConfigError or the range check of common/knobs.py
        _args(tmp_path, *flags)


# train_async.py: tests/test_workflows_runs.py's PPO run (data-parallel, streaming, checkpoints every step).
@pytest.mark.parametrize("script", ["train_sync.py", "train_offpolicy.py"])
def test_ppo_runs_in_every_schedule(tmp_path, script):
    out = tmp_path / "run"
    # Parity rewards plus a KL in the reward: per-token returns for the critic to fit.
    flags = [*TINY, "--algo", "ppo", "--kl-coef", "0.05", "--kl-mode", "reward", "--samples-per-task", "1",
             "--tasks-per-step", "8", "--critic-lr", "1e-3", "--checkpoint-every", "1", "--out-dir", str(out)]
    proc = run_in_process(script, *flags, "--steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = assert_trained(out, steps=2)
    assert all("value_loss" in r and "value/explained_var" in r for r in rows)
    assert (out / "checkpoints" / "step_2" / "critic" / "model.safetensors").exists()
    assert not (out / "final" / "critic").exists()  # final/: the policy and tokenizer only
    if script != "train_sync.py":
        return
    assert rows[1]["kl"] > 0 and rows[1]["value_loss"] > 0  # batch 2 comes from the updated policy: KL-shaped returns
    second = run_in_process(script, *flags, "--steps", "3", "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert_trained(out, steps=3)
    state = torch.load(out / "checkpoints" / "step_3" / "critic" / "optimizer.pt", weights_only=False)
    assert {s["step"].item() for s in state["state"].values()} == {6.0}  # the critic's Adam went on from step 2


def test_missing_critic_model_is_one_line_error(tmp_path):
    proc = run_in_process("train_sync.py", *TINY, "--algo", "ppo", "--critic-model", str(tmp_path / "nope"),
                          "--out-dir", str(tmp_path / "r"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: --critic-model {tmp_path / 'nope'}: no such")


def test_critic_model_is_loaded_from_its_own_folder(tmp_path):
    from common.model import build_tiny_model, build_tiny_tokenizer

    folder = tmp_path / "critic-init"
    build_tiny_model(build_tiny_tokenizer(), seed=123).save_pretrained(folder)
    trainer = Trainer(_args(tmp_path, "--algo", "ppo", "--critic-model", str(folder)), torch.device("cpu"))
    embed = trainer.critic.model.body.embed_tokens.weight
    assert not torch.equal(embed, trainer.model.model.embed_tokens.weight)  # not a copy of the policy (seed 0)
    from transformers import AutoModelForCausalLM

    assert torch.equal(embed, AutoModelForCausalLM.from_pretrained(folder).model.embed_tokens.weight)
