"""Environments: tandem's own small, gym-like, text-in/text-out API (DESIGN.md "Workflows and environments").

    env = make_env(task["env"])
    messages = env.reset(task)                      # the first observation: chat messages
    result = env.step(action_text)                  # StepResult(messages, reward, done, info)

An environment is one class in one file of this folder plus one line in `ENVS` below. `reset`, `step` and `close`
may be `async def` (I/O-bound environments: a web service, a container). The workflow never calls an environment
directly: every call goes through the boundary (common/envs/boundary.py `EpisodeEnv`), which bounds it by
--env-step-timeout-s, catches whatever it raises and checks what it returns; any of these ends that episode alone,
with its reason counted. Its typed settings are a
`Settings` dataclass on the class (subclassing `EnvSettings`); `make_env(name, overrides)` is the one way in: the
config's `--env-setting NAME.FIELD=VALUE` (and --tool-timeout-s for every tool environment) fill it, checked
against the dataclass before any compute (`parse_env_settings`). A procedural environment also names its task
generator (`Env.make_task(rng, index, difficulty)`): the registry then gives `--taskset NAME` for free
(common/tasks/named.py). Tool-using environments
subclass `common.envs.tools.ToolEnv`: their public methods become tools (JSON schema from signature + docstring),
tool calls are parsed from the model's text, results come back as `tool` messages.

`ENVS` maps a name to "module:Class" so libraries an environment wraps (textarena, reasoning-gym) are imported only
when a task uses it.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field

ENVS = {
    "guess_number": "common.envs.guess_number:GuessNumber",
    "calculator": "common.envs.calculator:Calculator",
    "retry": "common.envs.retry:Retry",
    "textarena": "common.envs.textarena_env:TextArena",
    "reasoning_gym": "common.envs.reasoning_gym_env:ReasoningGym",
    "verifiers": "common.envs.verifiers_env:Verifiers",  # --taskset verifiers:NAME (the verifiers library's)
    "openenv": "common.envs.openenv_env:OpenEnv",  # --taskset openenv:URL|MODULE[:APP] (OpenEnv servers)
    "gem": "common.envs.gem_env:Gem",
    "http": "common.envs.http_env:HttpEnv",  # an environment server's (--env-server, or a task's "remote_env")
}


@dataclass
class StepResult:
    messages: list[dict]          # the observation: chat messages appended after the assistant's turn
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)  # anything; "tool_errors": [reason, ...] and "success" are counted


@dataclass
class EnvSettings:
    """Settings every environment has (a subclass per environment adds its own)."""
    tool_timeout_s: float = 10.0
    """seconds a tool call may take (from the start of the turn's calls, which run in parallel)"""
    max_tool_calls_per_turn: int = 8
    """tool calls of one turn that are run; the rest get an error observation ('too_many_calls'), counted"""
    tool_call_format: str = "hermes"
    """how the model writes a tool call (common/envs/tool_formats.py: FORMATS; --tool-call-format)"""
    max_tool_output_chars: int = 4000
    """a tool's output beyond this keeps its head and tail"""


class Env:
    """Base class. One instance runs one episode (a fresh one per episode: nothing is shared between episodes)."""

    Settings = EnvSettings
    required_fields: tuple[str, ...] = ()  # task fields reset() needs: a row without one is a one-line load error
    worst_reward: float = 0.0
    """The lowest environment reward a legitimately played episode can get: what an episode that ends in an
    error or a timeout scores (an error never pays more than losing; rewards/THREATS.md)."""
    make_task = None  # procedural tasksets (`--taskset NAME[:ARG]`): staticmethod (rng, index, difficulty, arg)
    task_list = None  # finite ones: staticmethod (arg, size, seed, id_prefix) -> [task dict]

    def __init__(self, settings: EnvSettings | None = None):
        self.settings = settings if settings is not None else self.Settings()

    def reset(self, task: dict) -> list[dict]:
        """Start an episode for `task`; return the first messages (e.g. [{"role": "user", "content": ...}])."""
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        """The model's turn as text (special tokens and reasoning stripped) -> observation, reward, done, info."""
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


def settings_for(name: str, cls, overrides: dict | None) -> EnvSettings:
    """cls.Settings filled from `overrides` ({field: value} common to all environments, or {"NAME.field": value}
    for environment NAME); fields the class does not have are ignored (a shared setting such as tool_timeout_s
    means nothing to a text game)."""
    names = {f.name for f in dataclasses.fields(cls.Settings)}
    own = {k: v for k, v in (overrides or {}).items() if "." not in k and k in names}
    prefix = f"{name}."
    own.update({k[len(prefix):]: v for k, v in (overrides or {}).items() if k.startswith(prefix)})
    return cls.Settings(**own)


def make_env(name: str, overrides: dict | None = None) -> Env:
    """Environment `name` with its settings from `overrides`; with overrides["env_server"] (--env-server URL) the
    same environment played on that server (common/envs/http_env.py)."""
    overrides = dict(overrides or {})
    server = overrides.pop("env_server", "")
    if server and name != "http":
        cls = env_class("http")
        remote = {k: v for k, v in overrides.items() if not k.startswith("http.")}
        return cls(settings_for("http", cls, {**overrides, "http.url": server}), remote=name, remote_settings=remote)
    cls = env_class(name)
    return cls(settings_for(name, cls, overrides))


def parse_env_settings(items: tuple[str, ...] | list[str]) -> dict:
    """`--env-setting NAME.FIELD=VALUE` -> {"NAME.FIELD": typed value}; a one-line ValueError naming the item when
    NAME is no environment, FIELD not in its Settings or VALUE not of the field's type."""
    out = {}
    for item in items:
        key, eq, raw = item.partition("=")
        name, dot, fname = key.partition(".")
        if not eq or not dot:
            raise ValueError(f"--env-setting {item!r}: expected NAME.FIELD=VALUE")
        fields = {f.name: f for f in dataclasses.fields(env_class(name).Settings)}
        if fname not in fields:
            raise ValueError(f"--env-setting {item!r}: {name} has no setting {fname!r} (one of {', '.join(fields)})")
        kind = fields[fname].type if isinstance(fields[fname].type, type) else \
            {"float": float, "int": int, "str": str, "bool": bool}.get(str(fields[fname].type), str)
        try:
            value = (raw.lower() in ("1", "true", "yes")) if kind is bool else kind(raw)
        except ValueError:
            raise ValueError(f"--env-setting {item!r}: {raw!r} is not a {kind.__name__}") from None
        out[key] = value
    return out
