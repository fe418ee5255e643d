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

`--num-threads N` sets every worker's thread count; `--no-bind-cores` leaves the affinity to the OS.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CoreShare:
    cores: tuple[int, ...]   # the cores the process may run on
    threads: int             # torch / OpenMP threads
    bound: bool              # the process is bound to `cores` (else it keeps its whole affinity)


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
    return shares


def describe(shares: dict[str, CoreShare]) -> str:
    """One line: each worker's cores and threads."""
    def cores(c: tuple[int, ...]) -> str:
        return f"{c[0]}-{c[-1]}" if len(c) > 2 and c == tuple(range(c[0], c[-1] + 1)) else ",".join(map(str, c))
    parts = [f"{name} cores {cores(s.cores)}{'' if s.bound else ' (unbound)'}, {s.threads} thread"
             f"{'s' if s.threads > 1 else ''}" for name, s in shares.items()]
    shared = len({s.cores for s in shares.values() if s.bound}) < sum(s.bound for s in shares.values())
    return "; ".join(parts) + (" (more CPU workers than cores: some share one)" if shared else "")


def apply(share: CoreShare) -> None:
    """Bind this process (before it starts threads or children) and set its torch thread count."""
    import torch

    if share.bound:
        os.sched_setaffinity(0, share.cores)
    torch.set_num_threads(share.threads)
