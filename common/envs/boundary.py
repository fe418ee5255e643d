"""The boundary around an environment: every call to it, bounded and checked. Everything an environment, its tools
or an environment server does passes through one `EpisodeEnv` (rewards/THREATS.md "Environments are untrusted";
docs/USAGE.md "The boundary").

An environment is someone else's code and its results are untrusted input. Each call (building it, reset, step,
close) runs in a thread of its own: a plain function in a daemon thread, an `async def` one on the episode's event
loop, which runs in its own thread (so an environment that blocks its loop holds back no other episode). The
caller waits at most --env-step-timeout-s. What the environment raises, `BaseException` included (`SystemExit`,
`KeyboardInterrupt`, `asyncio.CancelledError`, an exception whose `str()` raises), is caught in that thread and
becomes an `EnvFailure`; so does a result of the wrong shape (`check_step`, `check_messages`: a None step, a
reward that is not a finite number at any step, messages or info of the wrong type), naming the field and the
environment. The caller never catches more than `EnvFailure`: a Ctrl-C of the user arrives in the main thread,
outside every environment call, and stops the run as it always does.

At the limit an async call is cancelled; one that swallows its cancellation, blocks its loop, or is a plain
function (Python cannot stop a thread) is abandoned: its thread is counted in rollout/env_threads_abandoned while
it runs, and whatever it returns later is discarded and counted (rollout/env_late_results).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import math
import numbers
import threading
import weakref

from common.envs import StepResult, make_env

ABANDONED: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()  # threads of calls given up on (tools too)
_late = [0]  # results that arrived after their limit (discarded)
_late_lock = threading.Lock()


def abandoned_threads() -> int:
    """Threads of timed-out environment and tool calls that are still running (such a thread cannot be killed, so
    an environment should let `close` end its own hung call)."""
    return sum(t.is_alive() for t in list(ABANDONED))


def late_results() -> int:
    """Environment calls, in this process so far, that returned after their limit (their results were discarded)."""
    return _late[0]


def _count_late(outcome) -> None:
    if outcome.result()[0] == "ok":  # a result (not the cancellation it got, nor a later error)
        with _late_lock:
            _late[0] += 1


def describe(exc: BaseException) -> str:
    """'Type: message' of an exception, whatever its `str()` does (run in the environment's thread)."""
    try:
        text = str(exc)
    except BaseException:  # noqa: BLE001  (an environment's exception may raise from its own __str__)
        text = "<its str() raised>"
    return f"{type(exc).__name__}: {text}"[:500]


class InvalidResult(ValueError):
    """An environment's result of the wrong shape or type."""


class EnvFailure(Exception):
    """An environment call that raised, returned something invalid, or ran past its limit. `call` (make, reset,
    step, close) and `kind` (raised, invalid, timeout) make the counted reason `{call}_{kind}`; the episode ends
    "timeout" or "error"."""

    def __init__(self, call: str, kind: str, message: str):
        super().__init__(message)
        self.call, self.kind = call, kind

    @property
    def reason(self) -> str:
        return "timeout" if self.kind == "timeout" else "error"

    @property
    def metric(self) -> str:
        return f"{self.call}_{self.kind}"


def _short(value) -> str:
    try:
        return f"{value!r}"[:60]
    except BaseException:  # noqa: BLE001  (runs in the environment's thread, on its object)
        return f"<a {type(value).__name__}>"


def check_messages(value, field: str = "messages") -> list[dict]:
    """Chat messages as plain dicts with a string role and string content (a copy)."""
    if not isinstance(value, list):
        raise InvalidResult(f"{field} is {_short(value)}, not a list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidResult(f"{field}[{i}] is {_short(m)}, not a dict with string 'role' and 'content'")
        out.append(dict(m))
    return out


def finite_number(value, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise InvalidResult(f"{field} is {_short(value)}, not a finite number")
    return float(value)


def check_step(result) -> StepResult:
    """A step's result as a StepResult of plain, checked values (the info keys the workflow reads included)."""
    if not isinstance(result, StepResult):
        raise InvalidResult(f"step returned {_short(result)}, not a StepResult")
    messages = check_messages(result.messages, "messages")
    reward = finite_number(result.reward, "reward")
    if not isinstance(result.done, bool) and result.done not in (0, 1):
        raise InvalidResult(f"done is {_short(result.done)}, not a bool")
    if not isinstance(result.info, dict):
        raise InvalidResult(f"info is {_short(result.info)}, not a dict")
    info = dict(result.info)
    calls = info.get("tool_calls", 0)
    if isinstance(calls, bool) or not isinstance(calls, numbers.Integral) or calls < 0:
        raise InvalidResult(f"info['tool_calls'] is {_short(calls)}, not a count")
    info["tool_calls"] = int(calls)
    errors = info.get("tool_errors", [])
    if not isinstance(errors, list) or not all(isinstance(x, str) for x in errors):
        raise InvalidResult(f"info['tool_errors'] is {_short(errors)}, not a list of strings")
    if not isinstance(info.get("calls", []), list) or not all(isinstance(c, dict) for c in info.get("calls", [])):
        raise InvalidResult(f"info['calls'] is {_short(info['calls'])}, not a list of dicts")
    if not isinstance(info.get("content", ""), str):
        raise InvalidResult(f"info['content'] is {_short(info['content'])}, not a string")
    for key in ("success", "format_ok"):
        if key in info and not isinstance(info[key], bool) and info[key] not in (0, 1):
            raise InvalidResult(f"info[{key!r}] is {_short(info[key])}, not a bool")
    return StepResult(messages, reward, bool(result.done), info)


def check_schemas(value) -> list[dict]:
    """Tool schemas: a list of dicts (their content is the environment's; the chat template renders them)."""
    if not isinstance(value, list) or not all(isinstance(s, dict) and isinstance(s.get("function", {}), dict)
                                              for s in value):
        raise InvalidResult(f"tool_schemas() returned {_short(value)}, not a list of dicts")
    return json.loads(json.dumps(value))  # a plain copy; what JSON cannot hold fails here


class EpisodeEnv:
    """One episode's environment `name`, behind the boundary: `reset` -> (messages, tool schemas), `step` -> a
    checked StepResult, `close`; each raises nothing but EnvFailure, within `timeout_s`."""

    def __init__(self, name: str, overrides: dict | None, timeout_s: float):
        self.name, self.overrides, self.timeout_s = name, overrides, timeout_s
        self.env, self.tools, self.worst_reward = None, [], 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None

    def reset(self, task: dict) -> tuple[list[dict], list[dict]]:
        self.env = self._call("make", make_env, self.name, self.overrides)
        messages = self._call("reset", self.env.reset, task, check=lambda m: check_messages(m, "reset's messages"))
        # read after reset: a remote environment's arrives with it
        self.worst_reward = self._call("reset", lambda: finite_number(self.env.worst_reward, "worst_reward"))
        self.tools = self._call("reset", self.env.tool_schemas, check=check_schemas)
        return messages, self.tools

    def step(self, action: str) -> StepResult:
        return self._call("step", self.env.step, action, check=check_step)

    def close(self) -> None:
        """Close the environment (if it was built) and stop the episode's event loop (if it has one)."""
        try:
            if self.env is not None:
                env, self.env = self.env, None
                self._call("close", env.close)
        finally:
            self._stop_loop()

    def _call(self, call: str, fn, *args, check=None):
        """fn(*args) in its own thread (an async one on the episode's loop), its result checked there; waited on for
        at most timeout_s. The outcome comes back as ("ok", value) or (kind, message): nothing the environment
        raises is ever re-raised here."""
        outcome: concurrent.futures.Future = concurrent.futures.Future()

        def failed(exc: BaseException) -> tuple[str, str]:
            return ("invalid" if isinstance(exc, InvalidResult) else "raised"), describe(exc)

        if inspect.iscoroutinefunction(fn):
            async def run():
                try:
                    value = await fn(*args)
                    settled = ("ok", check(value) if check else value)
                except BaseException as exc:  # noqa: BLE001  (the environment's, CancelledError included)
                    settled = failed(exc)
                outcome.set_result(settled)

            task = asyncio.run_coroutine_threadsafe(run(), self._episode_loop())
            thread = self._loop_thread
        else:
            def target():
                try:
                    value = fn(*args)
                    settled = ("ok", check(value) if check else value)
                except BaseException as exc:  # noqa: BLE001  (the environment's: SystemExit, KeyboardInterrupt...)
                    settled = failed(exc)
                outcome.set_result(settled)

            task = None
            thread = threading.Thread(target=target, daemon=True, name=f"env-call-{getattr(fn, '__name__', 'fn')}")
            thread.start()
        done, _ = concurrent.futures.wait([outcome], timeout=self.timeout_s)
        if not done:
            if task is not None:
                task.cancel()  # an async call that honours its cancellation ends here
            ABANDONED.add(thread)
            outcome.add_done_callback(_count_late)
            raise EnvFailure(call, "timeout", f"{call} of environment {self.name!r}: "
                                              f"{getattr(fn, '__qualname__', fn)} did not return within "
                                              f"{self.timeout_s:g}s")
        kind, value = outcome.result()
        if kind != "ok":
            raise EnvFailure(call, kind, f"{call} of environment {self.name!r}: {value}")
        return value

    def _episode_loop(self) -> asyncio.AbstractEventLoop:
        """The episode's event loop (what the environment binds to it lives across its steps), in its own thread."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                                 name=f"env-loop-{self.name}")
            self._loop_thread.start()
        return self._loop

    def _stop_loop(self) -> None:
        loop, thread, self._loop, self._loop_thread = self._loop, self._loop_thread, None, None
        if loop is None:
            return

        def stop():
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.call_soon(loop.stop)  # after the cancellations ran

        loop.call_soon_threadsafe(stop)
        thread.join(min(self.timeout_s, 1.0))
        if thread.is_alive():  # blocked by the environment: left behind (counted), its loop never closed
            ABANDONED.add(thread)
        else:
            loop.close()
