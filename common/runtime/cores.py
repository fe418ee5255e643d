"""Which CPU cores each worker of a node computes on: one plan from the placement and the schedule, printed in the
run's first lines and applied by every rank as it starts (common/run.py `launch`).

- Workers that compute on the CPU at the same time get disjoint cores: the process is bound to them
  (`os.sched_setaffinity`, which what it starts inherits: vLLM's engine core and worker, reward workers) and runs as
  many torch / OpenMP threads as it has cores. vLLM's CPU worker binds its OpenMP threads to the same cores
  (common/explorer/engine_vllm.py). Left to the OS, two processes that each assume every core (or spin on any core
  while they wait, as vLLM's engine core and worker do for a second after every message unless
  common/compat/vllm.py bounds it) preempt each other's threads mid-matmul, and the overlap the
  asynchronous schedules exist for turns into contention.
- Workers that take turns (train_sync.py: the explorer idles while the trainers step) each use every core: they are
  not bound. Data-parallel trainers step at the same time, so they still split the cores among themselves.
- Workers on a GPU compute there: they keep every core and take none from the split.
- More CPU workers than cores: each gets one core, shared round-robin (said in the plan's line).
- Lending (with the CPU tuning, common/runtime/cpu_tuning.py): while the trainers of a node have nothing to compute
  an explorer that splits the node's cores with them computes on theirs too (`CoreShare.wide`: the node's explorers
  divide the trainers' cores), and the other way round for the trainers' last step. The hand-overs do it: a
  trainer lends while it waits for a batch (`lending`, in the run's store: how many batches it has taken), an
  explorer widens until its first hand-over and for the final evaluation, gives the cores back as it hands a batch
  over (`handing_over`, `narrow`) and, streaming, looks between two engine steps whether every trainer waits having
  taken every batch handed over (`follow`). Each change re-binds every thread of the process and of what it started
  (vLLM's engine core and worker, reward workers) and sets the torch threads, the vLLM worker's included
  (`RolloutEngine.use_cores`), and is recorded in the process's timeline (`record_to`: a "cores" event with each
  thread's cores as the OS then has them).

`--num-threads N` sets every worker's thread count; `--no-bind-cores` leaves the affinity to the OS.
"""

from __future__ import annotations

import dataclasses
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from common.runtime._group_guard import stat


@dataclass(frozen=True)
class CoreShare:
    cores: tuple[int, ...]   # the cores the process may run on
    threads: int             # torch / OpenMP threads
    bound: bool              # the process is bound to `cores` (else it keeps its whole affinity)
    wide: CoreShare | None = None  # an explorer's share while the trainers wait (`widen`); None: it keeps its own


