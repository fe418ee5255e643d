"""agent: n episodes of your own agent (`--agent path/to/file.py:fn`), which talks to the policy through the
explorer's OpenAI-compatible endpoint (common/explorer/endpoint.py), token-in/token-out.

Each episode runs `await fn(task, base_url, api_key)` in a thread of its own under `--agent-timeout-s`; the key
ties every call to the episode, and the endpoint refuses it once the episode has ended. A call is a request like
the multi-turn workflow's turn: the runner batches it with every other request in flight.

Capture (the rule): an episode's calls make one or more samples. A call *continues* the sample of an earlier call
when its messages are exactly that call's messages, then the assistant message the endpoint returned for it, then
at least one new message (tool results, a user turn), with the same tools; its prompt is then that sample's ids
so far (prompt | sampled ids) followed by the new messages' ids as the template renders them after an assistant
turn (common/explorer/chat.py), and those observation ids are masked. Any other call (the agent rewrote or
summarised its context, a sub-agent) starts a new sample whose prompt is the template's rendering of its messages.
A `/v1/completions` call continues a sample when its prompt, as token ids, is that sample's ids so far followed by
at least one more id (masked, as observations are); any other prompt, and every text prompt that re-encodes
sampled text differently, starts a new sample whose prompt is those ids. Chat and completion calls never continue
each other's samples. So every sample is one sequence built only by appending the exact ids the engine was fed
and sampled; nothing sampled is decoded and re-encoded.

Reward: `fn` returns a number (the episode's reward) or a string (its answer, scored by the task's verifier; a
task without one scores 0). Every sample of the episode gets that reward, and group advantages are formed over
all samples of the task's n episodes (an episode with k samples counts k times). Errors never pay: an agent that
raises, runs past its time, returns something else, or made no call at all (a client-side cache replayed its
answers) scores 0, marked failed (`end_reason` error, timeout, bad_return, no_call). Each failure says why: the
first of each kind (the end reason; for an error, the exception's type) is printed once with the end of the agent's
traceback, every one is counted (rollout/agent_failed/<kind>) and its error goes to samples.jsonl; refused calls
and sampling served the run's way are printed once and counted the same way. Bounds per episode:
`--agent-max-calls` calls and `--episode-token-budget` sampled tokens (a call beyond either is refused with a 400,
and the episode's samples are marked cut: finish reason "length"); a prompt over the budget is refused, one whose
characters alone show it cannot fit before it is tokenized. A sample one of whose replies was cut at its token limit
has finish reason "length" too (--mask-truncated, rollout/truncated_frac).

`--agent-cmd "..."` runs a program instead of fn, one process per episode (its own session, killed with everything
it started when the episode ends): OPENAI_BASE_URL and OPENAI_API_KEY are the episode's base URL and key (what the
openai client reads by default), its stdin is the task as one JSON object, and the last line it prints is its result,
`{"reward": number}` or `{"answer": string}` (anything else: bad_return; a non-zero exit: error, with its stderr's
end). Limits, capture and reward are fn's.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import secrets
import shlex
import sys
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field

from common.explorer.chat import TemplateMismatch, strip_reasoning
from common.explorer.endpoint import BadRequest, ChatRequest, Completion, RunSampling, endpoint
from common.explorer.multi_turn import tool_call_end
from common.explorer.workflow import Group, TokenSample, Workflow
from common.runtime.plugins import load_object
from common.runtime._group_guard import kill_group
from rewards import Reward

FAILED = ("error", "timeout", "bad_return", "no_call")
NO_CALL = ("the agent made no call to the endpoint: nothing of this policy to train (a client-side cache that "
           "replays answers? dspy: dspy.LM(..., cache=False))")
TRACEBACK_KEPT = 8  # lines of a failed agent's traceback printed with the first error of its kind
HUNG_GRACE_S = 1.0  # an agent whose thread still runs this long past its time limit is abandoned there
OUTPUT_KEPT = 1 << 16  # bytes of an --agent-cmd program's stdout kept (the end: its result is the last line)
ERROR_KEPT = 2000      # ... and of its stderr, for the episode's error
# An --agent-cmd program leads a session of its own, so that its episode's end kills everything it started; out of
# the worker's process group, it dies with the explorer through PR_SET_PDEATHSIG (kept across exec), as
# common/runtime/procs.py asks of such processes. This stdlib prologue sets it, then execs the program.
DIE_WITH_EXPLORER = """import ctypes, os, sys
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
except OSError:
    pass  # not Linux: the episode's end is the only cleanup
