"""Several nodes, tested as several torchrun agents on localhost (`--nnodes 2 --node-rank 0/1`, static, and one
c10d rendezvous): the trainer on one node, explorers on the other; faults handled by torch elastic."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from common.runtime.metrics import read_metrics, read_timeline
from common.trainer.checkpoints import step_checkpoints
from common.explorer.engine_vllm import vllm_available
from conftest import (ROOT, TINY, assert_trained, engines, files_left, kill_all, left_of, process_tree,
                      shm_files, wait_running, worker_pid)

pytestmark = pytest.mark.timeout(300)
ENV = {**os.environ, "PYTHONPATH": ROOT}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(node_rank: int, nnodes: int, nproc: int, port: int, script: str, *args: str, cwd=ROOT, rdzv="static",
         torchrun=()):
    """One torchrun agent: a 'node' of the run."""
    where = (["--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]
             if rdzv == "static" else ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                       "--rdzv-id", f"test{port}"])
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                             "--nproc-per-node", str(nproc), *where, *torchrun, os.path.join(ROOT, script), *args],
                            cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def finish(*procs, timeout=240) -> list[str]:
    errs = []
    for p in procs:
        try:
            errs.append(p.communicate(timeout=timeout)[1])
        finally:
            p.kill()
    return errs


def _hashes_match(out, explorers, last_version):
    events = read_timeline(str(out))
    phases = ("sync", "sync-checkpoint")
    sent = {e["version"]: e["hash"] for e in events if e["process"] == "trainer0" and e["phase"] in phases
            and "version" in e}
    for i in range(explorers):
        got = [e for e in events if e["process"] == f"explorer{i}" and e["phase"] in phases and "version" in e]
        assert got and all(e["hash"] == sent[e["version"]] for e in got), f"explorer{i}: {got}"
        assert got[-1]["version"] == last_version


@pytest.mark.parametrize("script", ["train_sync.py", "train_offpolicy.py"])
def test_trainer_on_one_node_explorer_on_the_other(tmp_path, script):
    """Static rendezvous for sync; c10d for off-policy (ranks are then assigned by the rendezvous, and the roles
    still follow them)."""
    out, port = tmp_path / "run", _port()
    args = [*TINY, "--steps", "3", "--out-dir", str(out), "--verify-sync"]
    rdzv = "static" if script == "train_sync.py" else "c10d"
    errs = finish(node(0, 2, 1, port, script, *args, rdzv=rdzv), node(1, 2, 1, port, script, *args, rdzv=rdzv))
    # torch elastic's exit barrier races its store's host: node 0's agent leaves as soon as every agent has arrived,
    # and node 1's agent, held still between its arrival and its wait on a loaded machine, then logs the closed
    # store (its own lines, after the run ended); the run's processes must print no traceback.
    errs = ["\n".join(line for line in e.splitlines() if "elastic/agent/server/api.py" not in line) for e in errs]
    assert "Traceback" not in errs[1], errs[1][-3000:]
    assert_trained(out, steps=3)
    _hashes_match(out, 1, 3)
    assert all("Traceback" not in e for e in errs), errs


def test_async_two_explorers_on_two_nodes(tmp_path):
    """Node 0: trainer0 + explorer0; node 1: explorer1. Both explorers feed the one buffer across nodes and end
    on the final weights, bit-identical to the trainer's."""
    out, port = tmp_path / "run", _port()
    args = [*TINY, "--steps", "6", "--out-dir", str(out), "--verify-sync", "--num-explorers", "2",
            "--max-staleness", "1", "--sync-method", "broadcast"]  # what auto picks across real nodes
    finish(node(0, 2, 2, port, "train_async.py", *args), node(1, 2, 1, port, "train_async.py", *args))
    rows = assert_trained(out, steps=6)
    assert all(r["staleness/max"] <= 1 for r in rows)
    _hashes_match(out, 2, 6)
    got = {e["get"].split("-")[0] for e in read_timeline(str(out)) if e["phase"] == "wait" and "get" in e}
    assert got == {"0", "1"}, "both explorers' batches reach the trainer"


