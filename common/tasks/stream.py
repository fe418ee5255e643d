"""The training side of a taskset: a seeded, resumable stream of tasks (Kimi k1.5 samplers included)."""

from __future__ import annotations

import random


class TaskStream:
    """Seeded, resumable stream of training tasks: procedural (a generator) or a list.

    A list is cycled in shuffled epochs, unless one of the Kimi k1.5 samplers is on:
    - `sampling="prioritized"`: a task is drawn with weight 1 - its success rate so far (`record`; a task not yet
      tried counts as 0 success, so it has the highest weight); no repeats within a batch while the pool allows;
      when every open task is solved the draw is uniform.
    - `curriculum`: the difficulty levels (sorted, m of them) open from easy to hard over the run: while
      `progress` (trainer steps done / --steps) is in [k/m, (k+1)/m) tasks of the k+1 easiest levels are drawn
      (the easier ones stay in the mix); a procedural stream draws its level uniformly among the open ones.
    """

    def __init__(self, tasks: list[dict] | None = None, generator=None, seed: int = 0, levels: list | None = None,
                 sampling: str = "uniform", curriculum: bool = False):
        self.tasks, self.generator, self.seed = tasks, generator, seed
        self.sampling, self.curriculum = sampling, curriculum
        if levels is None:  # a list's levels matter only to the curriculum (which checked that every task has one)
            levels = sorted({t["difficulty"] for t in tasks}) if curriculum else []
        self.levels = levels
        self.attempts: dict[str, list[int]] = {}  # task id -> [successes, attempts] (prioritized sampling)
        self.position = 0

    def next_batch(self, n: int, progress: float = 1.0) -> list[dict]:
        levels = self.open_levels(progress)
        if self.generator is not None:
            out = [self._generated(self.position + i, levels) for i in range(n)]
        elif self.sampling == "uniform" and not self.curriculum:
            out = [self._shuffled(self.position + i) for i in range(n)]
        else:
            out = self._weighted(n, levels)
        self.position += n
        return out

    def open_levels(self, progress: float) -> list:
        if not self.curriculum:
            return self.levels
        return self.levels[:min(len(self.levels), 1 + int(progress * len(self.levels)))]

    def record(self, task_id: str, successes: list[bool]) -> None:
        """Outcomes of one task's samples (prioritized sampling learns its success rate from them)."""
        if self.sampling == "prioritized":
            counts = self.attempts.setdefault(task_id, [0, 0])
            counts[0] += sum(successes)
            counts[1] += len(successes)

    def success_rate(self, task_id: str) -> float:
        done, tried = self.attempts.get(task_id, (0, 0))
        return done / tried if tried else 0.0

    def _generated(self, index: int, levels: list) -> dict:
        level = random.Random(f"{self.seed}-level-{index}").choice(levels) if self.curriculum else levels[-1]
        return self.generator(random.Random(f"{self.seed}-{index}"), index, level)

    def _shuffled(self, index: int) -> dict:
        epoch, offset = divmod(index, len(self.tasks))
        order = list(range(len(self.tasks)))
        random.Random(f"{self.seed}-epoch-{epoch}").shuffle(order)
        return self.tasks[order[offset]]

    # ALGO LOGIC: Kimi k1.5 prioritized sampling (weight 1 - success rate) over the tasks the curriculum opened
    def _weighted(self, n: int, levels: list) -> list[dict]:
        pool = [t for t in self.tasks if not self.curriculum or t["difficulty"] in levels]
        base = [1.0 - self.success_rate(t["id"]) if self.sampling == "prioritized" else 1.0 for t in pool]
        if not any(base):
            base = [1.0] * len(pool)
        rng, weights, out = random.Random(f"{self.seed}-batch-{self.position}"), list(base), []
        for _ in range(n):
            if not any(weights):  # the pool is smaller than the batch: start drawing again
                weights = list(base)
            i = rng.choices(range(len(pool)), weights=weights)[0]
            out.append(pool[i])
            weights[i] = 0.0
        return out


def mark_trained(ledger: list | None, positions: list[int]) -> list:
    """The ledger [below, beyond] of stream positions a trainer has consumed (every position under `below`, and
    the sorted list `beyond`) after `positions` were consumed too. Streaming explorers (train_async.py) finish
    groups out of order, so a resumed explorer skips exactly these instead of restarting at step x batch size."""
    below, beyond = ledger or [0, []]
    seen = set(beyond) | set(positions)
    while below in seen:
        seen.discard(below)
        below += 1
    return [below, sorted(p for p in seen if p > below)]