if os.getppid() != int(sys.argv[1]):
    os._exit(1)  # the explorer died before prctl
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as e:
    print(f"cannot run {sys.argv[2]}: {e.strerror}", file=sys.stderr)
    os._exit(127)"""


@dataclass
class AgentEpisode:
    deadline: float
    key: str = ""
    calls: int = 0
    tokens: int = 0                  # sampled tokens of all its calls
    cut: str = ""                    # max_calls | budget: a call was refused for a limit
    end_reason: str | None = None    # done | error | timeout | bad_return | no_call
    result: object = None            # what fn returned (a number or an answer)
    error: str = ""
    error_kind: str = ""             # the end reason, or for an error the exception's type
    samples: list = field(default_factory=list)
    overrides: Counter = field(default_factory=Counter)  # calls served the run's way, per request field
    refused: Counter = field(default_factory=Counter)    # calls refused, per error code

    @property
    def failed(self) -> bool:
        return self.end_reason in FAILED


@dataclass
class AgentSample(TokenSample):
    """One sequence of an agent episode: first prompt | sampled ids | observation ids | sampled ids ..."""
    episode: AgentEpisode = field(kw_only=True)
    finish_reason: str | None = None
    messages: list[dict] = field(default_factory=list)   # the last call's messages
    tools: list[dict] | None = None
    reply: dict | None = None                             # the assistant message returned for the last call
    sampled_stop: int | None = None                       # the stop token that ended the last call, if any
    cut_short: bool = False                               # a call's reply was cut at its token limit
    busy: bool = False                                    # a call of this sample is being answered
    turn_rewards: list = field(default_factory=list)      # no environment: no step rewards

    @property
    def turns(self) -> int:
        return len(self.turn_ends)

    def verifier_input(self, task: dict, tokenizer, whole_episodes: bool = False) -> str | None:
        """The answer the agent returned, when it returned one and the task names a verifier (or --reward-fn)."""
        answer = self.episode.result
        return answer if isinstance(answer, str) and ("reward" in task or whole_episodes) \
            and not self.episode.failed else None

    def reward(self, verified: Reward | None, env_reward: str) -> Reward:
        """ALGO LOGIC: the episode's reward: the number fn returned, or the verifier's score of its answer; a
        failed episode scores 0, marked failed (rewards/THREATS.md "Errors never pay")."""
        e = self.episode
        info = {"reason": f"agent {e.end_reason}", "end_reason": e.end_reason, "calls": e.calls,
                "samples": len(e.samples), **({"cut": e.cut} if e.cut else {}),
                **({"error": e.error} if e.error else {})}
        if e.failed:
            return Reward(0.0, {**info, "failed": True, "failed_reason": e.end_reason, "format_ok": False})
        if verified is not None:
            return Reward(verified.score, {**verified.info, **info, "verifier": verified.score})
        return Reward(float(e.result) if not isinstance(e.result, str) else 0.0, info)

    def counts(self) -> dict[str, float]:
        """Per episode (on its first sample): rollout/episodes, rollout/agent_calls, rollout/agent_samples,
        rollout/end/<reason>, rollout/agent_cut/<limit>, rollout/agent_failed/<kind>, and its calls per field
        served the run's way (rollout/agent_override/<field>) and per refusal (rollout/agent_refused/<code>)."""
        e = self.episode
        if e.samples[0] is not self:
            return {}
        return {"rollout/episodes": 1, "rollout/agent_calls": e.calls, "rollout/agent_samples": len(e.samples),
                f"rollout/end/{e.end_reason}": 1, **({f"rollout/agent_cut/{e.cut}": 1} if e.cut else {}),
                **({f"rollout/agent_failed/{e.error_kind}": 1} if e.failed else {}),
                **{f"rollout/agent_override/{k}": v for k, v in e.overrides.items()},
                **{f"rollout/agent_refused/{k}": v for k, v in e.refused.items()}}


