"""Environments of the `verifiers` library (pip verifiers==0.3.1, prime-rl's): `--taskset verifiers:NAME`.

NAME is what `verifiers.load_environment(NAME)` takes: the module of an installed environment package (an
Environments Hub package, or any importable module with a `load_environment()`; e.g. tests/verifiers_tiny_env.py
as `verifiers:tests.verifiers_tiny_env`). The environment's dataset (`get_dataset`) becomes the tasks; each
episode runs the environment's own `rollout` (its setup_state, env_response, stop conditions, cleanup), with
tandem's policy in place of the model client: when the rollout asks its client for the next assistant turn, the
adapter hands the new messages to tandem's multi-turn workflow and answers with the turn tandem sampled (as text:
tandem tokenized the prompt and keeps the token ids; the library sees messages only). When the rollout ends, the
environment's rubric scores it (`rubric.score_rollout`): that score is the episode's reward, the environment's
verdict alone. A rollout that ends in an error (the library's `state["error"]`), a group-level rubric (it needs
the whole group, which one episode does not have) or a conversation the environment rewrote instead of extending
(tandem's episode is one growing sequence) ends that episode as an error through the boundary.

Tool environments (`vf.ToolEnv`): the tools are the environment's `tool_defs`, offered as tool schemas; tandem
parses the calls from the turn's text (--tool-call-format) and the library runs them.

Offline: environments whose dataset and rubric are local (the dataset built in code or from the local Hugging
Face cache, a rule-based rubric). Those that download a dataset, call a judge model, or run in a sandbox
(prime-sandboxes) need the network. Sampling settings the environment declares are not used: tandem's own are.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from dataclasses import dataclass

from common.envs import Env, EnvSettings, StepResult
from common.envs.tool_formats import tool_format

_loaded: dict = {}  # name -> the library's environment, loaded once per process (it holds no episode state)
_load_lock = threading.Lock()


class _KeepSignals:
    """What the library's environment module sees as `signal`: building an environment there replaces the
    process's SIGINT and SIGTERM handlers (and raises outside the main thread, where explorers build theirs). The
    process is tandem's: Ctrl-C and shutdown stay as tandem set them; the library's teardown still runs at exit."""

    SIGINT, SIGTERM = signal.SIGINT, signal.SIGTERM
    default_int_handler = staticmethod(signal.default_int_handler)

    @staticmethod
    def signal(signalnum, handler):
        return None


def load(name: str):
    with _load_lock:
        if name not in _loaded:
            import verifiers as vf
            from verifiers.legacy.envs import environment

            environment.signal = _KeepSignals
            _loaded[name] = vf.load_environment(name)
        return _loaded[name]


def verifiers_task_list(arg: str | None, size: int, seed: int, prefix: str) -> list[dict]:
    """`size` rows of the environment's dataset (shuffled by `seed`), each a task carrying its row. The held-out
    list (common/tasks/named.py asks for it with the prefix "NAME-eval-") comes from the environment's eval
    dataset; the library falls back to its training dataset where it has none."""
    if not arg:
        raise SystemExit("error: --taskset verifiers:NAME: name the environment (its module)")
    try:
        env = load(arg)
        held_out = prefix.endswith("-eval-")
        rows = (env.get_eval_dataset if held_out else env.get_dataset)(n=size, seed=seed)
        rows = json.loads(json.dumps([dict(r) for r in rows]))
    except (ImportError, ValueError, RuntimeError, TypeError) as e:
        raise SystemExit(f"error: --taskset verifiers:{arg}: {type(e).__name__}: {e}") from None
    return [{"id": f"{prefix}{i}", "env": "verifiers", "verifiers_env": arg, "input": row}
            for i, row in enumerate(rows)]


def plain_messages(messages) -> list[dict]:
    """The library's messages as tandem's chat dicts (string content; a tool message keeps its call id)."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
        content = d.get("content")
        if isinstance(content, list):  # content parts: text only (tandem's episodes are text)
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise ValueError(f"a {d.get('role')} message has non-text content, which tandem cannot play")
            content = "".join(p.get("text", "") for p in content)
        plain = {"role": d.get("role"), "content": "" if content is None else content}
        for key in ("tool_call_id", "name"):
            if key in d:
                plain[key] = d[key]
        out.append(plain)
    return out


@dataclass
class VerifiersSettings(EnvSettings):
    worst_reward: float = 0.0
    """the rubric's lowest score for a played episode: what an episode that ends in an error gets"""


