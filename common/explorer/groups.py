"""The explorer's sample groups: the responses to one task, each generated over one or more rollout steps
(partial rollouts, Kimi k1.5, arXiv:2501.12599).

Partial rollouts (the single_turn workflow). With --rollout-token-budget B a rollout step gives every unfinished
response at most B new tokens. A response that has not stopped by then stays here and is continued in
later steps, with whatever weights the explorer has then: the prompt plus the response so far is the engine's
prompt, so the engine generates only the new segment and reports log-probs for its tokens (no engine method of its
own: HFEngine and VLLMEngine work as they are). A response ends at a stop token, or at --max-new-tokens in total
(finish "length"). A group (the samples of one task) leaves only when all of its responses have ended, so
group-normalised advantages and group reward shaping always see the whole group.

Which tokens are trained (`--partial-loss`):
- last_segment: only the tokens made by the response's newest weights count as on-policy; older segments keep
  their place in the context but get loss mask 0.
- all: every segment is trained against its own behaviour log-probs.
Experience.segment_versions keeps the weights version of every response token either way; how old that makes the
experience (its oldest trained token) is the trainer's staleness rule, common/trainer/filters.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.explorer.engine import Generation
from common.explorer.workflow import Sample
from rewards import Reward


@dataclass
class Response(Sample):
    """One sampled response, generated over one or more rollout steps (segments)."""
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)     # behaviour log-prob of each token, from its segment
    versions: list[int] = field(default_factory=list)       # weights version that made each token
    segments: int = 0
    finish_reason: str | None = None                        # None while unfinished, then "stop" or "length"
    images: object = None                                   # the prompt's ImageInputs (shared by the group)

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

    @property
    def sampled_tokens(self) -> int:
        return len(self.response_ids)

    @property
    def turns(self) -> int:
        return 1

    @property
    def turn_ends(self) -> list[int]:
        return [len(self.response_ids)]

    @property
    def turn_rewards(self) -> list[float]:
        return []

    # ALGO LOGIC: which tokens of a partial rollout are trained
    def loss_mask(self, partial_loss: str) -> list[int]:
        newest = self.versions[-1]
        return [1 if partial_loss == "all" or v == newest else 0 for v in self.versions]

    def verifier_input(self, task: dict, tokenizer, whole_episodes: bool = False) -> str:
        return tokenizer.decode(self.response_ids, skip_special_tokens=True)

    def reward(self, verified: Reward | None, env_reward: str) -> Reward:
        return verified