def _valid_result(result) -> bool:
    return isinstance(result, str) or (isinstance(result, (int, float)) and not isinstance(result, bool)
                                       and math.isfinite(result))


class BadOutput(Exception):
    """An --agent-cmd program printed no result: its episode ends bad_return."""


def parse_output(stdout: bytes) -> float | str:
    """The one check of what an --agent-cmd program printed: its last non-empty line, {"reward": a finite number}
    or {"answer": a string}."""
    lines = stdout.decode("utf-8", "replace").strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    if isinstance(result, dict) and len(result) == 1:
        if isinstance(result.get("answer"), str):
            return result["answer"]
        if "reward" in result and not isinstance(result["reward"], str) and _valid_result(result["reward"]):
            return float(result["reward"])
    last = lines[-1][:200] if lines else ""
    raise BadOutput(f'--agent-cmd printed no result: its last line must be {{"reward": number}} or {{"answer": '
                    f'string}}, got {last!r}')


async def _drain(stream: asyncio.StreamReader, keep: int) -> bytes:
    """Everything the stream sends (so the program never blocks on a full pipe), keeping the last `keep` bytes."""
    out = b""
    while chunk := await stream.read(1 << 16):
        out = (out + chunk)[-keep:]
    return out


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    try:
        stdin.write(data)
        await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the program ended without reading its task: its exit status and output say the rest


async def run_command(argv: list[str], task: dict, base_url: str, api_key: str) -> float | str:
    """One episode of --agent-cmd; cancelled at the episode's time limit like an async fn."""
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}
    pipe = asyncio.subprocess.PIPE
    process = await asyncio.create_subprocess_exec(sys.executable, "-I", "-S", "-c", DIE_WITH_EXPLORER,
                                                   str(os.getpid()), *argv, stdin=pipe, stdout=pipe, stderr=pipe,
                                                   env=env, start_new_session=True)
    try:
        out, err, _ = await asyncio.gather(_drain(process.stdout, OUTPUT_KEPT), _drain(process.stderr, ERROR_KEPT),
                                           _feed(process.stdin, json.dumps(task).encode()))
        status = await process.wait()
    finally:
        kill_group(process.pid)  # the program and whatever it started (its session) end with the episode
        await process.wait()  # SIGKILL cannot be ignored: this returns at once
    if status != 0:
        raise RuntimeError(f"--agent-cmd exited with status {status}: "
                           f"{err.decode('utf-8', 'replace').strip()[-ERROR_KEPT:]}")
    return parse_output(out)


