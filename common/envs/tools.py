"""Tools: an environment's public methods exposed to the model, with JSON schemas, in the model's call format.

The model calls a tool the way its chat template teaches (common/envs/tool_formats.py: the tool_call_format
setting, --tool-call-format), e.g. Hermes / Qwen 2.5+:

    <tool_call>{"name": "calculate", "arguments": {"expression": "3 * (4 + 5)"}}</tool_call>

The format finds the calls; the turn's message gets OpenAI-shaped `tool_calls` ({"id", "type": "function",
"function": {"name", "arguments"}}, in the step's info["calls"]) and each result goes back as a
`{"role": "tool", "content": ..., "tool_call_id": ..., "name": ...}` message. A
malformed call, an unknown tool, bad arguments, a tool that raises or one that hangs past its timeout gives an
error observation ("error: <reason>: ...") and the episode goes on; the reason is counted in the step's metrics
(rollout/tool_error/<reason>). A turn without any tool call is the model's answer: `ToolEnv.answer` decides.

Tools run in this process (they are the environment's own code), the calls of one turn in parallel threads, each
waited on for at most tool_timeout_s (an environment setting, --tool-timeout-s); at most max_tool_calls_per_turn
calls of one turn run (--max-tool-calls-per-turn: each one beyond is an error observation, "too_many_calls", and
starts nothing); an output longer than max_tool_output_chars keeps its head and tail. A thread cannot be killed, so a tool must bound its own work (the
calculator refuses over-large integers before computing them), and a tool that runs model-written code must hand
it to rewards/sandbox.py through `run_sandboxed` (see common/envs/calculator.py's `python` tool: a process with
time and memory limits, at most --sandbox-procs of them at once in one explorer), never exec it here.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time

from common.envs import Env, StepResult
from common.envs.boundary import ABANDONED, describe
from common.envs.tool_formats import ToolError, tool_format
from rewards import sandbox


class ToolThread:
    """fn(**kwargs) in a daemon thread, started at once; `result()` waits for at most `timeout_s` from the start.
    A tool that hangs past it gives a ToolError("timeout"). An `async def` tool is cancelled there and its thread
    ends; a plain one's thread cannot be killed and is left behind (daemon, counted in
    rollout/env_threads_abandoned), which is why a tool must bound its own work (the calculator bounds operand
    sizes), wait on I/O as `async def`, and tools that run model code use the sandbox (a process that is killed)."""

    def __init__(self, fn, kwargs: dict, timeout_s: float):
        self.box: dict = {}
        self.timeout_s, self.deadline = timeout_s, time.monotonic() + timeout_s
        self.thread = threading.Thread(target=self._target, args=(fn, kwargs), daemon=True,
                                       name=f"tool-{getattr(fn, '__name__', 'fn')}")
        self.thread.start()

    def _target(self, fn, kwargs):
        try:
            if inspect.iscoroutinefunction(fn):
                self.box["value"] = asyncio.run(asyncio.wait_for(fn(**kwargs), self.timeout_s))
            else:
                self.box["value"] = fn(**kwargs)
        except asyncio.TimeoutError:
            self.box["error"] = ToolError("timeout", f"tool did not answer within {self.timeout_s:g}s")
        except ToolError as e:  # the tool's own verdict (e.g. the sandbox's timeout)
            self.box["error"] = e
        except BaseException as e:  # noqa: BLE001  (SystemExit too: a tool's failure is an observation, not our end)
            self.box["error"] = ToolError("exception", describe(e))

    def result(self):
        self.thread.join(max(0.0, self.deadline - time.monotonic()) + 0.5)  # + the cancellation of an async one
        if self.thread.is_alive():
            ABANDONED.add(self.thread)
            raise ToolError("timeout", f"tool did not answer within {self.timeout_s:g}s")
        if "error" in self.box:
            raise self.box["error"]
        return self.box["value"]


SANDBOX_SLOTS = threading.BoundedSemaphore(4)  # sandboxed programs of this process's tools at once (--sandbox-procs)


def set_sandbox_slots(n: int) -> None:
    global SANDBOX_SLOTS
    SANDBOX_SLOTS = threading.BoundedSemaphore(n)


def run_sandboxed(code: str, limits, wait_s: float):
    """rewards.sandbox.run(code) once one of this process's --sandbox-procs slots is free (waited on for at most
    `wait_s`: a ToolError("busy") past it), so the tool calls of many episodes never start more programs than that."""
    slots = SANDBOX_SLOTS
    if not slots.acquire(timeout=wait_s):
        raise ToolError("busy", f"no sandbox slot free within {wait_s:g}s (--sandbox-procs)")
    try:
        return sandbox.run(code, limits=limits)
    finally:
        slots.release()


def tool_schema(fn) -> dict:
    """transformers' JSON schema of a function (from its type hints and Google-style docstring)."""
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


