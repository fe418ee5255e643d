"""The workflow interface: what every workflow (one task -> one group of samples) and every sample it makes
provide, so that the runner (common/explorer/rollouts.py), the reward glue and the rollout metrics never ask which
kind of workflow or sample they hold. single_turn (`Response`) and multi_turn (`Episode`) implement it; a new
workflow subclasses `Workflow` and `Sample` and adds one line to rollouts.WORKFLOWS.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from rewards import Reward


class Sample(ABC):
    """One sampled response of a group (a single-turn response, an episode...). Besides these methods a sample has
    the fields the experience is built from: `prompt_ids`, `response_ids`, `logprobs` (one per response token, 0 on
    tokens it did not sample), `versions` (the weights version of each response token), `segments` (engine calls
    that extended it), `finish_reason` (None while live, then "stop" or "length"), `turns`, `turn_ends` (per turn:
    the end of its sampled ids in response_ids) and `turn_rewards` (per turn: the environment's step reward, [] where
    there is no environment)."""

    images = None  # the prompt's ImageInputs where the task shows images (common/vlm.py), else None

    @property
    @abstractmethod
    def sampled_tokens(self) -> int:
        """Tokens the model wrote (what a length penalty counts)."""

    @abstractmethod
    def loss_mask(self, partial_loss: str) -> list[int]:
        """Per response token: 1 where it is trained."""

    @abstractmethod
    def verifier_input(self, task: dict, tokenizer, whole_episodes: bool = False) -> str | None:
        """What the task's verifier scores, or None (no verifier: the sample's own reward alone). `whole_episodes`
        (--reward-fn): every sample goes to the function."""

    def verifier_task(self, task: dict, whole_episodes: bool = False) -> dict:
        """The task as the verifier sees it for this sample."""
        return task

    @abstractmethod
    def reward(self, verified: Reward | None, env_reward: str) -> Reward:
        """The sample's reward given the verifier's verdict (None where verifier_input was None)."""

    def counts(self) -> dict[str, float]:
        """Rollout metrics of this sample, summed over a round's samples (rollout_metrics)."""
        return {}


class Workflow(ABC):
    """Turns one task into one group of n samples, a turn at a time: the runner batches every live sample's next
    request (of every workflow in flight) into the engine, and hands each generation back with `receive`, which may
    run in a worker thread of the environment pool (it touches only its own sample)."""

    group: "Group"
    # What the workflow supports, which the runner and the start-up checks ask instead of its name:
    partial_rollouts = False  # --rollout-token-budget: a response may continue over several rollout steps
    env_pool = False          # set-up runs in the explorer's environment pool (ctx.env_pool) when there is one
    images = False            # tasks may show the policy images (a VLM policy)

    @abstractmethod
    def __init__(self, task: dict, group_id: int, n: int, ctx):
        """ctx: common.explorer.rollouts.Context (tokenizer and limits)."""

    @abstractmethod
    def requests(self) -> list[tuple[Sample, list[int], int]]:
        """(sample, prompt ids of its next engine call, max new tokens) of every live sample."""

    @abstractmethod
    def receive(self, sample: Sample, generation, version: int) -> int:
        """Append one generation (common.explorer.engine.Generation) to `sample`; the sampled tokens kept."""

    def arrivals(self) -> list[tuple[Sample, list[int], int]]:
        """Requests that came from outside the runner since the last call (an agent's calls to the endpoint),
        each returned once; `requests` holds the ones the runner asks for."""
        return []

    def starting(self) -> bool:
        """Whether the group's samples are still being set up elsewhere (multi_turn: environment resets in the
        pool); its first requests come once this is False, and the runner does not wait for it meanwhile."""
        return False

    def finished(self) -> bool:
        return not self.starting() and all(s.finish_reason for s in self.group.responses)


@dataclass
class Group:
    """The samples of one task: group-normalised advantages and group reward shaping see them together."""
    task: dict
    group_id: int
    responses: list[Sample]
