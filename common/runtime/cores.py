"""Which CPU cores each worker of a node computes on: one plan from the placement and the schedule, printed in the
run's first lines and applied by every rank as it starts (common/runtime/launcher.py `join_world`).

- Workers that compute on the CPU at the same time get disjoint cores: the process is bound to them
  (`os.sched_setaffinity`, which what it starts inherits: vLLM's engine core and worker, reward workers) and runs as
  many torch / OpenMP threads as it has cores. vLLM's CPU worker binds its OpenMP threads to the same cores
  (common/explorer/engine_vllm.py). Left to the OS, two processes that each assume every core (or spin on any core
  while they wait: vLLM's engine core polls its worker for a second after every step) preempt each other's threads
  mid-matmul, and the overlap the asynchronous schedules exist for turns into contention.
- Workers that take turns (train_sync.py: the explorer idles while the trainers step) each use every core: they are
  not bound. Data-parallel trainers step at the same time, so they still split the cores among themselves.
- Workers on a GPU compute there: they keep every core and take none from the split.
- More CPU workers than cores: each gets one core, shared round-robin (said in the plan's line).
- While the trainers have nothing to compute (before the first batch reaches them: the explorer's start-up, the
  evaluation before step 1 and the first batch; after their last step: the final evaluation) an explorer that
  splits a node's cores with them takes the trainers' cores too (`CoreShare.wide`: the node's explorers divide the
  trainers' cores among them), and gives them back when it hands over its first batch: `widen()` / `narrow()`,
  called by the explorer loops of train_async.py and train_offpolicy.py. They re-bind every thread of the process
  and of what it started (vLLM's engine core and worker, reward workers) and set the torch threads, the vLLM
  worker's included (its OpenMP threads: `RolloutEngine.use_cores`). The other way round, the trainers' last step
  takes the explorers' cores too: every batch is handed over then, and the explorers wait for the final weights
  (the trainer loops of train_async.py and train_sync.py, which train_offpolicy.py runs).

`--num-threads N` sets every worker's thread count; `--no-bind-cores` leaves the affinity to the OS.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CoreShare:
    cores: tuple[int, ...]   # the cores the process may run on
    threads: int             # torch / OpenMP threads
    bound: bool              # the process is bound to `cores` (else it keeps its whole affinity)
    wide: CoreShare | None = None  # an explorer's share while the trainers wait (`widen`); None: it keeps its own


def plan_cores(workers: list[tuple[str, str, str]], together: bool, available: list[int], num_threads: int = 0,
               bind: bool = True) -> dict[str, CoreShare]:
    """`workers`: (name, role, device) of this node's ranks, trainers first; `together`: explorers and trainers
    compute at the same time (every schedule but train_sync.py); `available`: this node's cores."""
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
    elif len(splitting) > 1:  # not bound: the cores still split by thread count, as before binding existed
        for name in splitting:
            shares[name] = CoreShare(tuple(available), num_threads or max(1, len(available) // len(splitting)), False)
    for name, _, _ in workers:
        shares.setdefault(name, CoreShare(tuple(available), num_threads or len(available), False))
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


def apply(share: CoreShare) -> None:
    """Bind this process (before it starts threads or children) and set its torch thread count."""
    import torch

    global _applied
    if share.bound:
        os.sched_setaffinity(0, share.cores)
    torch.set_num_threads(share.threads)
    _applied = share


def widen(engine=None) -> bool:
    """Take the wide share (the other side's cores too) while the other side has nothing to compute; whether there
    is one. Every thread of this process and of its children moves; `engine` (a RolloutEngine, if it is built) sets
    its own compute threads (vLLM: the worker's OpenMP threads)."""
    return _take(_applied.wide if _applied else None, engine)


def narrow(engine=None) -> bool:
    """Give the other side's cores back (it is about to compute): this process's own share again."""
    return _take(_applied if _applied and _applied.wide else None, engine)


def _take(share: CoreShare | None, engine) -> bool:
    import torch

    if share is None:
        return False
    for pid in [os.getpid(), *descendants(os.getpid())]:
        bind_threads(pid, share.cores)
    torch.set_num_threads(share.threads)  # new OpenMP threads inherit the main thread's cores
    if engine is not None:
        engine.use_cores(share.cores, share.threads)
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


def descendants(pid: int) -> list[int]:
    """The processes started by `pid`, their children, and so on (from /proc: ppid in each process's stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