def plan_cores(workers: list[tuple[str, str, str]], together: bool, available: list[int], num_threads: int = 0,
               bind: bool = True, lend: bool = True) -> dict[str, CoreShare]:
    """`workers`: (name, role, device) of this node's ranks, trainers first; `together`: explorers and trainers
    compute at the same time (every schedule but train_sync.py); `available`: this node's cores; `lend`: the idle
    side's cores go to the busy side (`widened`; common/runtime/cpu_tuning.py)."""
    available = sorted(available)
    cpu = [(name, role) for name, role, device in workers if device == "cpu"]
    splitting = [name for name, role in cpu if together or role == "trainer"]
    shares = {}
    if len(splitting) > 1 and bind:
        if len(splitting) <= len(available):
            size, extra = divmod(len(available), len(splitting))
            start = 0
            for i, name in enumerate(splitting):  # the first workers (trainers) take the remainder
                n = size + (i < extra)
                shares[name] = CoreShare(tuple(available[start:start + n]), num_threads or n, True)
                start += n
        else:
            for i, name in enumerate(splitting):
                shares[name] = CoreShare((available[i % len(available)],), num_threads or 1, True)
    elif len(splitting) > 1:  # not bound (--no-bind-cores): the cores still split by thread count
        for name in splitting:
            shares[name] = CoreShare(tuple(available), num_threads or max(1, len(available) // len(splitting)), False)
    for name, _, _ in workers:
        shares.setdefault(name, CoreShare(tuple(available), num_threads or len(available), False))
    if not lend:
        return shares
    return widened(shares, [name for name, role in cpu if name in splitting and role == "explorer"], num_threads)


def widened(shares: dict[str, CoreShare], explorers: list[str], num_threads: int) -> dict[str, CoreShare]:
    """The rule for the stretches where one side has nothing to compute: while the trainers wait for a batch the
    bound trainers' cores go to the bound explorers; during the trainers' last step (every batch handed over, the
    explorers wait for the final weights) the bound explorers' cores go to the bound trainers. Each side's cores
    are divided among the other side as the split divides (the first take the remainder)."""
    bound = [name for name, s in shares.items() if s.bound]
    explorers = [name for name in explorers if name in bound]
    trainers = [name for name in bound if name not in explorers]
    return {**shares, **lent(shares, explorers, trainers, num_threads),
            **lent(shares, trainers, explorers, num_threads)}


def lent(shares: dict[str, CoreShare], takers: list[str], givers: list[str], num_threads: int) -> dict[str, CoreShare]:
    """The takers' shares with, as their `wide` share, the givers' cores that no taker holds."""
    held = {c for name in takers for c in shares[name].cores}
    spare = sorted({c for name in givers for c in shares[name].cores} - held)
    out, start = {}, 0
    size, extra = divmod(len(spare), max(len(takers), 1))
    for i, name in enumerate(takers):
        n = size + (i < extra)
        if n:
            cores = tuple(sorted(shares[name].cores + tuple(spare[start:start + n])))
            out[name] = dataclasses.replace(shares[name], wide=CoreShare(cores, num_threads or len(cores), True))
        start += n
    return out


WHEN_WIDE = {"explorer": "while the trainers wait", "trainer": "for the last step"}


def describe(shares: dict[str, CoreShare]) -> str:
    """One line: each worker's cores and threads."""
    def cores(c: tuple[int, ...]) -> str:
        return f"{c[0]}-{c[-1]}" if len(c) > 2 and c == tuple(range(c[0], c[-1] + 1)) else ",".join(map(str, c))
    def threads(n: int) -> str:
        return f"{n} thread{'s' if n > 1 else ''}"
    parts = [f"{name} cores {cores(s.cores)}{'' if s.bound else ' (unbound)'}, {threads(s.threads)}"
             + (f" (cores {cores(s.wide.cores)}, {threads(s.wide.threads)} {WHEN_WIDE[name.rstrip('0123456789')]})"
                if s.wide else "")
             for name, s in shares.items()]
    shared = len({s.cores for s in shares.values() if s.bound}) < sum(s.bound for s in shares.values())
    return "; ".join(parts) + (" (more CPU workers than cores: some share one)" if shared else "")


_applied: CoreShare | None = None  # this process's share (`apply`)
_taken: CoreShare | None = None  # the share it computes on now: its own or its wide one
_name = ""  # this worker's name (the launcher's trainer<i> / explorer<i>)
_lenders: list[str] = []  # the trainers whose cores this node's explorers take while they wait
_looked = 0.0  # when `follow` last read the store
_timeline = None  # where changes of share are recorded (`record_to`)
PUT_KEY = "cores/put"  # in the run's store: batches the explorers have handed over (`handing_over`)


def waiting_key(trainer: str) -> str:
    """In the run's store: 1 + the batches `trainer` had taken when it began to wait for the next, 0 while it
    computes (`lending`)."""
    return f"cores/waiting/{trainer}"


def apply(share: CoreShare, shares: dict[str, CoreShare] | None = None, name: str = "") -> None:
    """Bind this process (before it starts threads or children) and set its torch thread count. `shares`: the whole
    node's (which trainers lend their cores to its explorers while they wait), `name`: this worker's."""
    global _applied, _taken, _name, _lenders
    if share.bound:
        os.sched_setaffinity(0, share.cores)
    torch.set_num_threads(share.threads)
    _applied = _taken = share
    shares = shares or {}
    lenders = [n for n, s in shares.items() if n.startswith("trainer") and s.bound]
    _name, _lenders = name, lenders if any(n.startswith("explorer") and s.wide for n, s in shares.items()) else []


def record_to(timeline) -> None:
    """Record every change of share from now on in `timeline` (common/runtime/metrics.py)."""
    global _timeline
    _timeline = timeline


def widen(engine=None) -> bool:
    """Take the wide share (the other side's cores too) while the other side has nothing to compute; whether there
    is one. Every thread of this process and of its children moves; `engine` (a RolloutEngine, if it is built) sets
    its own compute threads (vLLM: the worker's OpenMP threads)."""
    return _take(_applied.wide if _applied else None, engine)


def narrow(engine=None) -> bool:
    """Give the other side's cores back (it is about to compute): this process's own share again."""
    return _take(_applied if _applied and _applied.wide else None, engine)


@contextmanager
def lending(store, taken: int):
    """A trainer waiting for its batch number `taken` + 1 (inside this block): while every batch handed over so far
    has been taken, its cores are the node's explorers' (`follow`)."""
    lends = _name in _lenders
    if lends:
        store.add(waiting_key(_name), taken + 1)
    try:
        yield
    finally:
        if lends:
            store.add(waiting_key(_name), -(taken + 1))


def handing_over(store, engine=None) -> None:
    """An explorer about to put a batch in the queue: its own cores again first (the trainer computes as soon as it
    has the batch, and a worker thread of ours left on its cores would stall both), and the batch counted, so that
    `follow` tells a trainer that waits for more from one that is about to take this one."""
    narrow(engine)
    if _lenders:
        store.add(PUT_KEY, 1)


def follow(store, engine=None, every_s: float = 0.02) -> None:
    """An explorer between two engine steps: on the trainers' cores too while every trainer of its node waits and
    has taken every batch handed over (`lending`, `handing_over`), on its own otherwise. Reads the store at most
    every `every_s` seconds."""
    global _looked
    if not _lenders or _applied.wide is None or time.monotonic() - _looked < every_s:
        return
    _looked = time.monotonic()
    handed = int(store.add(PUT_KEY, 0))
    idle = all(int(store.add(waiting_key(t), 0)) == handed + 1 for t in _lenders)
    _take(_applied.wide if idle else _applied, engine)


def _take(share: CoreShare | None, engine) -> bool:
    global _taken
    if share is None:
        return False
    if share == _taken:
        return True
    for pid in [os.getpid(), *descendants(os.getpid())]:
        bind_threads(pid, share.cores)
    torch.set_num_threads(share.threads)  # new OpenMP threads inherit the main thread's cores
    if engine is not None:
        engine.use_cores(share.cores, share.threads)
    _taken = share
    if _timeline is not None:
        now = time.time()
        _timeline.record("cores", now, now, cores=list(share.cores), threads=share.threads,
                         bound=sorted(map(list, thread_cores(os.getpid()))))
    return True


def bind_threads(pid: int, cores) -> None:
    """Bind every thread of process `pid` (os.sched_setaffinity binds only the one thread it names)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):  # ended meanwhile / not ours
            pass


def thread_cores(pid: int) -> set[tuple[int, ...]]:
    """The cores each thread of `pid` may run on now, as a set."""
    seen = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            seen.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
        except (ProcessLookupError, PermissionError):  # ended meanwhile / not ours
            pass
    return seen


def descendants(pid: int) -> list[int]:
    """The processes started by `pid`, their children, and so on (from /proc: ppid in each process's stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        fields = stat(entry) if entry.isdigit() else []
        if fields:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
