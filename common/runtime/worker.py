"""A worker's side of the run: its rank in the world, the world's groups, the liveness watch, and how it ends.

World layout, computed from the configuration the same way on every rank (never from node rank, which c10d
rendezvous does not fix): ranks 0..T-1 are the data-parallel trainers, then one rank per explorer. So with one
trainer and N explorers the world is 1 + N ranks, and `torchrun --nnodes 2 --nproc-per-node 1` puts the trainer on
whichever node gets rank 0 and the explorer on the other. A device `cuda` means this rank's GPU (LOCAL_RANK, modulo
the GPUs of the node); `cuda:K` is that GPU.

Groups: `trainers` (data parallel), `sync` (trainer rank 0 + every explorer: the weight broadcast) and a gloo
group for the experience buffer (common/runtime/channel.py). Backend of the world, decided once every rank has said
where it runs (its node and its device's physical identity, through the store, before the process group forms):
nccl when every rank has a GPU of its own, gloo when all are on the CPU, else both ("cpu:gloo,cuda:nccl": each
collective picks by the tensors' device), because NCCL cannot connect two ranks on one GPU (colocated explorer +
trainer) or a CPU rank. Physical, because device names repeat: `cuda:0` on two nodes, or on every rank of a job that
shows each rank one GPU (Slurm --gpus-per-task=1), are different GPUs; a GPU is known by its UUID. Both also when
FSDP2 offloads to the CPU (--fsdp-cpu-offload): its sharded parameters and gradients live there, and gathering or
clipping them is a collective over CPU tensors (torchtitan adds cpu:gloo for the same reason).

The run's small shared state (stop flag, announced weight versions, liveness) lives in the c10d store that the
elastic agent already hosts. Every rank beats there once a second and watches the others: a peer silent for
--peer-timeout-s (killed, or its node lost) is a one-line error in seconds on every node, not a 30-minute hang.
Failures end the whole group (the agent kills every worker's process group: reward pools and sandboxes go too),
and whatever a worker started ends with it however it ends, kill -9 included (common/runtime/procs.py guard_group);
with `torchrun --max-restarts K` the agent restarts it and the workers resume from the newest checkpoint.
SIGTERM (preemption) and Ctrl-C make trainers save a checkpoint at the next step boundary, then exit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from common.runtime.channel import poll_key
from common.runtime._group_guard import stat
from common.runtime.procs import guard_group

# Set by SIGTERM / SIGINT in a worker. A trainer stops at once when it is between steps (waiting for experiences
# or weights), else at the end of the step it is in (`in_step`), and checkpoints on its way out.
stop_requested = threading.Event()
in_step = threading.Event()


@dataclass
class Worker:
    name: str                      # "trainer0", "explorer1", ...
    role: str                      # "trainer" | "explorer"
    index: int                     # index within its role
    device: str                    # as configured: cpu, cuda (this rank's GPU) or cuda:K


def plan_world(trainer_devices: list[str], explorer_devices: list[str]) -> list[Worker]:
    """Rank r of the world is plan_world(...)[r]."""
    return ([Worker(f"trainer{i}", "trainer", i, d) for i, d in enumerate(trainer_devices)]
            + [Worker(f"explorer{i}", "explorer", i, d) for i, d in enumerate(explorer_devices)])


def rank_device(device: str, local_rank: int) -> str:
    """A configured device on the rank with this LOCAL_RANK: bare `cuda` is the rank's own GPU."""
    if device != "cuda":
        return device
    return f"cuda:{local_rank % max(1, torch.cuda.device_count())}"


class Place(NamedTuple):
    """Where a rank runs: its node, its device as it names it, and what two ranks compare (`id`: "cpu", or the GPU's
    UUID, the same whichever index a process sees the GPU under)."""
    node: str
    device: str
    id: str

    def same(self, other: "Place") -> bool:
        return (self.node, self.id) == (other.node, other.id)


def place_of(device: torch.device) -> Place:
    """This process's Place on `device`."""
    gpu = f"GPU-{torch.cuda.get_device_properties(device).uuid}" if device.type == "cuda" else "cpu"
    return Place(socket.gethostname(), str(device), gpu)


