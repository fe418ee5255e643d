"""The thread plan (common/runtime/cores.py): workers that compute on the CPU at the same time get disjoint cores and
as many threads; workers that take turns get every core. Checked on the plan and on a real run's processes."""

import os
import subprocess
import sys

import pytest

from common.runtime.cores import CoreShare, describe, plan_cores
from common.runtime.metrics import read_timeline
from tests.conftest import ROOT, TINY, run_script

ASYNC = [("trainer0", "trainer", "cpu"), ("explorer0", "explorer", "cpu")]


def test_concurrent_cpu_workers_split_the_cores():
    shares = plan_cores(ASYNC, together=True, available=[0, 1])
    assert shares == {"trainer0": CoreShare((0,), 1, True, wide=CoreShare((0, 1), 2, True)),
                      "explorer0": CoreShare((1,), 1, True, wide=CoreShare((0, 1), 2, True))}
    assert describe(shares) == ("trainer0 cores 0, 1 thread (cores 0,1, 2 threads for the last step); explorer0 "
                                "cores 1, 1 thread (cores 0,1, 2 threads while the trainers wait)")
    eight = plan_cores([*ASYNC, ("explorer1", "explorer", "cpu")], together=True, available=list(range(8)))
    assert [s.cores for s in eight.values()] == [(0, 1, 2), (3, 4, 5), (6, 7)]
    assert [s.threads for s in eight.values()] == [3, 3, 2]
    # while the trainer waits its cores go to the explorers, divided as the split divides; for its last step the
    # explorers' go to it
    assert eight["trainer0"].wide == CoreShare(tuple(range(8)), 8, True)
    assert [eight[e].wide for e in ("explorer0", "explorer1")] == [CoreShare((0, 1, 3, 4, 5), 5, True),
                                                                   CoreShare((2, 6, 7), 3, True)]
    assert describe(eight) == ("trainer0 cores 0-2, 3 threads (cores 0-7, 8 threads for the last step); explorer0 "
                               "cores 3-5, 3 threads (cores 0,1,3,4,5, 5 threads while the trainers wait); explorer1 "
                               "cores 6,7, 2 threads (cores 2,6,7, 3 threads while the trainers wait)")


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
        CoreShare((2, 3), 1, True, wide=CoreShare((0, 1, 2, 3), 1, True))
    unbound = plan_cores(ASYNC, together=True, available=[0, 1, 2, 3], bind=False)
    assert all(s == CoreShare((0, 1, 2, 3), 2, False) for s in unbound.values())
    crowded = plan_cores([*ASYNC, ("explorer1", "explorer", "cpu")], together=True, available=[0, 1])
    assert [s.cores for s in crowded.values()] == [(0,), (1,), (0,)]
    assert crowded["explorer0"].wide is crowded["explorer1"].wide is None  # no core is the trainer's alone
    assert crowded["trainer0"].wide == CoreShare((0, 1), 2, True)  # explorer0's is: its last step takes it
    assert describe(crowded).endswith("(more CPU workers than cores: some share one)")


def test_cpu_tuning_is_one_switch_on_only_where_every_worker_is_on_the_cpu(monkeypatch):
    """--no-cpu-tuning (or any GPU worker) turns it off for the run: the plan then lends no cores, and the workers
    and vLLM's engine core read it from the environment (common/runtime/cpu_tuning.py)."""
    from common.cli import parse_args
    from common.runtime import cpu_tuning
    from train_async import Args

    monkeypatch.setenv(cpu_tuning.ENV, "1")  # restored after the test
    monkeypatch.delenv(cpu_tuning.ENV)
    assert cpu_tuning.enabled()  # a CPU process the launcher did not start
    assert parse_args(Args, []).cpu_tuning and not parse_args(Args, ["--no-cpu-tuning"]).cpu_tuning
    assert not cpu_tuning.decide(True, ["cpu", "cuda:0"]) and not cpu_tuning.enabled()
    assert not cpu_tuning.decide(False, ["cpu", "cpu"]) and not cpu_tuning.enabled()
    assert cpu_tuning.decide(True, ["cpu", "cpu"]) and cpu_tuning.enabled()
    assert all(s.wide is None for s in plan_cores(ASYNC, together=True, available=[0, 1], lend=False).values())
    assert plan_cores(ASYNC, together=True, available=[0, 1], lend=False)["explorer0"] == CoreShare((1,), 1, True)


