"""The trainer's replay buffer of scored sample groups (Kimi k1.5, arXiv:2501.12599): see `ReplayBuffer` for why
it lives with the trainer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

from common.experience import Experience
from common.trainer.filters import drop_stale, trained_version


@dataclass
class _StoredGroup:
    experiences: list[Experience]
    version: int      # the oldest trained version in the group (filters.trained_version)
    uses: int         # trainer steps that trained on it so far
    order: int        # arrival number (newer first on ties)

    @property
    def priority(self) -> int:
        return self.version - self.uses


class ReplayBuffer:
    """Trainer side: whole sample groups, each trained at most `max_reuse` times (the fresh step counts as one).

    Why the trainer: it sees every explorer's batches, knows its own version (so staleness is exact), and nothing
    crosses a process boundary twice; explorers stay the same in every schedule.

    Every step trains on the fresh groups plus up to `groups_per_step` stored groups (0: as many as are fresh),
    taken by priority = trained version - uses (newer first; each earlier use costs as much as one version of age),
    ties newest arrival first. Groups used `max_reuse` times, with a sample the trainer's staleness rule drops
    (filters.drop_stale, with `max_staleness` when given), or beyond `capacity` (lowest priority first) leave or are
    never stored. Groups whose rewards are all equal are not stored when
    `skip_uniform` (they carry no policy gradient: the trainer would drop them again). Group ids are renumbered per
    step so groups from different explorers or steps never merge.
    """

    def __init__(self, max_reuse: int, groups_per_step: int = 0, capacity: int = 64, max_staleness: int | None = None,
                 skip_uniform: bool = True):
        self.max_reuse, self.groups_per_step, self.capacity = max_reuse, groups_per_step, capacity
        self.staleness = None if max_staleness is None else SimpleNamespace(max_staleness=max_staleness)
        self.skip_uniform = skip_uniform
        self.stored: list[_StoredGroup] = []
        self.arrivals = 0

    @property
    def size(self) -> int:
        return sum(len(g.experiences) for g in self.stored)

    def mix(self, fresh: list[Experience], version: int) -> tuple[list[Experience], dict]:
        """What to train on at trainer version `version`: the fresh experiences (one explorer's batch) + replayed."""
        groups: dict[int, list[Experience]] = {}
        for e in fresh:
            groups.setdefault(e.group_id, []).append(e)
        replayed = self.take(self.groups_per_step or len(groups), version)
        for members in groups.values():
            if self._fresh_enough(members, version):
                self.add(members)
        batch = [dataclasses.replace(e, group_id=new_id)
                 for new_id, members in enumerate(list(groups.values()) + replayed) for e in members]
        return batch, {"replay/reused": sum(len(m) for m in replayed), "replay/size": self.size}

    def add(self, members: list[Experience]) -> None:
        if self.max_reuse <= 1 or (self.skip_uniform and len({e.reward for e in members}) <= 1):
            return
        self.arrivals += 1
        self.stored.append(_StoredGroup(members, min(trained_version(e) for e in members), 1, self.arrivals))
        if len(self.stored) > self.capacity:
            self.stored.sort(key=lambda g: (g.priority, g.order), reverse=True)
            del self.stored[self.capacity:]

    def take(self, n: int, version: int) -> list[list[Experience]]:
        """Up to n stored groups, highest priority first; each counts one more use."""
        self.stored = [g for g in self.stored if self._fresh_enough(g.experiences, version)]
        self.stored.sort(key=lambda g: (g.priority, g.order), reverse=True)
        chosen = self.stored[:n]
        for g in chosen:
            g.uses += 1
        self.stored = [g for g in self.stored if g.uses < self.max_reuse]
        return [g.experiences for g in chosen]

    def _fresh_enough(self, members: list[Experience], version: int) -> bool:
        """The trainer's staleness processor keeps every sample of the group at weights `version`."""
        return self.staleness is None or len(drop_stale(members, self.staleness, version)[0]) == len(members)