def gather_places(store, rank: int, names: list[str], place: Place, timeout_s: float) -> list[Place]:
    """Every rank's Place, in rank order: each publishes its own in the store and reads the others'."""
    store.set(f"place/{rank}", json.dumps(place))
    deadline, places = time.time() + timeout_s, []
    for r, name in enumerate(names):
        if not poll_key(store, f"place/{r}", deadline - time.time()):
            raise TimeoutError(f"{names[rank]}: {name} (rank {r}) never said where it runs ({timeout_s:.0f}s)")
        places.append(Place(*json.loads(store.get(f"place/{r}"))))
    return places


def own_gpus(places: list[Place]) -> bool:
    """Every rank on a GPU no other rank uses."""
    return bool(places) and all(p.id != "cpu" for p in places) and len({(p.node, p.id) for p in places}) == len(places)


def choose_backend(places: list[Place], cpu_collectives: bool = False) -> str:
    """nccl when every rank has a GPU of its own (and no collective runs over CPU tensors: `cpu_collectives`), gloo
    when none has one, else both (see module docstring)."""
    if all(p.id == "cpu" for p in places):
        return "gloo"
    return "nccl" if own_gpus(places) and not cpu_collectives else "cpu:gloo,cuda:nccl"


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
    names: list[str] = field(default_factory=list)  # every rank's worker name
    places: list[Place] = field(default_factory=list)  # every rank's Place
    trainer_group: Any = None
    sync_group: Any = None
    buffer_group: Any = None       # gloo, every rank: the experience buffer and the control channel
    store: Any = None              # the run's keys in the agent's c10d store (this restart attempt only)
    restart: int = 0               # TORCHELASTIC_RESTART_COUNT: > 0 when torchrun restarted the group
    _watchdog: Any = None
    _guard: Any = None             # the process that ends this rank's process group when the rank ends

    @property
    def sync_src(self) -> int:
        return self.trainer_ranks[0]

    @property
    def comm_device(self) -> torch.device:
        """Where weight-sync buffers live: the worker's GPU when every rank has its own (NCCL), else the CPU (gloo)."""
        return self.device if own_gpus(self.places) else torch.device("cpu")

    def wait_key(self, key: str, timeout_s: float, what: str) -> bytes:
        """A value another rank publishes in the store; TimeoutError naming who waits for what."""
        if not poll_key(self.store, key, timeout_s, every=0.05):
            raise TimeoutError(f"{self.name}: no {what} after {timeout_s:.0f}s")
        return self.store.get(key)

    def close(self, timeout_s: float) -> None:
        """This rank is done. Rank 0 waits for every other rank's done (their files are complete then)."""
        self.store.add(f"beat/{self.rank}", DONE)
        self.store.set(f"done/{self.rank}", "1")
        if self.rank == 0:
            for r in range(1, self.world_size):
                self.wait_key(f"done/{r}", timeout_s, f"end of {self.names[r]}")
        if self._watchdog is not None:
            self._watchdog.stop()
        dist.destroy_process_group()


