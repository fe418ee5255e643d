"""Schedules (b), (c), (d) with the tiny model, checked from the recorded timeline; staleness; checkpoint sync
atomicity; a killed explorer stops the run; torchrun launches and W&B offline tracking."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from common.runtime.metrics import read_metrics, read_timeline
from common.weight_sync import weights_hash
from common.weight_sync.checkpoint import latest_sync_version, write_sync_checkpoint
from tests.conftest import ROOT, TINY, assert_trained, left_of, process_tree, run_in_process, worker_pid


def _syncs(events, process, phases=("sync",)):
    return [e for e in events if e["process"] == process and e["phase"] in phases and "version" in e]


def test_offpolicy_trains_every_batch_one_version_behind(tmp_path):
    out = tmp_path / "run"
    proc = run_in_process("train_offpolicy.py", *TINY, "--steps", "4", "--out-dir", str(out), "--verify-sync")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = assert_trained(out, steps=4)
    assert [r["staleness/max"] for r in rows] == [0, 1, 1, 1]  # the first batch has nothing older to be
    assert [r["staleness/mean"] for r in rows] == [0, 1, 1, 1]
    events = read_timeline(str(out))
    trainer, explorer = _syncs(events, "trainer0"), _syncs(events, "explorer0")
    assert [(e["version"], e["hash"]) for e in trainer] == [(e["version"], e["hash"]) for e in explorer]
    # Overlap: rollout k+1 does not wait for the weights trained on batch k. It runs on version k-1, and the explorer
    # takes version k only after it, while the trainer trains batch k (on the tiny model either may end first).
    rollouts = {e["step"]: e for e in events if e["phase"] == "rollout"}
    pulls = {e["version"]: e for e in explorer}
    for k in (1, 2, 3):
        assert rollouts[k + 1]["version"] == k - 1, (k, rollouts[k + 1])
        assert rollouts[k + 1]["end"] <= pulls[k]["start"], k


@pytest.mark.parametrize("explorers,method", [(1, "broadcast"), (1, "checkpoint")])  # 2: test_multinode.py
def test_async_respects_staleness_and_syncs_weights(tmp_path, explorers, method):
    """The checkpoint run also logs to W&B offline with --track when no API key is set (the same run under
    `torchrun --nproc-per-node 2`: the README's command, tests/test_readme.py). The broadcast run's HF engine streams
    through the slots of its static KV cache (the CUDA default), weights landing between its steps, and its
    held-out evaluations share that running batch with the groups (common/explorer/evaluation.py)."""
    out = tmp_path / "run"
    flags = [*TINY, "--steps", "6", "--out-dir", str(out), "--verify-sync", "--num-explorers", str(explorers),
             "--sync-method", method, "--max-staleness", "1",
             *(["--hf-cache", "static", "--eval-every", "3"] if method == "broadcast" else [])]
    track = ["--track"] if method == "checkpoint" else []
    proc = run_in_process("train_async.py", *flags, *track, env={"WANDB_API_KEY": None})
    assert proc.returncode == 0, proc.stderr[-3000:]
    if method == "broadcast":
        assert "tandem's decode loop over a static KV cache" in proc.stdout
    else:
        assert list((out / "wandb").glob("offline-run-*"))
    rows = assert_trained(out, steps=6)
    assert len(rows) == 6 and all(r["staleness/max"] <= 1 for r in rows)
    assert all(r["staleness/dropped_min"] >= 2 for r in rows if r["filter/stale_dropped"])  # dropped: too old
    events = read_timeline(str(out))
    phases = ("sync", "sync-checkpoint")
    sent = {e["version"]: e["hash"] for e in _syncs(events, "trainer0", phases)}
    for i in range(explorers):
        received = _syncs(events, f"explorer{i}", phases)
        assert received, f"explorer{i} never took weights"
        for e in received:  # every version an explorer holds is bit-identical to what the trainer sent
            assert e["hash"] == sent[e["version"]]
        assert received[-1]["version"] == 6  # everyone ends on the final weights
    got = [e for e in events if e["phase"] == "wait" and "get" in e]
    assert len(got) >= 6
    if method == "broadcast":  # before step 1, before step 4 (or when the explorer next holds newer weights), final
        versions = [e["eval/version"] for e in json.loads((out / "summary.json").read_text())["evals"]]
        assert versions[0] == 0 and versions[-1] == 6 and versions == sorted(versions) and len(versions) >= 2


def test_async_drops_stale_samples_then_a_killed_explorer_stops_the_run(tmp_path):
    """Two explorers, a staleness bound of 0 and a queue of 2 cannot keep everything: some samples must go, too old
    and counted. Then explorer1 is killed with SIGKILL: the run stops within seconds, naming it, nothing left."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_async.py"), *TINY, "--steps", "100000",
                             "--out-dir", str(out), "--num-explorers", "2", "--max-staleness", "0",
                             "--queue-size", "2"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    try:
        deadline = time.time() + 120
        rows = []
        while time.time() < deadline and not (len(rows) >= 3 and any(r["filter/stale_dropped"] for r in rows)):
            time.sleep(0.2)
            rows = read_metrics(str(out))
        tree = process_tree(proc.pid)  # the workers, their reward workers, ...
        killed_at = time.time()
        os.kill(worker_pid(proc.pid, 2), signal.SIGKILL)  # trainer0, explorer0, explorer1
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert len(rows) >= 3, "the run did not get going"
    assert all(r["staleness/max"] == 0 for r in rows)  # what was trained was fresh
    dropped = [r for r in rows if r["filter/stale_dropped"]]
    assert dropped and all(r["staleness/dropped_min"] >= 1 for r in dropped)  # what was dropped was too old
    assert rows[-1]["dropped_stale"] == sum(r["filter/stale_dropped"] for r in rows)  # the run's total
    assert time.time() - killed_at < 10
    assert proc.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors and "explorer1" in errors[0] and "signal 9" in errors[0], stderr[-2000:]
    left = left_of(tree, timeout=5)
    assert not left, f"processes left behind: {left}"


_WRITER = """
import sys, torch
from common.weight_sync.checkpoint import write_sync_checkpoint
tensors = [("w", torch.full((64, 1024, 1024), float(sys.argv[2])))]  # 256 MB: the save takes a while
print("start", flush=True)
write_sync_checkpoint(sys.argv[1], tensors, version=int(sys.argv[2]))
"""


def test_checkpoint_sync_never_loads_half_written(tmp_path):
    sync_dir = str(tmp_path / "sync")
    small = [("w", torch.full((64, 1024, 1024), 1.0))]
    write_sync_checkpoint(sync_dir, small, version=1)
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, sync_dir, "2"], cwd=ROOT, stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": ROOT})
    assert writer.stdout.readline().strip() == b"start"
    deadline = time.time() + 30
    while not [d for d in os.listdir(sync_dir) if d.startswith(".tmp")] and time.time() < deadline:
        time.sleep(0.005)
    writer.send_signal(signal.SIGKILL)  # mid-save: the temp folder exists, the rename has not happened
    writer.wait(timeout=10)
    assert latest_sync_version(sync_dir) == 1
    loaded = load_file(os.path.join(sync_dir, f"v{latest_sync_version(sync_dir)}", "model.safetensors"))
    assert weights_hash(loaded.items()) == weights_hash(small)
