"""The workflow interface: what every workflow (one task -> one group of samples) and every sample it makes
provide, what it declares it supports, and what it is given (`Context`), so that the runner
(common/explorer/rollouts.py), the reward glue (common/explorer/parts.py) and the rollout metrics never ask which
kind of workflow or sample they hold. Also the registry of workflows by name, `WORKFLOWS`:

- `single_turn` (common/explorer/single_turn.py): prompt -> n sampled responses (partial rollouts included).
- `multi_turn` (common/explorer/multi_turn.py): n episodes of the policy in the task's environment (`"env": name`,
  common/envs/), token-in/token-out.
- `agent` (common/explorer/agent.py): n episodes of your agent (`--agent FILE:fn`, every task) calling the policy
  through the explorer's OpenAI-compatible endpoint; its calls join the engine like any other request.

A task picks its workflow by `"workflow": name`, or implicitly: multi_turn when it names an `env`, else
single_turn; a taskset may mix them. A new workflow subclasses `Workflow` and `Sample` in a file of its own and adds
one line to `WORKFLOWS`.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from common.envs import parse_env_settings
from common.envs.tool_formats import detect, tool_format
from common.envs.tools import set_sandbox_slots
from common.explorer.chat import ChatRenderer
from rewards import Reward

WORKFLOWS = {
    "single_turn": "common.explorer.single_turn:SingleTurn",
    "multi_turn": "common.explorer.multi_turn:MultiTurn",
    "agent": "common.explorer.agent:Agent",
}


def workflow_name(task: dict) -> str:
    return task.get("workflow") or ("multi_turn" if "env" in task else "single_turn")


def workflow_class(name: str):
    if name not in WORKFLOWS:
        raise ValueError(f"unknown workflow {name!r} (one of {', '.join(WORKFLOWS)})")
    module, cls = WORKFLOWS[name].split(":")
    return getattr(importlib.import_module(module), cls)


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


@dataclass
class TokenSample(Sample):
    """A sample built by appending ids, each as the engine fed or sampled it: sampled ids (trained: loss mask 1,
    their behaviour log-probs) and observations (mask 0, log-prob 0), each with the weights version that made it.
    A multi-turn episode, an agent's sample."""
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)  # per turn: end of its sampled ids in response_ids

    @property
    def segments(self) -> int:
        return self.turns

    @property
    def sampled_tokens(self) -> int:
        """Tokens the model wrote (what a length penalty counts; observations excluded)."""
        return sum(self.mask)

    def loss_mask(self, partial_loss: str = "last_segment") -> list[int]:
        return list(self.mask)

    def _append(self, ids, logprobs, trained: int, version: int, versions: list[int] | None = None) -> None:
        self.response_ids += ids
        self.logprobs += logprobs
        self.mask += [trained] * len(ids)
        self.versions += versions[:len(ids)] if versions else [version] * len(ids)  # per token, if mid-generation


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
        """ctx: `Context` (tokenizer and limits)."""

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


@dataclass
class Context:
    """What workflows need besides the task: the tokenizer and the limits from the config."""
    tokenizer: object
    max_new_tokens: int                 # per turn
    token_budget: int = 0               # --rollout-token-budget (single_turn partial rollouts)
    max_turns: int = 8
    episode_token_budget: int = 1024
    tool_timeout_s: float = 10.0
    env_reward: str = "sum"
    env_setting: tuple = ()             # --env-setting NAME.FIELD=VALUE
    env_workers: int = 64
    env_step_timeout_s: float = 300.0
    reasoning_parser: str = "think"
    in_turn_tools: bool = False
    truncated_turns: str = "end"        # --truncated-turns: a turn cut at max_new_tokens ends its episode, or goes on
    max_tool_calls_per_turn: int = 8
    tool_call_format: str = "auto"      # --tool-call-format; auto: from the chat template (tool_formats.detect)
    env_server: str = ""                # --env-server: every environment played on that server (http_env.py)
    env_pool: object = None             # the explorer's environment thread pool (Rollouts sets it), else None
    processor: object = None            # a VLM policy's common.vlm.Processor (image tasks), else None
    agent: str = ""                     # --agent FILE:fn: every task runs the agent workflow
    agent_cmd: str = ""                 # --agent-cmd "...": so does every task, the agent a program
    agent_timeout_s: float = 300.0
    agent_max_calls: int = 16
    temperature: float = 1.0            # the run's sampling, which the endpoint holds requests to
    top_p: float = 1.0
    _renderer: object = None

    @property
    def renderer(self):
        if self._renderer is None:
            self._renderer = ChatRenderer(self.tokenizer, keep_tokens=self.tool_format.keep_tokens)
        return self._renderer

    @property
    def tool_format_name(self) -> str:
        if self.tool_call_format != "auto":
            return self.tool_call_format
        return detect(getattr(self.tokenizer, "chat_template", None))

    @property
    def tool_format(self):
        return tool_format(self.tool_format_name)

    @property
    def env_settings(self) -> dict:
        """make_env's overrides: the shared tool limits, then every --env-setting."""
        return {"tool_timeout_s": self.tool_timeout_s, "max_tool_calls_per_turn": self.max_tool_calls_per_turn,
                "tool_call_format": self.tool_format_name, **parse_env_settings(self.env_setting),
                **({"env_server": self.env_server} if self.env_server else {})}

    @classmethod
    def from_args(cls, tokenizer, args, processor=None) -> "Context":
        set_sandbox_slots(args.sandbox_procs)  # one explorer per process: its tools' sandboxed programs at once
        return cls(tokenizer, args.max_new_tokens, token_budget=args.rollout_token_budget, max_turns=args.max_turns,
                   episode_token_budget=args.episode_token_budget, tool_timeout_s=args.tool_timeout_s,
                   env_reward=args.env_reward, env_setting=tuple(args.env_setting), env_workers=args.env_workers,
                   env_step_timeout_s=args.env_step_timeout_s, reasoning_parser=args.reasoning_parser,
                   in_turn_tools=args.in_turn_tools, truncated_turns=args.truncated_turns,
                   max_tool_calls_per_turn=args.max_tool_calls_per_turn, tool_call_format=args.tool_call_format,
                   env_server=args.env_server, processor=processor, agent=args.agent or "",
                   agent_timeout_s=args.agent_timeout_s, agent_max_calls=args.agent_max_calls,
                   agent_cmd=args.agent_cmd or "", temperature=args.temperature, top_p=args.top_p)
