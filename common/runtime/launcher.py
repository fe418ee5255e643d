"""Spawn the workers of one run, join them into one torch.distributed world, and supervise them.

World layout: ranks 0..T-1 are trainers (data parallel), then one rank per explorer. Groups: `trainers` and
`sync` (trainer rank 0 + every explorer). Backend: nccl when every worker has a GPU of its own; gloo when all are
on the CPU; otherwise both ("cpu:gloo,cuda:nccl", each collective picks by the tensors' device): data-parallel
trainers on GPUs all-reduce over NCCL, and the weight sync goes through the CPU over gloo, because NCCL cannot
connect two ranks on one GPU (colocated explorer + trainer) or a CPU rank.

The first worker to fail makes the launcher print its traceback, kill every worker's process group (so reward
pools and sandboxes they started go too) and exit non-zero. Ctrl-C asks the trainers to save a checkpoint first.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_any
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.runtime.procs import die_with_parent, kill_group


@dataclass
class WorkerSpec:
    name: str                      # "trainer0", "explorer1", ...
    role: str                      # "trainer" | "explorer"
    device: str
    fn: Callable                   # fn(ctx: WorkerContext, *args)
    args: tuple = ()


@dataclass
class WorkerContext:
    name: str
    role: str
    index: int                     # index within its role
    rank: int
    world_size: int
    device: torch.device
    backend: str
    trainer_ranks: list[int]
    explorer_ranks: list[int]
    trainer_group: Any = None
    sync_group: Any = None

    @property
    def sync_src(self) -> int:
        return self.trainer_ranks[0]

    @property
    def comm_device(self) -> torch.device:
        """Where weight-sync buffers live: the worker's GPU under nccl, the CPU under gloo (or a colocated GPU)."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    @property
    def trainer_comm_device(self) -> torch.device:
        """Where the data-parallel trainers' collectives run: their GPUs (always distinct) or the CPU."""
        return self.device if self.device.type == "cuda" else torch.device("cpu")


def normalize_device(device: str) -> str:
    """'cuda' -> 'cuda:0' (so placements can be compared); other names unchanged."""
    return "cuda:0" if device == "cuda" else device


def choose_backend(devices: list[str]) -> str:
    """nccl when every worker has a GPU of its own, gloo when none has one, else both (see module docstring)."""
    devices = [normalize_device(d) for d in devices]
    if not any(d.startswith("cuda") for d in devices):
        return "gloo"
    if all(d.startswith("cuda") for d in devices) and len(set(devices)) == len(devices):
        return "nccl"
    return "cpu:gloo,cuda:nccl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank, world_size, addr, port, backend, specs, num_threads, timeout_s, error_queue):
    spec = specs[rank]
    os.setsid()  # own process group: the launcher can kill the worker together with its children
    die_with_parent()
    # Ctrl-C reaches trainers from the launcher (checkpoint first); explorers are stopped by the launcher.
    signal.signal(signal.SIGINT, signal.default_int_handler if spec.role == "trainer" else signal.SIG_IGN)
    torch.set_num_threads(num_threads)
    try:
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # Under torchrun the agent's store owns MASTER_PORT and TORCHELASTIC_USE_AGENT_STORE would make rank 0 join
        # it as a client; this world has its own store on its own port.
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s),
                                **({"device_id": device} if backend == "nccl" else {}))
        trainer_ranks = [i for i, s in enumerate(specs) if s.role == "trainer"]
        explorer_ranks = [i for i, s in enumerate(specs) if s.role == "explorer"]
        ctx = WorkerContext(
            name=spec.name, role=spec.role, index=[s.name for s in specs if s.role == spec.role].index(spec.name),
            rank=rank, world_size=world_size, device=device, backend=backend,
            trainer_ranks=trainer_ranks, explorer_ranks=explorer_ranks,
            trainer_group=dist.new_group(trainer_ranks), sync_group=dist.new_group(trainer_ranks[:1] + explorer_ranks),
        )
        spec.fn(ctx, *spec.args)
        dist.destroy_process_group()
    except KeyboardInterrupt:
        sys.exit(130)
    except BaseException as e:  # report any failure (SystemExit included) to the launcher, then exit non-zero
        if isinstance(e, SystemExit) and e.code in (0, None):
            return
        one_line = isinstance(e, SystemExit) and isinstance(e.code, str) and e.code.startswith("error: ")
        error_queue.put((spec.name, e.code if one_line else traceback.format_exc()))  # a user-facing error: as is
        sys.stdout.flush()
        os._exit(1)


