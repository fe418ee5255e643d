"""Runs that survive faults without losing or duplicating anything.

Real processes throughout: the trainer is killed with SIGKILL, a checkpoint is truncated on disk, the disk is a
real (small) tmpfs that fills up. Each asserts the exact metrics rows and checkpoints afterwards.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from common.trainer.checkpoints import step_checkpoints, verify
from common.runtime.metrics import read_metrics, rewind_metrics, wandb_offline_steps
from tests.conftest import ROOT, TINY, assert_trained, left_of, process_tree, run_in_process, worker_pid


def _steps(out) -> list[int]:
    return [r["step"] for r in read_metrics(str(out))]


def _checkpoints(out) -> list[str]:
    return sorted(os.path.basename(p) for _, p in step_checkpoints(str(out)))


def _leftovers(out) -> list[str]:
    return [os.path.join(root, d) for root, dirs, _ in os.walk(out) for d in dirs if d.startswith(".tmp-")]


def test_a_half_written_metrics_row_is_left_out_by_readers_and_dropped_on_resume(tmp_path):
    """A reader polling metrics.jsonl while the trainer appends (or after a kill mid-write) sees the complete rows
    only; resuming drops the cut row so the file is whole again."""
    rows = [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.write(json.dumps({"step": 3, "loss": 0.125})[:12])
    assert read_metrics(str(tmp_path)) == rows
    assert rewind_metrics(str(tmp_path), step=2) == 1
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(json.dumps(r) + "\n" for r in rows)


def test_kill9_trainer_then_resume_with_no_flags_gives_every_step_once(tmp_path):
    """kill -9 of the trainer after step 3 (last checkpoint: step 2); `--out-dir X --resume` alone continues with
    the saved config; metrics.jsonl and W&B then hold steps 1..5 once each, the redone ones marked resumed. Then the
    newest checkpoint is truncated: the next --resume falls back to the previous one with a one-line warning."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_sync.py"), *TINY, "--steps", "5",
                             "--checkpoint-every", "2", "--out-dir", str(out), "--track"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        trainer = worker_pid(proc.pid, 0)
        deadline = time.time() + 300
        while len(_steps(out)) < 3 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        tree = process_tree(proc.pid)  # the workers, the explorer's reward workers, ...
        os.kill(trainer, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0, err[-2000:]
    assert not left_of(tree, timeout=5)
    before = _steps(out)
    assert before[:3] == [1, 2, 3]
    last_checkpoint = max(s for s, _ in step_checkpoints(str(out)))
    assert last_checkpoint < before[-1], "the kill must leave metrics rows after the newest checkpoint"

    resumed = run_in_process("train_sync.py", "--out-dir", str(out), "--resume", env={"WANDB_API_KEY": None})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [bool(r.get("resumed")) for r in rows] == [s > last_checkpoint for s in range(1, 6)]
    # Every 2 steps (step 5 is off that grid, as in TRL), the newest 2 kept (--keep-checkpoints 2, the default).
    assert _checkpoints(out) == ["step_2", "step_4"]
    assert sorted(os.listdir(out / "final")) == ["chat_template.jinja", "config.json", "generation_config.json",
                                                 "manifest.json", "model.safetensors", "tokenizer.json",
                                                 "tokenizer_config.json"]  # model + tokenizer only
    assert not _leftovers(out)
    config = json.loads((out / "config.json").read_text())
    assert config["model"] == "tiny" and config["lr"] == 1e-3 and config["steps"] == 5  # the saved config
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    assert runs[0].name.split("-")[-1] == runs[1].name.split("-")[-1]  # the same W&B run id, continued
    steps1, steps2 = map(wandb_offline_steps, map(str, runs))
    assert sorted(steps1 + steps2) == [1, 2, 3, 4, 5], (steps1, steps2)

    # The same run, its newest checkpoint truncated: --resume falls back to the one before, with one warning.
    weights = out / "checkpoints" / "step_4" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    again = run_in_process("train_sync.py", "--out-dir", str(out), "--resume", "--steps", "6",
                           env={"WANDB_API_KEY": None})
    assert again.returncode == 0, again.stderr[-3000:]
    warnings = [line for line in again.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and str(weights) in warnings[0] and "truncated" in warnings[0], again.stderr[-2000:]
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [bool(r.get("resumed")) for r in rows] == [False, False, True, True, True, True]
    assert _checkpoints(out) == ["step_4", "step_6"]
    assert all(verify(p) is None for _, p in step_checkpoints(str(out)))


def _mount_tmpfs(path, size: str):
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or 'not root'}): the disk-full test needs one")