class Verifiers(Env):
    """One episode of a verifiers environment (the module docstring)."""

    Settings = VerifiersSettings
    required_fields = ("verifiers_env", "input")
    task_list = staticmethod(verifiers_task_list)

    def __init__(self, settings: VerifiersSettings | None = None):
        super().__init__(settings)
        self.worst_reward = self.settings.worst_reward
        self.rollout = None
        self.schemas: list[dict] = []

    async def reset(self, task: dict) -> list[dict]:
        self.vf_env = load(task["verifiers_env"])
        self.prompts: asyncio.Queue = asyncio.Queue()  # the rollout -> the adapter: "the policy's turn, on this"
        self.action: asyncio.Future | None = None      # the adapter -> the rollout: the turn's text
        self.seen: list = []                           # the conversation tandem has, as the library's messages
        client = _policy_client(self)
        self.rollout = asyncio.ensure_future(self.vf_env.rollout(dict(task["input"]), client, "tandem-policy"))
        return await self._next_turn()

    async def step(self, action: str) -> StepResult:
        from verifiers.legacy.types import Response, ResponseMessage, ToolCall

        content, calls, info = action, None, {}
        if self.schemas:
            name = self.settings.tool_call_format
            types = [s["function"] for s in self.schemas] if name == "qwen3_coder" else None
            content, parsed = tool_format(name).split(action, types)
            if parsed is not None:
                good = [c for c in parsed if isinstance(c, dict)]
                calls = [ToolCall(id=f"call{i:05d}", name=c["name"], arguments=json.dumps(c["arguments"]))
                         for i, c in enumerate(good, start=len(self.seen))]
                info = {"tool_calls": len(parsed), "tool_errors": [e.reason for e in parsed if not isinstance(e, dict)],
                        "calls": [{"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in calls],
                        "content": content}
        message = ResponseMessage(content=content, tool_calls=calls or None,
                                  finish_reason="tool_calls" if calls else "stop", is_truncated=False)
        if self.action is None or self.action.done() or self.rollout.done():
            raise RuntimeError("step() with no turn asked for (the rollout is over or never started)")
        self.action.set_result(Response(id="tandem", created=int(time.time()), model="tandem-policy",
                                        message=message))
        messages = await self._next_turn()
        if not self.rollout.done():
            return StepResult(messages, 0.0, False, info)
        state = self.rollout.result()
        if state.get("error") is not None:
            raise RuntimeError(f"the rollout ended in an error: {state['error']!r}"[:300])
        await self.vf_env.rubric.score_rollout(state)  # the environment's verdict on the whole rollout
        await self.vf_env.rubric.cleanup(state)
        final = plain_messages(state.get("final_env_response") or [])
        return StepResult(final, state["reward"], True,
                          {**info, "stop_condition": str(state.get("stop_condition")),
                           "metrics": dict(state.get("metrics") or {})})

    async def _next_turn(self) -> list[dict]:
        """What is new in the conversation when the rollout next asks for the policy's turn ([] when it ended
        instead). Not bounded here: the boundary bounds the whole reset/step call (--env-step-timeout-s) and
        cancels this wait at its limit."""
        asking = asyncio.ensure_future(self.prompts.get())
        done, _ = await asyncio.wait({asking, self.rollout}, return_when=asyncio.FIRST_COMPLETED)
        if asking not in done:
            asking.cancel()
            self.rollout.result()  # what the rollout raised ends the episode (the boundary catches it)
            return []
        prompt, tools = asking.result()
        if self.seen:  # the conversation so far and the turn tandem played must be its head
            head = len(self.seen) + 1
            if len(prompt) < head or prompt[:len(self.seen)] != self.seen or prompt[len(self.seen)].role != "assistant":
                raise RuntimeError("the environment rewrote the conversation instead of extending it "
                                   "(tandem plays one growing conversation per episode)")
            new = prompt[head:]
        else:
            new = prompt
            self.schemas = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                              "parameters": t.parameters}} for t in tools or []]
        self.seen = list(prompt)
        return plain_messages(new)

    def tool_schemas(self) -> list[dict]:
        return self.schemas

    async def close(self) -> None:
        if self.rollout is not None and not self.rollout.done():
            self.rollout.cancel()  # an episode tandem ended first (turn or token limit): the rollout goes too


def _policy_client(owner: Verifiers):
    """The rollout's model client: each request is a turn tandem's policy plays (the adapter's step). A subclass
    of the library's Client (its rollout accepts no other); only get_response is ever called."""
    from verifiers.legacy.clients.client import Client

    class PolicyClient(Client):
        async def get_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            owner.action = asyncio.get_running_loop().create_future()
            owner.prompts.put_nowait((list(prompt), tools))
            return await owner.action  # cancelled with the rollout when the episode ends first

        def setup_client(self, config):
            raise NotImplementedError("tandem's policy client has no configuration")

        async def to_native_tool(self, tool):
            return tool

        async def to_native_prompt(self, messages):
            return messages, {}

        async def get_native_response(self, *args, **kwargs):
            raise NotImplementedError("tandem's policy client answers get_response only")

        async def raise_from_native_response(self, response):
            return None

        async def from_native_response(self, response):
            return response

        async def close(self):
            return None

    return PolicyClient(None)
