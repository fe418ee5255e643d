"""Data kept across steps (Kimi k1.5, arXiv:2501.12599): the explorer's unfinished responses (partial rollouts)
and the trainer's replay buffer of scored sample groups.

Partial rollouts (explorer side, `PartialRollouts`). With --rollout-token-budget B a rollout step gives every
unfinished response at most B new tokens. A response that has not stopped by then stays here and is continued in
later steps, with whatever weights the explorer has then: the prompt plus the response so far is the engine's
prompt, so the engine generates only the new segment and reports log-probs for its tokens (no engine method of its
own: HFEngine and VLLMEngine work as they are). A response ends at a stop token, or at --max-new-tokens in total
(finish "length"). A group (the samples of one task) leaves only when all of its responses have ended, so
group-normalised advantages and group reward shaping always see the whole group.

Which tokens are trained (`--partial-loss`) and which version an experience carries (staleness, Trainer.drop_stale):
- last_segment: only the tokens made by the response's newest weights count as on-policy; older segments keep
  their place in the context but get loss mask 0. The experience carries that newest version.
- all: every segment is trained against its own behaviour log-probs; the experience carries its oldest version,
  so the staleness bound applies to the oldest trained token.
Experience.segment_versions keeps the weights version of every response token either way.

Replay (trainer side, `ReplayBuffer`): see its docstring for why it lives with the trainer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from common.engine import Generation, RolloutEngine, SamplingConfig
from common.experience import Experience


@dataclass
class Response:
    """One sampled response, generated over one or more rollout steps (segments)."""
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)     # behaviour log-prob of each token, from its segment
    versions: list[int] = field(default_factory=list)       # weights version that made each token
    segments: int = 0
    finish_reason: str | None = None                        # None while unfinished, then "stop" or "length"

    def extend(self, generation: Generation, version: int, max_new_tokens: int) -> None:
        """Append one generated segment (cut to what is left of max_new_tokens) and decide whether it ended."""
        room = max_new_tokens - len(self.response_ids)
        ids = generation.response_ids[:room]
        self.response_ids += ids
        self.logprobs += generation.logprobs[:room]
        self.versions += generation.versions[:room] if generation.versions else [version] * len(ids)
        self.segments += 1
        if generation.finish_reason == "stop" and len(generation.response_ids) <= room:
            self.finish_reason = "stop"
        elif len(self.response_ids) >= max_new_tokens:
            self.finish_reason = "length"

    # ALGO LOGIC: which tokens of a partial rollout are trained, and how old the experience counts
    def loss_mask(self, partial_loss: str) -> list[int]:
        newest = self.versions[-1]
        return [1 if partial_loss == "all" or v == newest else 0 for v in self.versions]

    def trained_version(self, partial_loss: str) -> int:
        return min(self.versions) if partial_loss == "all" else self.versions[-1]


@dataclass
class Group:
    task: dict
    group_id: int
    responses: list[Response]


class PartialRollouts:
    """Sample groups in flight on one explorer: started, generated segment by segment, handed out once whole.

    With token_budget 0 (partial rollouts off) a segment is the whole --max-new-tokens, so every group ends in the
    round it started: the plain rollout.
    """

    def __init__(self, token_budget: int, max_new_tokens: int):
        self.segment_tokens = token_budget or max_new_tokens
        self.max_new_tokens = max_new_tokens
        self.groups: list[Group] = []

    def start(self, task: dict, group_id: int, prompt_ids: list[int], n: int) -> None:
        self.groups.append(Group(task, group_id, [Response(list(prompt_ids)) for _ in range(n)]))

    def unfinished(self) -> list[Response]:
        return [r for g in self.groups for r in g.responses if r.finish_reason is None]

    def generate(self, engine: RolloutEngine, sampling: SamplingConfig, version: int, between_steps=None) -> dict:
        """One round: every unfinished response gets its next segment from `engine` (weights `version`; an engine
        given `between_steps` may take newer weights mid-generation and reports each token's version)."""
        todo = self.unfinished()
        if not todo:
            return {"continued": 0, "tokens": 0}
        longest = max(min(self.segment_tokens, self.max_new_tokens - len(r.response_ids)) for r in todo)
        segment = dataclasses.replace(sampling, n=1, max_new_tokens=longest)
        hook = {"between_steps": between_steps} if between_steps is not None else {}
        generations = engine.generate([r.prompt_ids + r.response_ids for r in todo], segment, **hook)
        continued = sum(r.segments > 0 for r in todo)
        before = sum(len(r.response_ids) for r in todo)
        for response, (generation,) in zip(todo, generations):
            response.extend(generation, version, self.max_new_tokens)
        return {"continued": continued, "tokens": sum(len(r.response_ids) for r in todo) - before}

    def pop_finished(self) -> list[Group]:
        """The groups whose responses have all ended (removed from here), oldest first."""
        done = [g for g in self.groups if all(r.finish_reason for r in g.responses)]
        self.groups = [g for g in self.groups if not all(r.finish_reason for r in g.responses)]
        return done


@dataclass
class _StoredGroup:
    experiences: list[Experience]
    version: int      # oldest policy_version in the group
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
    taken by priority = policy_version - uses (newer first; each earlier use costs as much as one version of age),
    ties newest arrival first. Groups used `max_reuse` times, older than `max_staleness` versions (when given), or
    beyond `capacity` (lowest priority first) leave. Groups whose rewards are all equal are not stored when
    `skip_uniform` (they carry no policy gradient: the trainer would drop them again). Group ids are renumbered per
    step so groups from different explorers or steps never merge.
    """

    def __init__(self, max_reuse: int, groups_per_step: int = 0, capacity: int = 64, max_staleness: int | None = None,
                 skip_uniform: bool = True):
        self.max_reuse, self.groups_per_step, self.capacity = max_reuse, groups_per_step, capacity
        self.max_staleness, self.skip_uniform = max_staleness, skip_uniform
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
            self.add(members)
        batch = [dataclasses.replace(e, group_id=new_id)
                 for new_id, members in enumerate(list(groups.values()) + replayed) for e in members]
        return batch, {"replay/reused": sum(len(m) for m in replayed), "replay/size": self.size}

    def add(self, members: list[Experience]) -> None:
        if self.max_reuse <= 1 or (self.skip_uniform and len({e.reward for e in members}) <= 1):
            return
        self.arrivals += 1
        self.stored.append(_StoredGroup(members, min(e.policy_version for e in members), 1, self.arrivals))
        if len(self.stored) > self.capacity:
            self.stored.sort(key=lambda g: (g.priority, g.order), reverse=True)
            del self.stored[self.capacity:]

    def take(self, n: int, version: int) -> list[list[Experience]]:
        """Up to n stored groups, highest priority first; each counts one more use."""
        if self.max_staleness is not None:
            self.stored = [g for g in self.stored if version - g.version <= self.max_staleness]
        self.stored.sort(key=lambda g: (g.priority, g.order), reverse=True)
        chosen = self.stored[:n]
        for g in chosen:
            g.uses += 1
        self.stored = [g for g in self.stored if g.uses < self.max_reuse]
        return [g.experiences for g in chosen]
