"""Environments: tandem's own small, gym-like, text-in/text-out API (DESIGN.md "Workflows and environments").

    env = make_env(task["env"])
    messages = env.reset(task)                      # the first observation: chat messages
    result = env.step(action_text)                  # StepResult(messages, reward, done, info)

An environment is one class in one file of this folder plus one line in `ENVS` below. Tool-using environments
subclass `common.envs.tools.ToolEnv`: their public methods become tools (JSON schema from signature + docstring),
tool calls are parsed from the model's text, results come back as `tool` messages.

`ENVS` maps a name to "module:Class" so libraries an environment wraps (textarena, reasoning-gym) are imported only
when a task uses it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

ENVS = {
    "guess_number": "common.envs.guess_number:GuessNumber",
    "calculator": "common.envs.calculator:Calculator",
    "retry": "common.envs.retry:Retry",
    "textarena": "common.envs.textarena_env:TextArena",
    "reasoning_gym": "common.envs.reasoning_gym_env:ReasoningGym",
}


@dataclass
class StepResult:
    messages: list[dict]          # the observation: chat messages appended after the assistant's turn
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)  # anything; "tool_errors": [reason, ...] and "success" are counted


class Env:
    """Base class. One instance runs one episode (a fresh one per episode: nothing is shared between episodes)."""

    required_fields: tuple[str, ...] = ()  # task fields reset() needs: a row without one is a one-line load error

    def reset(self, task: dict) -> list[dict]:
        """Start an episode for `task`; return the first messages (e.g. [{"role": "user", "content": ...}])."""
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        """The model's turn as text (special tokens stripped) -> observation, reward, done, info."""
        raise NotImplementedError

    def tool_schemas(self) -> list[dict]:
        """JSON schemas of the tools this environment offers (none for a plain text environment)."""
        return []

    def close(self) -> None:
        """Free what the environment holds (called once the episode ended)."""


def env_class(name: str):
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r} (one of {', '.join(sorted(ENVS))})")
    module, cls = ENVS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_env(name: str) -> Env:
    return env_class(name)()