def test_dead_explorer_without_restarts_ends_both_nodes_in_seconds(tmp_path):
    """kill -9 of the explorer on node 1: node 1's agent stops; node 0 (no process of its own died) learns it from
    the liveness watch and exits non-zero within --peer-timeout-s, naming the dead worker; no process is left."""
    out, port = tmp_path / "run", _port()
    args = [*TINY, "--steps", "100000", "--out-dir", str(out), "--peer-timeout-s", "3"]
    n0, n1 = node(0, 2, 1, port, "train_sync.py", *args), node(1, 2, 1, port, "train_sync.py", *args)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(read_metrics(str(out))) < 2:
            time.sleep(0.2)
        tree = {**process_tree(n0.pid), **process_tree(n1.pid)}
        killed_at = time.time()
        os.kill(worker_pid(n1.pid, 1), signal.SIGKILL)
        err0, _ = finish(n0, n1, timeout=60)
    finally:
        n0.kill(), n1.kill()
    assert time.time() - killed_at < 20
    assert n0.returncode != 0 and n1.returncode != 0
    errors = [line for line in err0.splitlines() if "error:" in line and "explorer0" in line]
    assert errors, err0[-3000:]
    assert not left_of(tree, timeout=5)


WATCH = """
import socket, sys, time
from types import SimpleNamespace
import torch.distributed as dist
from common.runtime.worker import Place, Watchdog
store, here = dist.HashStore(), Place(socket.gethostname(), "cpu", "cpu")
store.set("pid/1", sys.argv[1])
ctx = SimpleNamespace(rank=0, world_size=2, store=store, name="trainer0", names=["trainer0", "explorer0"],
                      places=[here, here])
Watchdog(ctx, 1.0, 4.0)
time.sleep(30)
"""