def under_elastic() -> bool:
    """Started by torchrun or by `launch_local` (a torch elastic agent set RANK, LOCAL_RANK, ...)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def join_world(plan: list[Worker], timeout_s: float, peer_timeout_s: float,
               cpu_collectives: bool = False) -> WorkerContext:
    """This process's rank of the run: check the world size, join the process group and its sub-groups, start
    the liveness watch. A world of the wrong size is a one-line error before any model loads. `cpu_collectives`:
    some collective runs over CPU tensors although every rank has a GPU (--fsdp-cpu-offload)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if world_size != len(plan):
        trainers = sum(w.role == "trainer" for w in plan)
        raise SystemExit(f"error: the torchrun world has {world_size} ranks but the configuration needs "
                         f"{len(plan)}: {trainers} trainer(s) (--trainer-devices) + {len(plan) - trainers} "
                         f"explorer(s) (--explorer-devices / --num-explorers); set --nnodes x --nproc-per-node "
                         f"to {len(plan)}")
    me = plan[rank]
    os.environ["TANDEM_WORKER"] = me.name
    guard = guard_group()  # before this rank starts any process: none outlives it (vLLM's engine included)
    _install_signal_handlers(me.role)
    device = torch.device(rank_device(me.device, local_rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # The agent hosts the store (TORCHELASTIC_USE_AGENT_STORE); one key space per restart attempt.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                         is_master=not agent_store and rank == 0, timeout=timedelta(seconds=timeout_s))
    store = dist.PrefixStore(f"tandem/{os.environ['TORCHELASTIC_RUN_ID']}/{restart}", base)
    places = gather_places(store, rank, [w.name for w in plan], place_of(device), timeout_s)
    backend = choose_backend(places, cpu_collectives)
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s),
                            **({"device_id": device} if backend == "nccl" else {}))
    trainer_ranks = [r for r, w in enumerate(plan) if w.role == "trainer"]
    explorer_ranks = [r for r, w in enumerate(plan) if w.role == "explorer"]
    ctx = WorkerContext(
        name=me.name, role=me.role, index=me.index, rank=rank, world_size=world_size, device=device,
        backend=backend, trainer_ranks=trainer_ranks, explorer_ranks=explorer_ranks, names=[w.name for w in plan],
        places=places,
        trainer_group=dist.new_group(trainer_ranks), sync_group=dist.new_group(trainer_ranks[:1] + explorer_ranks),
        buffer_group=dist.new_group(backend="gloo"),
        store=store, restart=restart, _guard=guard)
    ctx._watchdog = Watchdog(ctx, peer_timeout_s, timeout_s)
    return ctx


def _install_signal_handlers(role: str) -> None:
    """SIGTERM (Slurm / Kubernetes preemption, torch elastic stopping the group) and SIGINT: trainers finish the
    step they are in, if any, and checkpoint (common/trainer/trainer.py); explorers have nothing to save: they stop
    now."""
    def handler(signum, frame):
        stop_requested.set()
        if role == "explorer":
            raise SystemExit(128 + signum)
        if not in_step.is_set():
            raise KeyboardInterrupt
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


class Watchdog:
    """Liveness over the store: a counter per rank, bumped every second; a peer whose counter stands still for
    `timeout_s` and that has not said it is done is dead (SIGKILL, crash in native code, node lost). The first
    rank to notice ends its process with one line naming the peer; torch elastic then stops (or restarts) all.
    A silent peer on this host whose process still runs is stalled, not dead (an overloaded machine can hold a
    process still for longer than `timeout_s`): it is reported once and given up on after `stall_s`."""

    running: Watchdog | None = None  # this process's, while it watches

    def __init__(self, ctx: WorkerContext, timeout_s: float, stall_s: float):
        self.ctx, self.timeout_s, self.stall_s = ctx, timeout_s, max(stall_s, timeout_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-watchdog", daemon=True)
        self._thread.start()
        Watchdog.running = self

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5)
        Watchdog.running = None

    @classmethod
    def name_the_dead(cls, error: BaseException) -> None:
        """A collective failed because a peer's connection closed (gloo: the peer was killed mid-broadcast): give
        the watch its timeout to end this process with the line naming that peer, instead of a traceback that
        names none. Returns if no peer goes silent."""
        chain, seen = [], error  # the channel's receive thread raises its own error from gloo's
        while seen is not None and len(chain) < 10:
            chain.append(str(seen))
            seen = seen.__cause__ or seen.__context__
        text = "\n".join(chain)
        if cls.running is not None and ("closed by peer" in text or "reset by peer" in text):
            deadline = time.time() + cls.running.timeout_s + 3
            try:  # until the watch names the peer, or the agent stops this worker (it knows who died): report
                while cls.running._thread.is_alive() and time.time() < deadline and not stop_requested.is_set():
                    cls.running._thread.join(timeout=0.2)
            except (KeyboardInterrupt, SystemExit):
                pass

    def _run(self):
        ctx, peers = self.ctx, [r for r in range(self.ctx.world_size) if r != self.ctx.rank]
        last, reported = {r: (-1, time.time()) for r in peers}, set()
        try:
            ctx.store.set(f"pid/{ctx.rank}", str(os.getpid()))
            while not self._stop.wait(1.0):
                ctx.store.add(f"beat/{ctx.rank}", 1)
                now = time.time()
                for r in peers:
                    beat, silent = ctx.store.add(f"beat/{r}", 0), now - last[r][1]
                    if beat >= DONE:
                        continue
                    if beat != last[r][0]:
                        last[r] = (beat, now)
                        reported.discard(r)
                    elif silent > self.timeout_s and (running := self._running(r)) and silent <= self.stall_s:
                        if r not in reported:
                            reported.add(r)
                            print(f"[tandem] {ctx.name}: {ctx.names[r]} (rank {r}) has been silent for {silent:.0f}s "
                                  "but its process still runs (stalled: an overloaded machine?); waiting up to "
                                  f"--timeout-s {self.stall_s:.0f}s", file=sys.stderr, flush=True)
                    elif silent > self.timeout_s:
                        why = ("its process still runs but stalled (--timeout-s)" if running else
                               "its process died or its node is unreachable; see that node's log")
                        _die(f"error: {ctx.name}: {ctx.names[r]} (rank {r}) has been silent for {silent:.0f}s "
                             f"(--peer-timeout-s): {why}")
        except (RuntimeError, dist.DistError) as e:  # the store itself is gone: the node hosting it died
            if not self._stop.is_set():
                _die(f"error: {ctx.name}: lost the run's store at {os.environ.get('MASTER_ADDR')}:"
                     f"{os.environ.get('MASTER_PORT')} ({str(e).splitlines()[0][:120]}): the node of rank 0 "
                     "stopped or is unreachable")

    def _running(self, r: int) -> bool:
        """Rank r runs on this host, and its process exists and is no zombie (/proc: Linux; elsewhere: never)."""
        ctx = self.ctx
        if ctx.places[r].node != ctx.places[ctx.rank].node or not ctx.store.check([f"pid/{r}"]):
            return False
        return stat(int(ctx.store.get(f"pid/{r}")))[:1] not in ([], ["Z"], ["X"])


