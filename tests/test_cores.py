"""The thread plan (common/runtime/cores.py): workers that compute on the CPU at the same time get disjoint cores and
as many threads; workers that take turns get every core. Checked on the plan and on a real run's processes."""

import os
import subprocess
import sys
import time

import pytest

from common.runtime.cores import CoreShare, apply, describe, plan_cores
from tests.conftest import ROOT, TINY, worker_pid

ASYNC = [("trainer0", "trainer", "cpu"), ("explorer0", "explorer", "cpu")]


def test_concurrent_cpu_workers_split_the_cores():
    shares = plan_cores(ASYNC, together=True, available=[0, 1])
    assert shares == {"trainer0": CoreShare((0,), 1, True), "explorer0": CoreShare((1,), 1, True)}
    eight = plan_cores([*ASYNC, ("explorer1", "explorer", "cpu")], together=True, available=list(range(8)))
    assert [s.cores for s in eight.values()] == [(0, 1, 2), (3, 4, 5), (6, 7)]
    assert [s.threads for s in eight.values()] == [3, 3, 2]
    assert describe(eight) == ("trainer0 cores 0-2, 3 threads; explorer0 cores 3-5, 3 threads; explorer1 cores 6,7, "
                               "2 threads")


def test_workers_that_take_turns_or_compute_on_a_gpu_keep_every_core():
    sync = plan_cores(ASYNC, together=False, available=[0, 1])
    assert all(s == CoreShare((0, 1), 2, False) for s in sync.values())
    # data-parallel trainers step at the same time even in train_sync.py: they split; the explorer idles meanwhile
    dp = plan_cores([("trainer0", "trainer", "cpu"), ("trainer1", "trainer", "cpu"), ("explorer0", "explorer", "cpu")],
                    together=False, available=[0, 1, 2, 3])
    assert [s.cores for s in dp.values()] == [(0, 1), (2, 3), (0, 1, 2, 3)] and not dp["explorer0"].bound
    gpu = plan_cores([("trainer0", "trainer", "cuda:0"), ("explorer0", "explorer", "cpu")], together=True,
                     available=[0, 1])
    assert all(s == CoreShare((0, 1), 2, False) for s in gpu.values())


def test_overrides_and_more_workers_than_cores():
    assert plan_cores(ASYNC, together=True, available=[0, 1, 2, 3], num_threads=1)["explorer0"] == \
        CoreShare((2, 3), 1, True)
    unbound = plan_cores(ASYNC, together=True, available=[0, 1, 2, 3], bind=False)
    assert all(s == CoreShare((0, 1, 2, 3), 2, False) for s in unbound.values())
    crowded = plan_cores([*ASYNC, ("explorer1", "explorer", "cpu")], together=True, available=[0, 1])
    assert [s.cores for s in crowded.values()] == [(0,), (1,), (0,)]
    assert describe(crowded).endswith("(more CPU workers than cores: some share one)")


def test_apply_binds_the_process_and_its_children():
    cores = sorted(os.sched_getaffinity(0))
    code = ("import os, subprocess, sys, torch\nfrom common.runtime.cores import CoreShare, apply\n"
            f"apply(CoreShare(({cores[-1]},), 1, True))\n"
            "child = subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'], "
            "capture_output=True, text=True).stdout.strip()\n"
            "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads(), child)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.split() == [f"[{cores[-1]}]", "1", f"[{cores[-1]}]"], out.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a split needs 2 cores")
def test_async_run_binds_trainer_and_explorer_to_their_own_cores(tmp_path):
    """A real train_async.py run: while it trains, its trainer and explorer processes are bound to the cores the
    plan gives them (disjoint), and the run's first lines print that plan."""
    expected = plan_cores(ASYNC, together=True, available=sorted(os.sched_getaffinity(0)), num_threads=1)
    assert not set(expected["trainer0"].cores) & set(expected["explorer0"].cores)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_async.py"), *TINY, "--bind-cores", "--steps",
                             "3", "--out-dir", str(tmp_path / "run")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        seen = {}
        for rank, name in enumerate(("trainer0", "explorer0")):
            pid = worker_pid(proc.pid, rank)
            deadline = time.time() + 120  # the rank binds itself first thing, before it joins the world
            while time.time() < deadline:
                try:
                    seen[name] = tuple(sorted(os.sched_getaffinity(pid)))
                except ProcessLookupError:
                    break
                if seen[name] == expected[name].cores:
                    break
                time.sleep(0.05)
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert seen == {name: s.cores for name, s in expected.items()}
    assert proc.returncode == 0, out[-3000:]
    assert f"[tandem] cores: {describe(expected)}" in out


def test_async_defaults_follow_the_placement():
    """Where an explorer shares a device with the trainer (here: the CPU), the stream holds one batch of groups and
    takes weights only between batches; given flags and separate devices keep the streaming defaults."""
    from common.cli import parse_args
    from train_async import Args

    shared = parse_args(Args, ["--tasks-per-step", "4"])
    assert shared.inflight_groups == 4 and not shared.mid_generation_updates
    given = parse_args(Args, ["--tasks-per-step", "4", "--mid-generation-updates", "--inflight-groups", "12"])
    assert given.inflight_groups == 12 and given.mid_generation_updates
    apart = parse_args(Args, ["--tasks-per-step", "4", "--explorer-devices", "cuda:0", "--trainer-devices", "cuda:1"])
    assert apart.inflight_groups == 8 and apart.mid_generation_updates