@pytest.mark.parametrize("peer", ["stopped", "dead"])
def test_liveness_watch_waits_for_a_stalled_peer_on_its_host_and_not_for_a_dead_one(peer):
    """A peer silent past --peer-timeout-s whose process still runs here (SIGSTOP: as a process an overloaded
    machine holds still) is reported once and given up on at --timeout-s; a dead one (reaped) ends the watch at
    --peer-timeout-s. The watch runs in its own process (it ends that process)."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        if peer == "dead":
            sleeper.kill(), sleeper.wait()
        else:
            os.kill(sleeper.pid, signal.SIGSTOP)
        watch = subprocess.run([sys.executable, "-c", WATCH, str(sleeper.pid)], cwd=ROOT, env=ENV,
                               capture_output=True, text=True, timeout=60)
    finally:
        sleeper.kill(), sleeper.wait()
    lines = [line for line in watch.stderr.splitlines() if "explorer0 (rank 1) has been silent" in line]
    assert watch.returncode == 1, watch.stderr[-2000:]
    if peer == "dead":
        assert len(lines) == 1 and "its process died" in lines[0], watch.stderr[-2000:]
    else:
        assert len(lines) == 2 and "still runs (stalled" in lines[0] and "stalled (--timeout-s)" in lines[1], lines


@pytest.mark.timeout(420)
def test_kill9_under_max_restarts_resumes_with_every_step_once(tmp_path):
    """torchrun --max-restarts 2, one run: the trainer killed with SIGKILL after step 3, then (in the restarted
    group) the explorer after step 5, checkpoints every 2 steps: each time the agent restarts the group and the new
    workers resume from the newest checkpoint on their own; metrics.jsonl holds steps 1..8 once each."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--max-restarts", "2", os.path.join(ROOT, "train_sync.py"), *TINY, "--steps", "8",
                             "--checkpoint-every", "2", "--out-dir", str(out), "--stall-log-s", "600"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        for victim, after in ((0, 3), (1, 5)):  # trainer0, then the restarted group's explorer0
            deadline = time.time() + 150
            while time.time() < deadline and len({r["step"] for r in read_metrics(str(out))}) < after:
                time.sleep(0.01)
            os.kill(worker_pid(proc.pid, victim), signal.SIGKILL)
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    rows = assert_trained(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert any(r.get("resumed") for r in rows), "the restarted groups resumed from a checkpoint"
    assert err.count("resuming from") == 2, err[-3000:]  # once per restart, each from its newest checkpoint


@pytest.mark.skipif(not vllm_available()[0], reason=vllm_available()[1])
@pytest.mark.timeout(500)
def test_vllm_explorer_kill9_under_max_restarts_then_agent_kill9_leave_nothing(tmp_path):
    """torchrun --max-restarts 1 with the vLLM engine. kill -9 of the explorer: within 10 s nothing of the first
    attempt is left (its engine core ignores SIGTERM and would hold the explorer's GPU memory share); once the agent
    has restarted the group, the run has exactly one engine. Then kill -9 of the torchrun agent: within 10 s nothing
    of the run is left, processes or the shared-memory files they mapped."""
    out = tmp_path / "run"
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "--master-port", str(_port()), "--max-restarts", "1",
                              os.path.join(ROOT, "train_async.py"), *TINY, "--engine", "vllm",
                              "--vllm-kv-cache-gb", "0.25", "--steps", "100000", "--out-dir", str(out)],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=(tmp_path / "stderr").open("w"), env=ENV)
    first, after_restart, left, restarted = {}, {}, {}, {}
    try:
        first = wait_running(agent.pid, out)
        first_files = shm_files(first)
        os.kill(worker_pid(agent.pid, 1), signal.SIGKILL)
        left = left_of(first, timeout=10)
        left_files = files_left(first_files)
        deadline = time.time() + 240
        # The second attempt's engine core and its worker have started (the worker is forked from the core and
        # carries the core's name until it renames itself: counted before that, it would be a second engine).
        while time.time() < deadline and not (engines(restarted) and any(
                p[-1].startswith("VLLM::Worker") for p in restarted.values())):
            restarted = {pid: p for pid, p in process_tree(agent.pid).items() if pid not in first}
            time.sleep(0.2)
        running_engines = engines(restarted) + engines(left_of(first, timeout=0))
        files = shm_files(restarted)
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(timeout=30)
        after_restart = left_of({**first, **restarted}, timeout=10)
    finally:
        agent.kill()
        kill_all({**left, **after_restart})
    assert engines(first), first
    assert first_files, first
    got = (left, left_files, len(running_engines), after_restart, files_left(files))
    assert got == ({}, [], 1, {}, []), "left of the first attempt 10 s after kill -9 of its explorer (processes, " \
        "shared-memory files), engines after the restart, left of the run 10 s after kill -9 of the agent " \
        f"(processes, files): {got}"


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    """SIGTERM (what Slurm and Kubernetes send before preempting) to `python train_sync.py`: the trainer saves a
    checkpoint of the last finished step, everything exits within the grace period, no traceback; --resume goes
    on from there."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_sync.py"), *TINY, "--steps", "100000",
                             "--checkpoint-every", "1000", "--out-dir", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(read_metrics(str(out))) < 2:
            time.sleep(0.1)
        tree = process_tree(proc.pid)
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert time.time() - sent < 15
    assert proc.returncode != 0 and "Traceback" not in err, err[-3000:]
    assert "stopped by SIGTERM" in err.strip().splitlines()[-1]
    steps = [r["step"] for r in read_metrics(str(out))]
    assert [s for s, _ in step_checkpoints(str(out))] == [steps[-1]]  # the last finished step, saved
    assert not left_of(tree, timeout=5)


def test_node_that_never_joins_is_one_line_within_the_rendezvous_timeout(tmp_path):
    port = _port()
    start = time.time()
    proc = node(0, 2, 1, port, "train_sync.py", *TINY, "--steps", "1", "--out-dir", str(tmp_path / "run"),
                torchrun=["--rdzv-conf", "timeout=2"])
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and time.time() - start < 60
    assert "1/2 clients joined" in err or "Timed out" in err, err[-2000:]


def test_checkpoint_sync_needs_a_folder_every_node_sees(tmp_path):
    """--sync-method checkpoint with a relative --out-dir from two working folders: the explorer's node does not see
    the trainer's folder, and says so in one line before any model loads."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    port = _port()
    # --peer-timeout-s 3: the trainer's node learns that its peer stopped from the liveness watch; the default 15 s
    # would only be waited out.
    args = [*TINY, "--steps", "2", "--out-dir", "run", "--sync-method", "checkpoint", "--peer-timeout-s", "3"]
    _, err1 = finish(node(0, 2, 1, port, "train_sync.py", *args, cwd=tmp_path / "a"),
                     node(1, 2, 1, port, "train_sync.py", *args, cwd=tmp_path / "b"), timeout=120)
    lines = [line for line in err1.splitlines() if line.startswith("error: explorer0 on node")]
    assert lines and str(tmp_path / "a" / "run" / "sync") in lines[0] and "shared filesystem" in lines[0], err1[-2000:]
    assert not (tmp_path / "a" / "run" / "timeline" / "explorer0.jsonl").exists()