ENGINE_READY = "engine_ready"  # an explorer's key in the run's store once its engine is up (common/run.py engines_first)
DONE = 10**12  # added to a rank's beat counter when it is done: silence is then expected


def _die(line: str) -> None:
    report_error(line)
    _exit(1, line)


# ----------------------------------------------------------------------------- failures, as the agent reports them
def report_error(message: str, tb: str = "") -> None:
    """Write this worker's failure where torch elastic reads it (TORCHELASTIC_ERROR_FILE), for the launcher's
    one-line report (`_root_cause`)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"py_callstack": tb, "timestamp": str(int(time.time())),
                                                          "time": time.time()}}}
    with open(path, "w") as f:
        json.dump(data, f)


def _exit(code: int, text: str = "") -> None:
    """Leave now, without interpreter teardown: a gloo thread still blocked in a receive would abort it."""
    if text and not os.environ.get("TANDEM_LOCAL"):  # under `python train_X.py` the launcher prints the report
        print(text, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_worker(fn, *args) -> None:
    """Run a worker's main. A one-line error (SystemExit("error: ...")) or a traceback is reported to the agent
    and printed once (by this worker under torchrun, by the launcher under python), then the process exits."""
    name = os.environ.get("TANDEM_WORKER", f"rank{os.environ.get('RANK')}")
    try:
        fn(*args)
    except KeyboardInterrupt:
        if not stop_requested.is_set():
            raise
        # SIGTERM / Ctrl-C: the trainer checkpointed on its way out (common/trainer/trainer.py)
        _exit(143, f"[tandem] {os.environ.get('TANDEM_WORKER', name)}: stopped by a signal")
    except SystemExit as e:
        if e.code in (0, None):
            return
        if not (isinstance(e.code, str) and e.code.startswith("error: ")):
            _exit(e.code if isinstance(e.code, int) else 1)
        name = os.environ.get("TANDEM_WORKER", name)
        line = e.code if e.code.startswith(f"error: {name}") else f"error: {name}: {e.code[len('error: '):]}"
        report_error(line)
        _exit(1, line)
    except BaseException as e:
        tb = traceback.format_exc()
        Watchdog.name_the_dead(e)
        report_error(f"{type(e).__name__}: {e}", tb)
        _exit(1, tb.rstrip())