def test_full_disk_is_one_line_error_and_nothing_is_lost(tmp_path):
    """A 4 MB tmpfs holds two tiny checkpoints (1.1 MB each) but not the estimate for a third: the run stops with one
    line naming the folder, every metrics row and finished checkpoint stays, no partial folder; resuming on the
    same full disk is refused before any worker starts; once there is room the resumed run completes, each step
    once."""
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "4m")
    try:
        out = disk / "run"
        proc = run_in_process("train_sync.py", *TINY, "--steps", "6", "--checkpoint-every", "1", "--keep-checkpoints",
                              "0", "--out-dir", str(out))
        assert proc.returncode != 0
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("error: trainer0: no space for checkpoint step_3") and str(out / "checkpoints") in last
        assert _steps(out) == [1, 2, 3]
        assert _checkpoints(out) == ["step_1", "step_2"]
        assert all(verify(p) is None for _, p in step_checkpoints(str(out)))
        assert not _leftovers(out)

        timeline = (out / "timeline" / "trainer0.jsonl").read_text()
        again = run_in_process("train_sync.py", "--out-dir", str(out), "--resume")
        assert again.returncode != 0 and "Traceback" not in again.stderr
        assert again.stderr.strip().splitlines()[-1].startswith("error: no space for the next checkpoint")
        assert (out / "timeline" / "trainer0.jsonl").read_text() == timeline  # no worker started

        subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
        resumed = run_in_process("train_sync.py", "--out-dir", str(out), "--resume", "--keep-checkpoints", "2")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert _steps(out) == [1, 2, 3, 4, 5, 6]
        assert _checkpoints(out) == ["step_5", "step_6"]
        assert not _leftovers(out)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_failed_checkpoint_write_leaves_no_partial_folder(tmp_path, monkeypatch):
    """The free-space guard switched off, a save into a full tmpfs fails with ENOSPC mid-write: one-line error
    naming the folder, and the temporary folder is gone."""
    import torch

    from common.trainer import checkpoints
    from common.cli import parse_args
    from common.trainer.trainer import Trainer
    from train_sync import Args

    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "300k")  # the weights alone are 365 kB
    try:
        args = parse_args(Args, [*TINY, "--out-dir", str(disk / "run")])
        trainer = Trainer(args, torch.device("cpu"))
        monkeypatch.setattr(checkpoints, "ensure_free_space", lambda *a: None)
        with pytest.raises(SystemExit) as e:
            checkpoints.save(trainer, str(disk / "run"))
        assert str(e.value.code).startswith("error: could not write checkpoint step_0 in " + str(disk / "run"))
        assert "No space left" in str(e.value.code)
        assert os.listdir(disk / "run" / "checkpoints") == []
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_resume_reads_saved_config_and_refuses_frozen_changes(tmp_path):
    """--resume takes every field from the run's config.json; flags given again change only those fields; --model,
    --algo, --dtype cannot change; a run of another schedule is named."""
    import dataclasses

    import train_async
    from common.cli import parse_args
    from train_sync import Args

    out = tmp_path / "run"
    out.mkdir()
    saved = parse_args(Args, [*TINY, "--out-dir", str(out), "--lr", "0.003", "--steps", "7"])
    (out / "config.json").write_text(json.dumps({"schedule": "sync", **dataclasses.asdict(saved)}))
    args = parse_args(Args, ["--out-dir", str(out), "--resume"])
    assert dataclasses.asdict(args) == {**dataclasses.asdict(saved), "resume": True}
    args = parse_args(Args, ["--out-dir", str(out), "--resume", "--steps", "9", "--model", "tiny"])
    assert (args.steps, args.lr, args.model, args.max_new_tokens) == (9, 0.003, "tiny", 12)
    for flag, value in [("--model", "default"), ("--algo", "dr_grpo"), ("--dtype", "bfloat16")]:
        with pytest.raises(SystemExit) as e:
            parse_args(Args, ["--out-dir", str(out), "--resume", flag, value])
        assert str(e.value.code).startswith(f"error: {flag} cannot change when resuming"), e.value.code
    async_saved = parse_args(train_async.Args, [*TINY, "--out-dir", str(out)])
    (out / "config.json").write_text(json.dumps({"schedule": "async", **dataclasses.asdict(async_saved)}))
    with pytest.raises(SystemExit) as e:
        parse_args(Args, ["--out-dir", str(out), "--resume"])
    assert "another schedule (async" in str(e.value.code)


def slow_parity(response: str, task: dict) -> float:
    """The parity reward after 0.1 s per sample: the explorer's first batch (8 samples) is at least 0.8 s away, so a
    trainer waiting for it stalls past --stall-log-s 0.2 on any machine, however fast its workers start."""
    from rewards.parity import score

    time.sleep(0.1)
    return score(response, task).score


def test_trainer_says_which_explorer_it_waits_for(tmp_path):
    """End to end: with --stall-log-s 0.2 the trainer's wait for the explorer's first batch is logged, naming it."""
    proc = run_in_process("train_sync.py", *TINY, "--steps", "1", "--stall-log-s", "0.2", "--out-dir",
                          str(tmp_path / "run"), "--reward-fn", "tests.test_faults:slow_parity")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_trained(tmp_path / "run", steps=1)  # the slow reward still scores: a real policy-gradient step
    stalls = [line for line in proc.stderr.splitlines() if "no experience for" in line]
    assert stalls and all("waiting for explorer0" in s and "--timeout-s 900" in s for s in stalls), proc.stderr[-2000:]
    assert "trainer0 at step 0" in stalls[0] and "explorer0: no batch yet" in stalls[0]