class Agent(Workflow):
    """The n episodes of one task. Calls arrive from the agents' threads (through the endpoint) and leave by
    `arrivals`; `receive` answers them. One lock guards the episodes' samples."""

    def __init__(self, task: dict, group_id: int, n: int, ctx):
        self.ctx = ctx
        self.fn = load_object(ctx.agent, "--agent") if ctx.agent else \
            functools.partial(run_command, shlex.split(ctx.agent_cmd))
        self.server = endpoint()
        self.server.sampling = RunSampling(ctx.temperature, ctx.top_p, ctx.max_new_tokens)
        self.group = Group(task, group_id, [])
        self.lock = threading.Lock()
        self._arrived: list = []   # (sample, prompt ids, cap, future, request) not yet handed to the runner
        self._out: dict = {}       # id(sample) -> (future, request, cap) in the engine
        self._no_prompt = ctx.renderer.ids(ctx.renderer.glue_text)[:1] or [0]  # an empty sample's one-token prompt
        self.episodes = [self._launch(task) for _ in range(n)]

    def _launch(self, task: dict) -> AgentEpisode:
        e = AgentEpisode(deadline=time.monotonic() + self.ctx.agent_timeout_s)
        e.key = self.server.open(lambda request: self._call(e, request), lambda error: self._refused(e, error))
        threading.Thread(target=self._run, args=(e, dict(task)), name="agent", daemon=True).start()
        return e

    def _run(self, e: AgentEpisode, task: dict) -> None:
        kind, tail = None, []
        try:
            result = asyncio.run(asyncio.wait_for(self.fn(task, self.server.base_url, e.key),
                                                  self.ctx.agent_timeout_s))
            end, error = ("done", "") if _valid_result(result) else ("bad_return", f"returned {type(result).__name__}")
        except (asyncio.TimeoutError, TimeoutError):
            result, end, error = None, "timeout", f"ran past --agent-timeout-s {self.ctx.agent_timeout_s:g}"
        except BadOutput as exc:
            result, end, error = None, "bad_return", str(exc)
        except BaseException as exc:  # noqa: BLE001  (the agent's bug ends its episode, counted; not the run)
            result, end, error, kind = None, "error", f"{type(exc).__name__}: {exc}", type(exc).__name__
            tail = "".join(traceback.format_exception(exc)).rstrip().splitlines()[-TRACEBACK_KEPT:]
        self._end(e, end, result, error, kind, tail)

    def _end(self, e: AgentEpisode, reason: str, result=None, error: str = "", kind: str | None = None,
             tail: list[str] = ()) -> None:
        with self.lock:
            if e.end_reason is not None:
                return
            self.server.close(e.key)
            if reason == "done" and e.calls == 0:
                reason, error = "no_call", NO_CALL if not e.refused else \
                    f"every call the agent made was refused ({', '.join(f'{k} x{v}' for k, v in e.refused.items())})"
            e.end_reason, e.result, e.error, e.error_kind = reason, result, error, kind or reason
            for call in [c for c in self._arrived if c[0].episode is e]:  # never handed out: nobody waits for it
                self._arrived.remove(call)
                call[0].busy = False
                call[3].set_exception(BadRequest("the episode has ended", None, "episode_ended"))
            # an episode with no answered call keeps one empty sample: its end is counted, and it trains nothing
            e.samples = [s for s in e.samples if s.response_ids or s.busy] or [AgentSample(self._no_prompt, episode=e)]
            self.group.responses = [s for s in self.group.responses if s.episode is not e] + e.samples
            for s in e.samples:
                s.finish_reason = "length" if e.cut or s.cut_short else "stop"
        if e.failed:
            say_once(f"failed:{e.error_kind}", f"[tandem] an agent episode failed ({reason}): {error[:ERROR_KEPT]}"
                     + "".join(f"\n    {line}" for line in tail) + f"\n  (the first of its kind: each is counted as "
                     f"rollout/agent_failed/{e.error_kind}, scores 0, and its error is in samples.jsonl)")

    def _refused(self, e: AgentEpisode, error: BadRequest) -> None:
        code = error.code or "invalid_request"
        with self.lock:
            e.refused[code] += 1
        say_once(f"refused:{code}", f"[tandem] an agent call was refused ({error.status} {code}"
                 f"{f', param {error.param}' if error.param else ''}): {error} (the first of its kind: each is "
                 f"counted as rollout/agent_refused/{code}; the agent gets the error)")

    # ------------------------------------------------------------------ the endpoint side (a worker thread)
    def _continued(self, e: AgentEpisode, messages: list[dict], tools) -> AgentSample | None:
        for s in reversed(e.samples):
            n = len(s.messages)
            if not s.busy and s.reply is not None and s.messages and s.tools == tools and len(messages) > n + 1 \
                    and messages[:n] == s.messages and messages[n] == s.reply:
                return s
        return None

    def _continued_ids(self, e: AgentEpisode, prompt: list[int]) -> AgentSample | None:
        for s in reversed(e.samples):
            n = len(s.prompt_ids) + len(s.response_ids)
            if not s.busy and s.reply is not None and not s.messages and len(prompt) > n \
                    and prompt[:n] == s.prompt_ids + s.response_ids:
                return s
        return None

    def _too_long(self, chars: int, field: str) -> None:
        """Count first, cheaply: text of `chars` characters is at least chars / (the vocabulary's longest token)
        tokens, so a prompt that cannot fit is refused before it is rendered and tokenized (which would take
        seconds for megabytes, under the workflow's lock)."""
        budget, longest = self.ctx.episode_token_budget, longest_token(self.ctx.tokenizer)
        if chars > budget * longest:
            raise BadRequest(f"This model's maximum context length is {budget} tokens (--episode-token-budget): "
                             f"your {field} hold {chars} characters, at least {chars // longest} tokens", field,
                             "context_length_exceeded")

    def _completion_prompt(self, e: AgentEpisode, request: ChatRequest) -> tuple[AgentSample | None, list[int],
                                                                               list[int]]:
        """A /v1/completions call: (the sample it continues or None, its prompt ids, the new observation ids)."""
        tokenizer = self.ctx.tokenizer
        if isinstance(request.prompt, str):
            self._too_long(len(request.prompt), "prompt")
            prompt = tokenizer.encode(request.prompt, add_special_tokens=False)
        else:
            prompt, vocab = request.prompt, len(tokenizer)
            if not all(0 <= t < vocab for t in prompt):
                raise BadRequest(f"prompt holds a token id outside the vocabulary (0..{vocab - 1})", "prompt",
                                 "invalid_value")
        sample = self._continued_ids(e, prompt)
        return sample, prompt, prompt[len(sample.prompt_ids) + len(sample.response_ids):] if sample else []

    def _call(self, e: AgentEpisode, request: ChatRequest) -> list[Future]:
        """Admit one call: its prompt (a continued sample's ids so far plus the new messages', or a new sample's),
        its cap, and one request to the engine per choice (choice 0 continues the sample, if any; the others are
        new samples whose prompt is the same ids). The futures of its choices."""
        renderer, budget = self.ctx.renderer, self.ctx.episode_token_budget
        with self.lock:
            if e.end_reason is not None:
                raise BadRequest("the episode has ended", None, "episode_ended", 401)
            if e.calls >= self.ctx.agent_max_calls:
                e.cut = "max_calls"
                raise BadRequest(f"the episode made --agent-max-calls {self.ctx.agent_max_calls} calls", None,
                                 "episode_call_limit")
            sample = None if request.prompt is not None else self._continued(e, request.messages, request.tools)
            try:
                if request.prompt is not None:
                    sample, prompt, new = self._completion_prompt(e, request)
                elif sample is not None:
                    observation = request.messages[len(sample.messages) + 1:]
                    self._too_long(sum(len(m["content"]) for m in observation), "messages")
                    new = renderer.observation_ids(observation, sample.sampled_stop)
                    prompt = sample.prompt_ids + sample.response_ids + new
                else:
                    self._too_long(sum(len(m["content"]) for m in request.messages), "messages")
                    messages, tools = renderer.with_tools(request.messages, request.tools or [])
                    prompt = renderer.prompt_ids(messages, tools)
            except TemplateMismatch as exc:
                raise BadRequest(f"the model's chat template cannot render these messages ({exc})", "messages",
                                 "template") from None
            if len(prompt) >= budget:
                field = "messages" if request.prompt is None else "prompt"
                raise BadRequest(f"This model's maximum context length is {budget} tokens (--episode-token-budget): "
                                 f"your {field} resulted in {len(prompt)} tokens", field, "context_length_exceeded")
            cap = min(request.max_tokens or self.ctx.max_new_tokens, self.ctx.max_new_tokens, budget - len(prompt),
                      (budget - e.tokens) // request.n)
            if cap <= 0:
                e.cut = "budget"
                raise BadRequest(f"the episode sampled its --episode-token-budget {budget} tokens", None,
                                 "episode_token_budget")
            e.calls += 1
            e.overrides.update(request.overrides.keys())
            futures = []
            for choice in range(request.n):
                if sample is None or choice > 0:
                    sample = AgentSample(prompt, episode=e)
                    e.samples.append(sample)
                    self.group.responses.append(sample)
                else:
                    sample._append(new, [0.0] * len(new), 0, sample.versions[-1])  # masked: its version is moot
                sample.messages, sample.tools, sample.busy = list(request.messages), request.tools, True
                futures.append(Future())
                self._arrived.append((sample, prompt, cap, futures[-1], request))
        for name, asked in request.overrides.items():
            say_once(f"override:{name}", f"[tandem] agent requests set {name}={json.dumps(asked['requested'])}: "
                     f"served with the run's {json.dumps(asked['applied'])} (the trainer's log-probs assume the run's "
                     f"sampling); the reply says so in sampling_overrides, counted as rollout/agent_override/{name}")
        return futures

    # ------------------------------------------------------------------ the runner side
    def requests(self) -> list:
        return []  # every request comes from an agent (arrivals)

    def arrivals(self) -> list[tuple[AgentSample, list[int], int]]:
        for e in self.episodes:  # an agent stuck in blocking code: its episode ends here, its thread is abandoned
            if e.end_reason is None and time.monotonic() > e.deadline + HUNG_GRACE_S:
                self._end(e, "timeout", error=f"ran past --agent-timeout-s {self.ctx.agent_timeout_s:g}")
        with self.lock:
            taken, self._arrived = self._arrived, []
            for sample, _, cap, future, request in taken:
                self._out[id(sample)] = (future, request, cap)
            return [(sample, prompt, cap) for sample, prompt, cap, _, _ in taken]

    def finished(self) -> bool:
        with self.lock:
            return all(e.end_reason for e in self.episodes) and not self._out and not self._arrived

    def receive(self, sample: AgentSample, generation, version: int) -> int:
        """Append the sampled ids (cut after a stop string, if the request named one: the kept prefix is exactly
        what was sampled) and answer the call: text, or OpenAI-shaped tool calls parsed in the model's format."""
        with self.lock:
            future, request, cap = self._out.pop(id(sample))
        decode = self.ctx.renderer.decode
        ids, logprobs = generation.response_ids[:cap], generation.logprobs[:cap]
        stopped = generation.finish_reason == "stop" and len(generation.response_ids) <= cap
        cuts = [(end, s) for s in request.stop if (end := tool_call_end(ids, decode, close=s)) is not None]
        stop_text = None
        if cuts:
            end, stop_text = min(cuts)
            ids, logprobs, stopped = ids[:end], logprobs[:end], True
        text = decode(ids)
        if stop_text is not None:
            text = text[:text.index(stop_text)]
        content, calls = text, None
        if request.tools and request.call_tools:  # the tool parser sees no reasoning, as in multi_turn
            visible = strip_reasoning(text) if self.ctx.reasoning_parser == "think" else text
            content, calls = self.ctx.tool_format.split(visible, request.tools)
            offered = {t["name"] for t in request.tools}
            if calls and any(isinstance(c, Exception) or c["name"] not in offered for c in calls):
                content, calls = text, None  # malformed, or a function the request did not offer (the API never
                # calls one): the agent gets the text
        tool_calls = [{"id": "call_" + secrets.token_hex(8), "type": "function",
                       "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in calls or []]
        finish = "tool_calls" if tool_calls else "stop" if stopped else "length"
        tokens = [decode([i]) for i in ids] if request.logprobs else []
        with self.lock:
            sample._append(ids, logprobs, 1, version, generation.versions)
            sample.turn_ends.append(len(sample.response_ids))
            sample.episode.tokens += len(ids)
            fed = sample.prompt_ids + sample.response_ids[:len(sample.response_ids) - len(ids)]
            done = Completion(content if content or not tool_calls else None, tool_calls, finish, len(fed), len(ids),
                              fed, list(ids), list(logprobs), tokens)
            sample.reply = done.reply()
            sample.sampled_stop = ids[-1] if stopped and stop_text is None and ids else None
            sample.cut_short = sample.cut_short or not stopped
            sample.busy = False
        future.set_result(done)
        return len(ids)


_SAID: dict[int, set[str]] = {}  # process id -> what it (an explorer) has printed once (a fork starts afresh)
_SAID_LOCK = threading.Lock()


def say_once(kind: str, line: str) -> None:
    """Print `line` on stderr the first time this process meets `kind` (later ones are only counted)."""
    with _SAID_LOCK:
        said = _SAID.setdefault(os.getpid(), set())
        if kind in said:
            return
        said.add(kind)
    print(line, file=sys.stderr, flush=True)


@functools.cache  # one tokenizer per run: computed once
def longest_token(tokenizer) -> int:
    """Characters of the vocabulary's longest token string: no token covers more characters of text (byte-level
    BPE: a token's string has one character per byte; SentencePiece: one per character)."""
    return max(len(t) for t in tokenizer.get_vocab())
