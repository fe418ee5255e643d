"""The training side of a taskset: a seeded, resumable stream of tasks (Kimi k1.5 samplers included), and who owns
its positions in train_async.py (`TrainedPositions` on the trainer's side, `StreamPositions` on an explorer's)."""

from __future__ import annotations

import json
import random

from common.experience import too_stale

TRAINED_KEY, OWED_KEY = "stream/trained", "stream/owed"  # in the run's store (`TrainedPositions`)


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

    def __init__(self, tasks: list[dict] | None = None, generator=None, seed: int = 0, difficulty: int = 1,
                 sampling: str = "uniform", curriculum: bool = False):
        self.tasks, self.generator, self.seed = tasks, generator, seed
        self.sampling, self.curriculum = sampling, curriculum
        if generator is not None:  # a procedural stream: levels 1..difficulty under the curriculum
            self.levels = list(range(1, difficulty + 1)) if curriculum else [difficulty]
        else:  # a list's levels matter only to the curriculum (which checked that every task has one)
            self.levels = sorted({t["difficulty"] for t in tasks}) if curriculum else []
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


class TrainedPositions:
    """The trainer's side: per explorer, the stream positions its batches used (trained, or dropped as too stale:
    used once either way), kept in every checkpoint and published in the run's store before the first weights (the
    explorers wait for those); a batch the trainer drops whole is owed again, one batch more for the explorers."""

    def __init__(self, saved: dict, store, main: bool):
        self.ledgers, self.store, self.main = saved, store, main  # explorer index (str) -> mark_trained's ledger
        if main:
            store.set(TRAINED_KEY, json.dumps(saved))

    def record(self, batch) -> None:
        """After the staleness rule: `batch` (a RolloutBatch) used its positions; with nothing left, it is owed."""
        if batch.positions:
            self.ledgers[str(batch.explorer)] = mark_trained(self.ledgers.get(str(batch.explorer)), batch.positions)
            if not batch.experiences and self.main:
                self.store.add(OWED_KEY, 1)


class StreamPositions:
    """An explorer's side: which position may start a group now (`admits`), which were spent without a batch
    (`spend`: a task a processor dropped, a zero-signal group replaced) and go out with the next one (`take_used`),
    and after a resume (`trained`: that explorer's ledger) which are trained already (`skip`) and where draws
    start (`start`)."""

    def __init__(self, args, trained: list | None = None, step: int = 0, store=None):
        self.n, self.max_staleness, self.store = args.tasks_per_step, args.max_staleness, store
        below, beyond = trained or [step * self.n, []]
        self.start = below // self.n * self.n  # draws start at multiples of --tasks-per-step, as they did
        self.skip = set(range(self.start, below)) | set(beyond)
        self.end = below + len(beyond) + (args.steps - step) * self.n  # after the run's last batch, were every
        self.replaced = self.dropped = self.owed = 0  # batch made from here; what was spent or owed moves it on
        self.used: list[int] = []

    @classmethod
    def published(cls, args, store, index: int, step: int) -> StreamPositions:
        """As `TrainedPositions` published them for explorer `index` (None: the run starts fresh)."""
        return cls(args, json.loads(store.get(TRAINED_KEY)).get(str(index)), step, store)

    def admits(self, position: int, version: int) -> bool:
        """A group may start at `position` with weights `version`: groups are trained roughly in stream order, so it
        trains at about trainer version (position - replaced) // --tasks-per-step, and must not be too stale then
        (AReaL's admission rule); nor may it start past the run's last batch (it would never be trained)."""
        if position >= self.end_position() and self.store is not None:
            self.owed = int(self.store.add(OWED_KEY, 0))  # the trainer may have dropped a batch whole since
        return position < self.end_position() and \
            not too_stale(version, (position - self.replaced) // self.n, self.max_staleness)

    def end_position(self) -> int:
        return self.end + self.replaced + self.dropped + self.owed * self.n

    def spend(self, position: int, replaced: bool) -> None:
        self.used.append(position)
        self.replaced += replaced
        self.dropped += not replaced

    def take_used(self) -> list[int]:
        used, self.used = self.used, []
        return used