def _kill_group(proc, sig=signal.SIGKILL):
    kill_group(proc.pid, sig)


def launch(specs: list[WorkerSpec], num_threads: int = 1, timeout_s: float = 900.0) -> None:
    """Run every worker to completion; on the first failure stop all and exit non-zero with its traceback."""
    backend = choose_backend([s.device for s in specs])
    # Under torchrun MASTER_ADDR is honoured; its MASTER_PORT may be held by the agent's store, so the world of
    # spawned workers gets its own free port unless TANDEM_PORT says otherwise.
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("TANDEM_PORT") or _free_port())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("error: run tandem with torchrun --nproc-per-node 1 (it spawns its own workers)")
    ctx = mp.get_context("spawn")
    start_quiet_resource_tracker()  # no-op when prepare_run already did
    error_queue = ctx.SimpleQueue()
    procs = []
    for rank, spec in enumerate(specs):
        p = ctx.Process(target=_worker_main, name=spec.name, daemon=False,
                        args=(rank, len(specs), addr, port, backend, specs, num_threads, timeout_s, error_queue))
        os.environ["TANDEM_WORKER"] = spec.name  # inherited by the spawned worker: names it in ps / /proc
        p.start()
        os.environ.pop("TANDEM_WORKER")
        procs.append(p)
    try:
        _supervise(procs, specs, error_queue)
    except KeyboardInterrupt:
        print("\n[tandem] interrupted: trainers save a checkpoint, then everything stops", file=sys.stderr)
        for p, s in zip(procs, specs):
            if s.role == "trainer" and p.is_alive():
                os.kill(p.pid, signal.SIGINT)
        deadline = time.time() + 60
        for p, s in zip(procs, specs):
            if s.role == "trainer":
                p.join(timeout=max(0.1, deadline - time.time()))
        _stop_all(procs)
        raise SystemExit(130) from None


def start_quiet_resource_tracker():
    """Start multiprocessing's resource tracker with stderr to /dev/null. Its only output is "leaked semaphore"
    warnings about queues of workers the launcher had to kill (it unlinks them anyway); printed at exit, they would
    bury the run's one-line error. Called before the entry script makes its queues (they start the tracker)."""
    from multiprocessing import resource_tracker

    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _stop_all(procs):
    for p in procs:
        _kill_group(p, signal.SIGTERM)
    deadline = time.time() + 3
    for p in procs:
        p.join(timeout=max(0.05, deadline - time.time()))
    for p in procs:
        _kill_group(p, signal.SIGKILL)  # the group too: children of workers that already exited
        p.join(timeout=1)


def _supervise(procs, specs, error_queue):
    alive = {p.sentinel: p for p in procs}
    while alive:
        for sentinel in wait_for_any(list(alive), timeout=1.0):
            p = alive.pop(sentinel)
            p.join(timeout=5)  # the sentinel fires before the exit code is collected
            if p.exitcode != 0:
                name, tb = _root_cause(procs, error_queue)
                _stop_all(procs)
                if tb.startswith("error: "):  # a one-line error (full disk, bad checkpoint): no traceback
                    raise SystemExit(f"error: {name}: {tb[len('error: '):]}")
                print(f"[tandem] worker {name} failed; all workers stopped.\n{tb}", file=sys.stderr, flush=True)
                last = tb.strip().splitlines()[-1] if tb.strip() else "no message"
                raise SystemExit(f"error: worker {name} failed: {last}")
            _kill_group(p)  # whatever the finished worker left behind


def _root_cause(procs, error_queue) -> tuple[str, str]:
    """The failure that started it: a worker killed by a signal (its peers then fail with 'connection closed'),
    else the earliest reported traceback."""
    time.sleep(0.5)  # let the peers of a dead worker notice and report
    for p in procs:
        if p.exitcode is not None and p.exitcode < 0:
            return p.name, f"{p.name} was killed by signal {-p.exitcode} (no traceback: killed or crashed in native code)"
    deadline = time.time() + 2
    while time.time() < deadline:
        if not error_queue.empty():
            return error_queue.get()
        time.sleep(0.05)
    failed = next(p for p in procs if p.exitcode not in (0, None))
    return failed.name, f"{failed.name} exited with code {failed.exitcode} and reported no traceback"