def test_apply_binds_the_process_and_its_children():
    cores = sorted(os.sched_getaffinity(0))
    code = ("import os, subprocess, sys, torch\nfrom common.runtime.cores import CoreShare, apply\n"
            f"apply(CoreShare(({cores[-1]},), 1, True))\n"
            "child = subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'], "
            "capture_output=True, text=True).stdout.strip()\n"
            "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads(), child)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.split() == [f"[{cores[-1]}]", "1", f"[{cores[-1]}]"], out.stderr



LENDING = """
import os, torch
from torch.distributed import HashStore
from common.runtime import cores
shares = cores.plan_cores(WORKERS, together=True, available=AVAILABLE)
trainers = [name for name in shares if name.startswith("trainer")]
store = HashStore()
def state():
    return sorted(os.sched_getaffinity(0)), torch.get_num_threads()
cores.apply(shares["trainer0"], shares, "trainer0")  # as a trainer: says so while it waits
with cores.lending(store, 1):
    print(store.add(cores.waiting_key("trainer0"), 0))
print(store.add(cores.waiting_key("trainer0"), 0))
cores.apply(shares["explorer0"], shares, "explorer0")  # as the explorer, one batch handed over
store.add(cores.PUT_KEY, 1)
for waiting in [[0] * len(trainers), [2] + [0] * (len(trainers) - 1), [2] * len(trainers), [1] * len(trainers),
                [2] * len(trainers)]:
    for name, value in zip(trainers, waiting):
        store.set(cores.waiting_key(name), str(value))
    cores.follow(store, every_s=0)
    print(state())
cores.handing_over(store)
print((state(), store.add(cores.PUT_KEY, 0)))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a split needs 2 cores")
@pytest.mark.parametrize("trainers", [1, 2])
def test_the_explorer_computes_on_the_trainers_cores_while_every_trainer_waits(trainers):
    """Trainers say in the run's store how many batches they had taken when they began to wait (`lending`); the
    explorer takes their cores (its wide share) while every trainer of the node waits having taken every batch
    handed over, and gives them back before it hands the next over (`follow`, `handing_over`)."""
    available = sorted(os.sched_getaffinity(0))[:2]
    workers = [*(("trainer%d" % i, "trainer", "cpu") for i in range(trainers)), ("explorer0", "explorer", "cpu")]
    shares = plan_cores(workers, together=True, available=available)
    own, wide = shares["explorer0"], shares["explorer0"].wide
    code = LENDING.replace("WORKERS", repr(workers)).replace("AVAILABLE", repr(available))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[:2] == ["2", "0"]  # 1 + the batches it had taken, while it waits; 0 after
    # none waits; one of them (all of them when it is the only one); all; all, but the batch handed over not taken
    # yet; all again
    expect = [own, wide if trainers == 1 else own, wide, own, wide]
    assert lines[2:7] == [str((list(s.cores), s.threads)) for s in expect], out.stdout
    assert lines[7] == str(((list(own.cores), own.threads), 2)), out.stdout  # narrowed, then counted


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a split needs 2 cores")
def test_async_run_binds_trainer_and_explorer_to_their_own_cores(tmp_path):
    """A real train_async.py run: the run's first lines print the plan, and every change of a worker's cores is
    recorded in its timeline with each thread's cores as the OS then had them (bound by what the workers did, not
    by sampling). The explorer computes on the trainer's cores too (every thread of it, as many threads as cores:
    the plan's `wide`) until it hands its first batch over, on its own while the trainer trains, and on both again
    for the final evaluation; the trainer never runs on the explorer's cores but for its last step."""
    available = sorted(os.sched_getaffinity(0))
    expected = plan_cores(ASYNC, together=True, available=available)
    assert not set(expected["trainer0"].cores) & set(expected["explorer0"].cores)
    wide = expected["explorer0"].wide
    assert wide == CoreShare(tuple(available), len(available), True)
    # a fresh process: one forked from this one after it ran OpenMP regions with more than one thread would wait
    # forever at its first team barrier
    proc = run_script("train_async.py", *TINY, "--bind-cores", "--num-threads", "0", "--steps", "3",
                      "--out-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"[tandem] cores: {describe(expected)}" in proc.stdout
    events = read_timeline(str(tmp_path / "run"))
    changes = {name: [(tuple(e["cores"]), e["threads"], {tuple(c) for c in e["bound"]})
                      for e in sorted(events, key=lambda e: e["start"]) if e["process"] == name and e["phase"] == "cores"]
               for name in ("trainer0", "explorer0")}
    trainer, explorer = expected["trainer0"], expected["explorer0"]
    assert changes["trainer0"][-1] == (trainer.wide.cores, trainer.wide.threads, {trainer.wide.cores})  # last step
    assert all(c[0] in (trainer.cores, trainer.wide.cores) for c in changes["trainer0"]), changes["trainer0"]
    assert changes["explorer0"][0] == (wide.cores, wide.threads, {wide.cores}), changes["explorer0"]  # first batch
    own = (explorer.cores, explorer.threads, {explorer.cores})
    assert own in changes["explorer0"], changes["explorer0"]  # its own cores once it handed a batch over
    assert changes["explorer0"][-1][0] == wide.cores  # the final evaluation's


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
