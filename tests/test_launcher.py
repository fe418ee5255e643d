"""The launcher with real processes (torch elastic, one process per rank): a failing worker stops everything, fast,
with its traceback, leaving nothing; the launcher killed with SIGKILL leaves nothing either; a world of the wrong
size is one line before anything loads."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from common.explorer.engine_vllm import vllm_available
from conftest import ROOT, TINY, alive, engines, files_left, kill_all, left_of, shm_files, wait_running

WORKERS = textwrap.dedent("""
    import os, subprocess, sys, time

    HOLDER = (  # maps a shared file, holds a run's file open, ignores SIGTERM (as vLLM's engine core does)
        "import mmap, os, signal, sys, time\\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
        "fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)\\n"
        "os.ftruncate(fd, 4096)\\n"
        "mapped = mmap.mmap(fd, 4096)\\n"
        "os.makedirs(sys.argv[2])\\n"
        "held = open(os.path.join(sys.argv[2], 'metrics.jsonl'), 'a')\\n"
        "open(sys.argv[3], 'w').close()\\n"
        "time.sleep(300)\\n")

    def main(ctx, pid_dir):
        if ctx.role == "trainer":  # sleeps; its child maps a shared file (never removed here) and opens a run's
            ready = os.path.join(pid_dir, "mapped")  # own file (an --out-dir under /dev/shm), open when the guard looks
            child = subprocess.Popen([sys.executable, "-c", HOLDER, f"/dev/shm/tandem-test-{os.getpid()}",
                                      f"/dev/shm/tandem-test-dir-{os.getpid()}", ready])
            deadline = time.time() + 60
            while not os.path.exists(ready) and time.time() < deadline:
                time.sleep(0.05)
            open(os.path.join(pid_dir, f"{ctx.name}.pid"), "w").write(f"{os.getpid()} {child.pid}")
            time.sleep(300)
        open(os.path.join(pid_dir, f"{ctx.name}.pid"), "w").write(str(os.getpid()))
        deadline = time.time() + 60  # the trainer's group has mapped its file
        while not os.path.exists(os.path.join(pid_dir, "trainer0.pid")) and time.time() < deadline:
            time.sleep(0.05)
        open(os.path.join(pid_dir, "failed_at"), "w").write(repr(time.time()))
        raise ValueError("boom from the failing worker")
""")


def test_failing_worker_stops_run_with_traceback_and_no_leftovers(tmp_path):
    (tmp_path / "workers.py").write_text(WORKERS)
    proc = subprocess.run([sys.executable, "-c", "from common.runtime.launcher import run_function; "
                           f"run_function('workers:main', 1, 1, {str(tmp_path)!r})"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, str(tmp_path)])})
    assert (tmp_path / "failed_at").exists()  # the explorer failed; the trainer was still asleep (300 s > timeout)
    assert proc.returncode != 0
    assert "ValueError: boom from the failing worker" in proc.stderr
    assert "Traceback" in proc.stderr and "workers.py" in proc.stderr  # the worker's own traceback
    assert proc.stderr.strip().splitlines()[-1] == "error: worker explorer0 failed: ValueError: boom from the " \
                                                   "failing worker", proc.stderr[-2000:]
    pids = [int(p) for f in ("trainer0.pid", "explorer0.pid") for p in (tmp_path / f).read_text().split()]
    deadline = time.time() + 10  # the guard killed the group before the run returned: wait for the reaping only
    while [p for p in pids if alive(p)] and time.time() < deadline:
        time.sleep(0.05)
    assert len(pids) == 3 and not [p for p in pids if alive(p)]
    assert not files_left({f"/dev/shm/tandem-test-{pids[0]}"})  # the trainer's group mapped it, was killed: removed
    kept = f"/dev/shm/tandem-test-dir-{pids[0]}"
    assert os.path.exists(f"{kept}/metrics.jsonl")  # a file, not a shared-memory object: kept
    shutil.rmtree(kept)


def made_before_the_fork(ctx, *paths):
    """A forked worker: the launcher's temporary folders are there while it runs; it makes one of its own, which
    its exit removes."""
    import atexit
    import tempfile

    assert all(os.path.isdir(p) for p in paths)
    own = tempfile.TemporaryDirectory(dir=paths[0])
    atexit.register(lambda: open(own.name + ".exited", "w").close())


def test_forked_workers_run_only_their_own_exit_handlers_and_finalizers():
    """Two temporary folders the launcher made before its forkserver forked, one removed by its finalizer, one by an
    exit handler (as wandb makes and registers its media folder when imported), outlive the forked workers' exits;
    what a worker registers itself runs at its exit, as in a fresh interpreter."""
    import atexit
    import tempfile

    from common.runtime.launcher import run_function, stop_forkserver

    by_finalizer, by_handler = tempfile.TemporaryDirectory(), tempfile.TemporaryDirectory()
    atexit.register(by_handler.cleanup)
    try:
        run_function("tests.test_launcher:made_before_the_fork", 1, 1, by_finalizer.name, by_handler.name)
        assert os.path.isdir(by_finalizer.name) and os.path.isdir(by_handler.name), \
            "a worker's exit removed the launcher's temporary folder"
        left = os.listdir(by_finalizer.name)
        assert len(left) == 2 and all(name.endswith(".exited") for name in left), left  # their own folders gone
    finally:
        stop_forkserver()
        atexit.unregister(by_handler.cleanup)
        by_finalizer.cleanup()
        by_handler.cleanup()


def test_world_of_the_wrong_size_is_one_line_per_rank(tmp_path):
    """torchrun with 3 ranks for a 1 trainer + 1 explorer configuration (named: without device flags the ranks are
    placed by themselves): each rank says so in one line, before any model loads (no timeline file is written)."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                           os.path.join(ROOT, "train_sync.py"), *TINY, "--steps", "1", "--trainer-devices", "cpu",
                           "--explorer-devices", "cpu", "--out-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines and all("the torchrun world has 3 ranks but the configuration needs 2" in line for line in lines), \
        proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not vllm_available()[0], reason=vllm_available()[1])
@pytest.mark.timeout(400)
def test_kill9_of_the_launcher_leaves_no_process_of_the_run(tmp_path):
    """kill -9 of `python train_async.py` itself (the elastic agent runs in it) while it trains with vLLM: within 10 s
    nothing of the run is left: no worker, no reward worker, no vLLM engine core (it ignores SIGTERM) or the worker
    process it started, and none of the shared-memory files they mapped (the weight buffers, vLLM's queues)."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_async.py"), *TINY, "--engine", "vllm",
                             "--vllm-kv-cache-gb", "0.25", "--steps", "100000", "--out-dir", str(out)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / "stderr").open("w"),
                            env={**os.environ, "PYTHONPATH": ROOT})
    left = {}
    try:
        tree = wait_running(proc.pid, out)
        files = shm_files(tree)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        left = left_of(tree, timeout=10)
    finally:
        proc.kill()
        kill_all(left)
    grandchildren = [pid for pid, (_, session, _) in tree.items() if session != pid]
    assert engines(tree) and grandchildren and files, tree  # the engine core, its worker, the reward workers, ...
    assert not left, f"left 10 s after kill -9 of the launcher: {left}"
    assert not files_left(files), files