class ToolEnv(Env):
    """An environment whose tools are the methods named in `tools`, by default every public method the subclass
    defines (what ToolEnv and Env define, `reset` and `answer` included, is never a tool). Subclasses write
    `reset`, the tool methods and `answer`. `check_tools(cls)` builds every schema once before a run starts."""

    tools: tuple[str, ...] | None = None
    calls_made = 0  # this episode's calls so far: their ids

    def tool_names(self) -> list[str]:
        if self.tools is not None:
            return list(self.tools)
        return [n for n, m in inspect.getmembers(type(self), inspect.isfunction)
                if not n.startswith("_") and not hasattr(ToolEnv, n)]

    def tool_schemas(self) -> list[dict]:
        return [tool_schema(getattr(self, n)) for n in self.tool_names()]

    def answer(self, text: str) -> StepResult:
        """A turn without a tool call: the model's answer. Default: the episode ends, reward 0 (a verifier named
        by the task's "reward" field scores the final answer)."""
        return StepResult([], 0.0, True, {})

    def step(self, action: str) -> StepResult:
        """The calls of one turn run in parallel (each bounded by tool_timeout_s from the same start; at most
        max_tool_calls_per_turn of them); their results come back in the order of the calls, each a tool message
        paired by id with the call in info["calls"] (the assistant message's OpenAI-shaped tool_calls)."""
        name = self.settings.tool_call_format
        types = [s.get("function", s) for s in self.tool_schemas()] if name == "qwen3_coder" else None  # typed values
        content, calls = tool_format(name).split(action, types)
        if calls is None:
            return self.answer(action)
        limit = self.settings.max_tool_calls_per_turn
        started = [self._start(c) for c in calls[:limit]] + [
            ToolError("too_many_calls", f"more than {limit} tool calls in one turn (--max-tool-calls-per-turn): "
                                        f"this one was not run") for _ in calls[limit:]]
        messages, errors, shaped = [], [], []
        for call, running in zip(calls, started):
            self.calls_made += 1
            call_id = f"call{self.calls_made:05d}"  # 9 characters: what Mistral's templates require
            name = call["name"] if isinstance(call, dict) else "invalid_call"
            shaped.append({"id": call_id, "type": "function", "function": {
                "name": name, "arguments": call["arguments"] if isinstance(call, dict) else {}}})
            try:
                if isinstance(running, ToolError):
                    raise running
                result = self._clip(str(running.result()))
            except ToolError as e:
                errors.append(e.reason)
                result = f"error: {e.reason}: {e}"
            messages.append({"role": "tool", "content": result, "tool_call_id": call_id, "name": name})
        return StepResult(messages, 0.0, False, {"tool_calls": len(calls), "tool_errors": errors, "calls": shaped,
                                                 "content": content})

    def _clip(self, text: str) -> str:
        """Tool output beyond max_tool_output_chars keeps its head and tail (a tool may print megabytes)."""
        limit = self.settings.max_tool_output_chars
        if len(text) <= limit:
            return text
        half = limit // 2
        return f"{text[:half]}\n...[{len(text) - 2 * half} characters cut]...\n{text[-half:]}"

    def _start(self, call) -> "ToolThread | ToolError":
        if isinstance(call, ToolError):
            return call
        name, arguments = call["name"], call["arguments"]
        if name not in self.tool_names():
            return ToolError("unknown_tool", f"no tool named {name!r} (tools: {', '.join(self.tool_names())})")
        fn = getattr(self, name)
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as e:
            return ToolError("bad_arguments", str(e))
        return ToolThread(fn, arguments, self.settings.tool_timeout_s)

    def _run(self, name: str, arguments: dict) -> str:
        """One call, waited on (for tests and environments that call their tools themselves)."""
        started = self._start({"name": name, "arguments": arguments})
        if isinstance(started, ToolError):
            raise started
        return self._clip(str(started.result()))


def check_tools(cls) -> None:
    """A one-line ValueError naming the environment and the tool when one of a tool environment's tools has no
    buildable schema (a missing type hint or docstring); for the checks before a run."""
    if not (isinstance(cls, type) and issubclass(cls, ToolEnv)):
        return
    env = cls()
    for name in env.tool_names():
        if not callable(getattr(cls, name, None)):
            raise ValueError(f"environment {cls.__name__}: tool {name!r} is not a method")
        try:
            tool_schema(getattr(env, name))
        except Exception as e:  # noqa: BLE001  (transformers' schema errors are of several types)
            raise ValueError(f"environment {cls.__name__}: no JSON schema for tool {name!r} ({describe(e)})") from None


def tools_system_prompt(schemas: list[dict]) -> str:
    """The Hermes-style tool instructions, for chat templates that do not render `tools=` themselves."""
    lines = "\n".join(json.dumps({k: v for k, v in s.items() if k != "return"}, separators=(",", ":"))
                      for s in schemas)
    return ("Tools (JSON schemas):\n<tools>\n" + lines + "\n</tools>\nCall one with <tool_call>{\"name\": ..., "
            "\"arguments\": {...}}</tool_call>. Give the final answer without a tool call.")
