"""train_sync.py end to end with the tiny model: outputs, weight sync, resume, and one-line errors."""

import json
import shutil

import pytest
import torch

from common.runtime.metrics import read_metrics, read_timeline
from tests.conftest import TINY, assert_trained, run_in_process


def test_default_tiny_command_outputs(tmp_path):
    """The issue's command (3 steps of the tiny model, default settings otherwise) with HF generation on the smoke
    taskset, so that it trains: metrics rows, timeline.png, a loadable final/ folder. The default engine
    (--engine auto, vLLM where it imports) runs in tests/test_vllm_runs.py."""
    out = tmp_path / "run"
    proc = run_in_process("train_sync.py", "--model", "tiny", "--steps", "3", "--engine", "hf", "--taskset", "parity",
                          "--num-threads", "1",  # two tests run at once on 2 cores: two threads each would preempt
                          "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0] == "[tandem] sync: rollout engine hf (--engine hf)"
    assert json.loads((out / "config.json").read_text())["engine"] == "hf"
    rows = assert_trained(out, steps=3)
    for key in ("reward/mean", "loss", "time/rollout", "time/train", "time/sync", "time/wait",
                "staleness/mean", "rollout/tokens_per_s", "mismatch/logp_abs_mean", "mismatch/logp_abs_max",
                "mismatch/k3"):
        assert key in rows[0], key
    assert all(r["mismatch/logp_abs_max"] < 1e-4 for r in rows)  # HF engine and trainer, same fp32 weights
    assert all(r["staleness/max"] == 0 for r in rows)  # synchronous: always the current policy
    assert (out / "timeline.png").stat().st_size > 10_000
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert sum(p.numel() for p in model.parameters()) > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and 0 <= summary["eval_after"] <= 1


def test_sync_schedule_hashes_and_no_overlap(tmp_path):
    """Also --algo dr_grpo end to end (grpo trains in the default command above, opmd in the resume test below)."""
    out = tmp_path / "run"
    proc = run_in_process("train_sync.py", *TINY, "--steps", "3", "--out-dir", str(out), "--verify-sync",
                          "--algo", "dr_grpo",
                          "--eval-every", "10")  # evaluations before step 1 and after the last (TINY has none)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = assert_trained(out, steps=3)
    assert all(r["filter/zero_signal_frac"] < 1 for r in rows)  # the smoke task gives groups a signal
    assert "eval/accuracy" in rows[0]  # the evaluation before step 1 came on the control channel
    assert (out / "timeline.json").exists() and not list(out.glob("*.png"))  # --no-plots (TINY): data, no PNGs
    assert json.loads((out / "summary.json").read_text())["eval_after"] is not None  # so did the final one
    events = read_timeline(str(out))
    # The experience queue carried rollout batches only: one get per step, nothing else.
    assert sorted(e["get"] for e in events if e["phase"] == "wait" and "get" in e) == ["0-1", "0-2", "0-3"]
    syncs = {p: [e for e in events if e["process"] == p and e["phase"] == "sync"] for p in ("trainer0", "explorer0")}
    assert len(syncs["trainer0"]) == len(syncs["explorer0"]) == 4  # initial + one per step
    for t, e in zip(syncs["trainer0"], syncs["explorer0"]):
        assert t["version"] == e["version"] and t["hash"] == e["hash"]
    assert len({e["hash"] for e in syncs["trainer0"]}) == 4  # the weights did change every step
    # Schedule (a): no rollout overlaps a train phase.
    rollouts = [e for e in events if e["phase"] == "rollout"]
    trains = [e for e in events if e["phase"] == "train"]
    assert len(rollouts) == len(trains) == 3
    for r in rollouts:
        for t in trains:
            assert r["end"] <= t["start"] or t["end"] <= r["start"]


def test_resume_continues_step_count_optimizer_and_lr_schedule(tmp_path):
    """4 steps straight through; then the run is cut back to its step-2 checkpoint (as if it crashed there) and
    resumed: steps 3-4 come once each, with the same learning rates (scheduler state in trainer_state.pt) and
    Adam's per-parameter step count carried on. With --algo opmd, so that it trains end to end too."""
    out = tmp_path / "run"
    flags = [*TINY, "--steps", "4", "--lr-scheduler", "linear", "--warmup-steps", "2", "--checkpoint-every", "2",
             "--algo", "opmd", "--out-dir", str(out)]
    first = run_in_process("train_sync.py", *flags)
    assert first.returncode == 0, first.stderr[-3000:]
    straight = [r["lr"] for r in read_metrics(str(out))]
    assert straight == pytest.approx([0.0, 5e-4, 1e-3, 5e-4])  # --lr 1e-3: warm-up 0, 1/2, then 1 -> 0 over 2..4
    state2 = torch.load(out / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=False)
    assert state2["lr_scheduler"]["last_epoch"] == 2
    # Crash after step 2: drop what came later.
    for path in [out / "checkpoints" / "step_4", out / "final"]:
        shutil.rmtree(path, ignore_errors=True)
    rows = (out / "metrics.jsonl").read_text().splitlines()[:2]
    (out / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    second = run_in_process("train_sync.py", *flags, "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = assert_trained(out, steps=4, skipped=(1,))  # step 1 runs at lr 0 (warm-up): no update to lose
    assert [r["lr"] for r in resumed] == pytest.approx(straight)
    state4 = torch.load(out / "checkpoints" / "step_4" / "trainer_state.pt", weights_only=False)
    assert state4["step"] == 4 and state4["version"] == 4
    # Two optimizer steps (--ppo-epochs 2) per trainer step here.
    assert {s["step"].item() for s in state2["optimizer"]["state"].values()} == {4.0}
    assert {s["step"].item() for s in state4["optimizer"]["state"].values()} == {8.0}


def _one_line_error(proc, *fragments):
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines and lines[-1].startswith("error:"), proc.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[-1]


def test_missing_model_path_is_one_line_error(tmp_path):
    proc = run_in_process("train_sync.py", "--model", str(tmp_path / "nope"), "--out-dir", str(tmp_path / "r"))
    _one_line_error(proc, "--model", "nope")


def test_unknown_config_key_is_one_line_error(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("steps: 2\nlearning_rate: 0.1\n")
    proc = run_in_process("train_sync.py", "--config", str(cfg), "--model", "tiny", "--out-dir", str(tmp_path / "r"))
    _one_line_error(proc, "learning_rate", str(cfg))


def test_config_file_supplies_defaults_and_cli_wins(tmp_path):
    from common.cli import parse_args
    from train_sync import Args

    cfg = tmp_path / "ok.yaml"
    cfg.write_text("steps: 7\nlr: 0.5\nmax-new-tokens: 9\n")
    args = parse_args(Args, ["--config", str(cfg), "--lr", "0.25"])
    assert (args.steps, args.lr, args.max_new_tokens) == (7, 0.25, 9)


def test_bad_dataset_row_is_one_line_error(tmp_path):
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?"}\n')
    proc = run_in_process("train_sync.py", "--model", "tiny", "--taskset", str(data), "--out-dir", str(tmp_path / "r"))
    _one_line_error(proc, f"{data}:2", "'answer'")


def test_impossible_combination_is_one_line_error(tmp_path):
    proc = run_in_process("train_sync.py", "--model", "tiny", "--samples-per-task", "1", "--out-dir",
                          str(tmp_path / "r"))
    _one_line_error(proc, "--samples-per-task")
