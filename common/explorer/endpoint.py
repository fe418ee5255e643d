"""The explorer's OpenAI-compatible endpoint: `/v1/chat/completions`, `/v1/responses`, `/v1/completions` and
`/v1/models` on 127.0.0.1, answered by the explorer's own engine, so an agent written for the `openai` client (or a
framework on it) trains unchanged (common/explorer/agent.py). `/v1/responses` is the Responses API: `instructions`,
`input` (a string or items: messages, function_call, function_call_output), function `tools`, and multi-turn by
`previous_response_id` (the episode's own responses) or by sending the whole conversation again; its messages are
checked and captured as chat messages. `/v1/completions` takes one prompt, as text or as token ids (ids continue a
sample exactly: common/explorer/agent.py states the rule); its reply is text (with `return_token_ids: true`, as in
vLLM, also the ids fed and sampled, which the next prompt can extend); tools play no part. Any other route gets an
OpenAI-shaped 404 naming these.

Everything that arrives here is untrusted and is checked once, in `parse_chat` / `parse_responses` /
`parse_completion`: a malformed request gets an OpenAI-shaped error (`{"error": {"message", "type", "param",
"code"}}`, status 400; a body over 16 MB 413) naming the field, never a traceback, and nothing an agent sends can stop
the explorer. Each episode gets its own API key (`open`), a fresh random token that ties every call to that episode;
a call with any other key (unknown, or of an episode that has ended: `close`) is refused with 401. The port is picked
by the system and bound to localhost only.

Sampling is the run's, and a request that asks otherwise is served, not refused: the trainer assumes the behaviour
policy is the run's `--temperature` / `--top-p`, unconstrained. `temperature`, `top_p`, `seed`, penalties,
`logit_bias`, `top_logprobs`, `max_tokens` above `--max-new-tokens`, `tool_choice` "required" or a named function
(served as "auto": constraining the first tokens would sample from a distribution the trainer does not compute),
JSON `response_format` (unconstrained, for the same reason), `parallel_tool_calls` false and reasoning settings are
served the run's way; the reply names each in `sampling_overrides` ({field: {"requested", "applied"}}) and the
`X-Sampling-Overrides` header. A smaller `max_tokens`, `stop`, `n` (up to 16 choices, each a sample) and `logprobs`
(each sampled token's behaviour log-prob) are honoured. `stream: true` gets the same reply as server-sent events
(chat: `chat.completion.chunk` then `data: [DONE]`; responses: `response.created` ... `response.completed`), sent
once the call is sampled: the engine answers whole calls, so nothing arrives token by token.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web

ROLES = ("system", "developer", "user", "assistant", "tool")
IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")  # no effect
SAMPLING = {"model", "temperature", "top_p", "max_tokens", "stop", "stream", "stream_options", "n", "seed", "logprobs",
            "frequency_penalty", "presence_penalty", "logit_bias", *IGNORED}
FIELDS = {"messages", "tools", "tool_choice", "max_completion_tokens", "top_logprobs", "response_format",
          "parallel_tool_calls", "reasoning_effort", "verbosity", *SAMPLING}
COMPLETION_FIELDS = {"prompt", "echo", "suffix", "best_of", "return_token_ids", *SAMPLING}
COMPLETION_REFUSED_UNLESS = {"echo": (None, False), "suffix": (None,), "best_of": (None, 1)}
RESPONSES_FIELDS = {"model", "input", "instructions", "previous_response_id", "tools", "tool_choice",
                    "max_output_tokens", "temperature", "top_p", "parallel_tool_calls", "text", "reasoning", "stream",
                    "stream_options", "include", "truncation", "top_logprobs", "max_tool_calls", "background",
                    *IGNORED}
ROUTES = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "GET /v1/models")
MAX_N = 16          # choices of one call (each one a sample of the episode)
MAX_DEPTH = 64      # nesting of a request body: deeper is refused before anything walks it
MAX_BODY = 16 << 20  # bytes of a request body: more is refused (413)


class BadRequest(Exception):
    """A request the endpoint refuses: its status and the OpenAI error body's fields."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(self.status, "invalid_request_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class RunSampling:
    """What the run samples with: a request that asks otherwise is served with these, and told so."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 1 << 20   # --max-new-tokens


@dataclass
class ChatRequest:
    """A checked request of any route. Messages are normalised: content is text, a tool call's arguments a dict
    (what chat templates render), so two requests compare as messages."""
    messages: list[dict]
    tools: list[dict] | None = None           # the functions' schemas ({"name", "description", "parameters"})
    max_tokens: int | None = None             # the request's cap, at most the run's
    stop: list[str] = field(default_factory=list)
    call_tools: bool = True                   # tool_choice "none": the reply is text
    stream: bool = False
    stream_usage: bool = False                # stream_options.include_usage: a last chunk with the usage
    prompt: str | list[int] | None = None     # /v1/completions: the prompt (messages is then empty)
    return_token_ids: bool = False            # /v1/completions: the reply carries the ids fed and sampled
    n: int = 1                                # choices: n samples of this one call
    logprobs: bool = False                    # the reply carries each sampled token's log-prob
    overrides: dict = field(default_factory=dict)  # field -> {"requested", "applied"}: asked for, served the run's

    def override(self, name: str, requested, applied) -> None:
        self.overrides[name] = {"requested": requested, "applied": applied}


def _fail(message: str, param: str) -> BadRequest:
    return BadRequest(message, param, "invalid_value" if "must" in message else None)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(content, where: str, parts: tuple[str, ...] = ("text",)) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in parts
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise _fail(f"{where} must be a string or a list of text parts", where)


def _tool_call(call, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not isinstance(call.get("id"), str):
        raise _fail(f"{where} must be {{'id': str, 'type': 'function', 'function': {{'name': str, 'arguments': "
                    "str}}}}", where)
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        raise _fail(f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments") from None
    if not isinstance(arguments, dict):
        raise _fail(f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
    return {"id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise _fail(f"{where} must be an object whose role is one of {', '.join(ROLES)}", f"{where}.role")
    role = "system" if m["role"] == "developer" else m["role"]
    out = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
    if role == "assistant" and m.get("tool_calls"):
        if not isinstance(m["tool_calls"], list):
            raise _fail(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise _fail(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        out["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


def _tools(tools, flat: bool = False) -> list[dict] | None:
    """Function schemas, from chat's {"type": "function", "function": {...}} or (flat) the Responses API's
    {"type": "function", "name", ...}."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _fail("tools must be a list", "tools")
    out = []
    for j, t in enumerate(tools):
        f = (t if flat else t.get("function")) if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) \
                or not isinstance(f.get("parameters") or {}, dict):
            shape = "'name': str, 'parameters': object" if flat else \
                "'function': {'name': str, 'parameters': object}"
            raise _fail(f"tools[{j}] must be {{'type': 'function', {shape}}} (function tools only)", f"tools[{j}]")
        out.append({k: f[k] for k in ("name", "description", "parameters") if f.get(k) is not None})
    return out or None


def _tool_choice(request: ChatRequest, choice, named) -> None:
    """tool_choice: auto, none (the reply is text), or required / a named function: served as auto (the policy
    samples as it would, so the behaviour log-probs stay those of what it sampled), counted as an override."""
    if choice in (None, "auto"):
        return
    if choice == "none":
        request.call_tools = False
        return
    name = named(choice) if isinstance(choice, dict) and choice.get("type") == "function" else None
    if choice != "required" and not isinstance(name, str):
        raise _fail("tool_choice must be 'auto', 'none', 'required' or a named function", "tool_choice")
    offered = {t["name"] for t in request.tools or []}
    if not offered:
        raise _fail(f"tool_choice {json.dumps(choice)} must come with tools", "tool_choice")
    if name not in offered | {None}:
        raise _fail(f"tool_choice must name a function that tools offers ({', '.join(sorted(offered))})",
                    "tool_choice")
    request.override("tool_choice", choice, "auto")


def _response_format(request: ChatRequest, fmt, where: str) -> None:
    """JSON output asked for (json_object, json_schema): served unconstrained, counted as an override (a
    constrained sampler would not be the policy whose log-probs the trainer computes)."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None if fmt is None else ""
    if kind not in (None, "text", "json_object", "json_schema"):
        raise _fail(f"{where} must be {{'type': 'text' | 'json_object' | 'json_schema', ...}}", where)
    if kind in ("json_object", "json_schema"):
        request.override(where, fmt, {"type": "text"})


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value)):
        raise _fail(f"{name} must be a number", name)
    return value


def _same(value, allowed) -> bool:
    """value == allowed, where True is not 1 and False is not 0 (JSON tells them apart)."""
    if value is None or allowed is None or isinstance(value, bool) or isinstance(allowed, bool):
        return value is allowed
    return value == allowed


def _checked(body, fields: set[str], refused: dict, run: RunSampling, caps=("max_completion_tokens", "max_tokens"),
             ) -> ChatRequest:
    """The checks every route shares; a ChatRequest with no messages yet. Sampling fields that differ from the
    run's are served with the run's values, each recorded in `overrides`."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name in body:
        if name not in fields:
            raise BadRequest(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")
    for name, allowed in refused.items():
        if name in body and not any(_same(body[name], a) for a in allowed):
            raise BadRequest(f"{name}={json.dumps(body[name])} is not supported by this endpoint (allowed: "
                             f"{', '.join(json.dumps(a) for a in allowed)})", name, "unsupported_value")
    if not isinstance(body.get("model"), str):
        raise _fail("model must be a string", "model")
    request = ChatRequest([])
    for name in ("temperature", "top_p"):
        value, applied = _number(body, name), getattr(run, name)
        if value is not None and abs(value - applied) > 1e-6:
            request.override(name, value, applied)
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name):
            request.override(name, body[name], 0)
    if body.get("seed") is not None:
        if not _int(body["seed"]):
            raise _fail("seed must be an integer", "seed")
        request.override("seed", body["seed"], None)  # the run's own random stream samples
    if body.get("logit_bias") is not None:
        if not isinstance(body["logit_bias"], dict):
            raise _fail("logit_bias must be an object", "logit_bias")
        if body["logit_bias"]:
            request.override("logit_bias", body["logit_bias"], None)
    n = 1 if body.get("n") is None else body["n"]
    if not _int(n) or not 1 <= n <= MAX_N:
        raise _fail(f"n must be an integer from 1 to {MAX_N}", "n")
    request.n = n
    given = [(k, body[k]) for k in caps if body.get(k) is not None]
    for name, value in given:
        if not _int(value) or value < 1:
            raise _fail(f"{name} must be a positive integer", name)
    if given:
        name, value = min(given, key=lambda kv: kv[1])
        if value > run.max_tokens:
            request.override(name, value, run.max_tokens)
        request.max_tokens = min(value, run.max_tokens)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise _fail("stop must be a non-empty string or a list of at most 4 of them", "stop")
    request.stop = stop
    stream, options = body.get("stream") or False, body.get("stream_options")
    if not isinstance(stream, bool):
        raise _fail("stream must be a boolean", "stream")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise _fail("stream_options must be {'include_usage': bool}, with stream true", "stream_options")
    request.stream, request.stream_usage = stream, bool((options or {}).get("include_usage"))
    return request


def _top_logprobs(request: ChatRequest, body: dict) -> None:
    top = body.get("top_logprobs")
    if top is not None:
        if not _int(top) or not 0 <= top <= 20:
            raise _fail("top_logprobs must be an integer from 0 to 20", "top_logprobs")
        if top:
            request.override("top_logprobs", top, 0)  # the engine keeps the sampled token's log-prob only


def _flags(request: ChatRequest, body: dict, names: tuple[str, ...]) -> None:
    """parallel_tool_calls false, reasoning effort and verbosity: the policy writes what it writes (counted)."""
    if body.get("parallel_tool_calls") is not None:
        if not isinstance(body["parallel_tool_calls"], bool):
            raise _fail("parallel_tool_calls must be a boolean", "parallel_tool_calls")
        if not body["parallel_tool_calls"]:
            request.override("parallel_tool_calls", False, True)
    for name in names:
        if body.get(name) is not None:
            request.override(name, body[name], None)


def parse_chat(body, run: RunSampling, history=None) -> ChatRequest:
    """The one check of a chat completion request (its JSON body), against the run's sampling."""
    request = _checked(body, FIELDS, {}, run)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _fail("messages must be a non-empty list", "messages")
    if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
        raise _fail("logprobs must be a boolean", "logprobs")
    request.logprobs = bool(body.get("logprobs"))
    _top_logprobs(request, body)
    request.messages = [_message(m, i) for i, m in enumerate(messages)]
    request.tools = _tools(body.get("tools"))
    _tool_choice(request, body.get("tool_choice"), lambda c: (c.get("function") or {}).get("name"))
    _response_format(request, body.get("response_format"), "response_format")
    _flags(request, body, ("reasoning_effort", "verbosity"))
    return request


def parse_completion(body, run: RunSampling, history=None) -> ChatRequest:
    """The one check of a /v1/completions request: one prompt, a non-empty string or a non-empty list of token ids
    (whether each id is in the vocabulary is the agent workflow's check: it knows the tokenizer)."""
    request = _checked(body, COMPLETION_FIELDS, COMPLETION_REFUSED_UNLESS, run)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(_int(t) for t in prompt):
        request.prompt = list(prompt)
    elif isinstance(prompt, str) and prompt:
        request.prompt = prompt
    else:
        raise _fail("prompt must be one non-empty string or one non-empty list of token ids (integers)", "prompt")
    if not isinstance(body.get("return_token_ids", False), bool):
        raise _fail("return_token_ids must be a boolean", "return_token_ids")
    request.return_token_ids = body.get("return_token_ids", False)
    logprobs = body.get("logprobs")  # here the number of alternatives per token
    if logprobs is not None and (not _int(logprobs) or not 0 <= logprobs <= 5):
        raise _fail("logprobs must be an integer from 0 to 5", "logprobs")
    request.logprobs = logprobs is not None
    if logprobs:
        request.override("logprobs", logprobs, 0)
    return request


def _input_items(items) -> list[dict]:
    """The Responses API's input as chat messages: a string is one user message; message items keep their role,
    function_call items join the assistant message before them (one turn's calls), function_call_output items
    are tool messages; reasoning items are dropped (a reply of this endpoint has none)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _fail("input must be a string or a non-empty list of items", "input")
    out = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("system", "developer", "user", "assistant"):
            content = _text(item.get("content"), f"{where}.content", ("input_text", "output_text", "text"))
            out.append({"role": item["role"], "content": content})
        elif kind == "function_call" and all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
            content = _text(item.get("output"), f"{where}.output", ("input_text", "output_text", "text"))
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
        elif kind != "reasoning":
            raise _fail(f"{where} must be a message (role system, developer, user or assistant), a function_call "
                        "{call_id, name, arguments} or a function_call_output {call_id, output}", where)
    try:
        return [_message(m, i) for i, m in enumerate(out)]
    except BadRequest as e:  # a function_call's arguments that are not a JSON object
        raise _fail(f"input: {e}", "input") from None


def parse_responses(body, run: RunSampling, history: dict) -> ChatRequest:
    """The one check of a /v1/responses request. Its messages: `instructions` as the system message, then the
    conversation of `previous_response_id` (one of this episode's, from `history`), then `input`."""
    request = _checked(body, RESPONSES_FIELDS, {"background": (None, False)}, run, caps=("max_output_tokens",))
    previous = body.get("previous_response_id")
    if previous is not None and previous not in history:
        raise BadRequest(f"Previous response with id '{previous}' not found (an episode sees its own responses "
                         "only)", "previous_response_id", "previous_response_not_found")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _fail("instructions must be a string", "instructions")
    request.messages = ([{"role": "system", "content": instructions}] if instructions else []) \
        + (history[previous] if previous else []) + _input_items(body.get("input"))
    include = body.get("include") or []
    if not isinstance(include, list):
        raise _fail("include must be a list", "include")
    request.logprobs = "message.output_text.logprobs" in include
    _top_logprobs(request, body)
    request.tools = _tools(body.get("tools"), flat=True)
    _tool_choice(request, body.get("tool_choice"), lambda c: c.get("name"))
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise _fail("text must be an object", "text")
    _response_format(request, (text or {}).get("format"), "text.format")
    reasoning = body.get("reasoning")
    _flags(request, body, ())
    if isinstance(reasoning, dict) and any(v is not None for v in reasoning.values()):
        request.override("reasoning", reasoning, None)
    return request


def _depth_ok(value, limit: int = MAX_DEPTH) -> bool:
    """Whether the parsed body nests at most `limit` levels (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return False
            stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return True


@dataclass
class Completion:
    """What a handler answers one choice of a call with."""
    content: str | None
    tool_calls: list[dict]   # OpenAI-shaped: {"id", "type": "function", "function": {"name", "arguments": str}}
    finish_reason: str       # stop | length | tool_calls
    prompt_tokens: int
    completion_tokens: int
    prompt_token_ids: list[int] = field(default_factory=list)  # the ids fed ...
    token_ids: list[int] = field(default_factory=list)         # ... and the ids sampled (kept)
    logprobs: list[float] = field(default_factory=list)        # each kept id's behaviour log-prob
    tokens: list[str] = field(default_factory=list)            # each kept id's text (when logprobs were asked for)

    def reply(self) -> dict:
        """The assistant message as the next request will send it back (normalised: arguments as dicts)."""
        message = {"role": "assistant", "content": self.content or ""}
        if self.tool_calls:
            message["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in self.tool_calls]
        return message


def _chat_logprobs(done: Completion) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(done.tokens, done.logprobs)], "refusal": None}


def _text_logprobs(done: Completion) -> dict:
    offsets = [sum(len(t) for t in done.tokens[:i]) for i in range(len(done.tokens))]
    return {"tokens": done.tokens, "token_logprobs": done.logprobs, "top_logprobs": None, "text_offset": offsets}


def _output_items(done: Completion, logprobs: bool) -> list[dict]:
    """A Responses API reply's output: the text as a message item (when there is text, or no tool call), then
    one function_call item per tool call."""
    items = []
    if done.content or not done.tool_calls:
        part = {"type": "output_text", "text": done.content or "", "annotations": [],
                **({"logprobs": _chat_logprobs(done)["content"]} if logprobs else {})}
        items.append({"type": "message", "id": "msg_" + secrets.token_hex(12), "status": "completed",
                      "role": "assistant", "content": [part]})
    items += [{"type": "function_call", "id": "fc_" + secrets.token_hex(12), "call_id": c["id"], "status": "completed",
               "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in done.tool_calls]
    return items


class Endpoint:
    """The HTTP server, on its own thread and event loop; `open(handler, refused)` gives an episode its key. A
    handler is called as handler(ChatRequest) in a worker thread and returns one concurrent.futures.Future of a
    Completion per choice (or raises BadRequest); `refused(BadRequest)` hears of every call of the episode that
    was refused."""

    def __init__(self, host: str = "127.0.0.1"):
        self.handlers: dict[str, tuple] = {}
        self.history: dict[str, dict] = {}   # key -> {response id: its conversation} (/v1/responses)
        self.loop = asyncio.new_event_loop()
        self.sampling = RunSampling()  # the run's; set by whoever serves the engine
        app = web.Application(client_max_size=MAX_BODY)
        for route, parse, reply in (("chat/completions", parse_chat, self._chat),
                                    ("completions", parse_completion, self._completions),
                                    ("responses", parse_responses, self._responses)):
            app.router.add_post(f"/v1/{route}", functools.partial(self._answer, parse=parse, reply=reply))
        app.router.add_get("/v1/models", self._models)
        app.router.add_route("*", "/{path:.*}", self._not_found)
        self.runner = web.AppRunner(app, access_log=None)
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(host, ready), name="endpoint", daemon=True).start()
        if not ready.wait(60):
            raise RuntimeError("the OpenAI-compatible endpoint did not start within 60 s")
        self.base_url = f"http://{host}:{self.port}/v1"

    def _serve(self, host: str, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, host, 0).start())
        self.port = self.runner.addresses[0][1]
        ready.set()
        self.loop.run_forever()

    def open(self, handler, refused=lambda e: None) -> str:
        key = "tandem-" + secrets.token_urlsafe(24)
        self.handlers[key], self.history[key] = (handler, refused), {}
        return key

    def close(self, key: str) -> None:
        self.handlers.pop(key, None)
        self.history.pop(key, None)

    def _key(self, request: web.Request) -> str:
        auth = request.headers.get("Authorization", "")
        key = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        if key not in self.handlers:
            raise BadRequest("Incorrect API key provided: no running episode has it (an episode's key is valid "
                             "while it runs)", None, "invalid_api_key", 401)
        return key

    @staticmethod
    def _error(e: BadRequest) -> web.Response:
        return web.json_response(e.body(), status=e.status)

    async def _not_found(self, request: web.Request) -> web.Response:
        return self._error(BadRequest(f"Unknown route {request.method} {request.path}: this endpoint serves "
                                      f"{', '.join(ROUTES)}", None, "unknown_url", 404))

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._key(request)
        except BadRequest as e:
            return self._error(e)
        return web.json_response({"object": "list", "data": [
            {"id": "policy", "object": "model", "created": 0, "owned_by": "tandem"}]})

    async def _body(self, request: web.Request):
        try:
            body = json.loads(await request.read())
        except web.HTTPRequestEntityTooLarge:
            raise BadRequest(f"the request body is over {MAX_BODY >> 20} MB", None, "request_too_large", 413) \
                from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("We could not parse the JSON body of your request.") from None
        except RecursionError:
            body = None
        if body is None or not _depth_ok(body):
            raise BadRequest(f"the request body nests deeper than {MAX_DEPTH} levels", None, "invalid_value")
        return body

    async def _answer(self, request: web.Request, parse, reply) -> web.Response:
        """Check the call, hand it to its episode's handler, wait for its choices and `reply` with them (request,
        body, key, call, choices, body fields, headers: the last two tell the client which of its sampling fields
        were served the run's way); or the error reply."""
        key, refused = None, None
        try:
            key = self._key(request)
            handler, refused = self.handlers[key]
            body = await self._body(request)
            call = parse(body, self.sampling, self.history.get(key, {}))
            futures = await self.loop.run_in_executor(None, handler, call)
            done: list[Completion] = list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except BadRequest as e:
            if refused is not None and e.status != 401:
                refused(e)
            return self._error(e)
        except Exception as e:  # noqa: BLE001  (a bug of ours answers this one call, never stops the endpoint)
            return web.json_response({"error": {"message": f"internal error: {type(e).__name__}: {e}",
                                                "type": "server_error", "param": None, "code": None}}, status=500)
        told = ({"sampling_overrides": call.overrides}, {"X-Sampling-Overrides": ",".join(call.overrides)}) \
            if call.overrides else ({}, {})
        return await reply(request, body, key, call, done, *told)

    @staticmethod
    def _usage(done: list[Completion]) -> dict:
        prompt, completion = done[0].prompt_tokens, sum(d.completion_tokens for d in done)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def _chat(self, request: web.Request, body: dict, _, chat: ChatRequest, done: list, told, headers):
        head = {"id": "chatcmpl-" + secrets.token_hex(12), "created": int(time.time()), "model": body["model"], **told}
        choices = []
        for i, d in enumerate(done):
            message = {"role": "assistant", "content": d.content, **({"tool_calls": d.tool_calls} if d.tool_calls
                                                                      else {})}
            choices.append({"index": i, "message": message, "finish_reason": d.finish_reason,
                            "logprobs": _chat_logprobs(d) if chat.logprobs else None})
        if chat.stream:
            events = []
            for i, d in enumerate(done):
                calls = [{"index": j, **c} for j, c in enumerate(d.tool_calls)]
                deltas = [{"role": "assistant", "content": ""}] + ([{"content": d.content}] if d.content else []) \
                    + ([{"tool_calls": calls}] if calls else [])
                events += [{"index": i, "delta": x, "finish_reason": None,
                            "logprobs": _chat_logprobs(d) if chat.logprobs and k == 1 else None}
                           for k, x in enumerate(deltas)]
                events.append({"index": i, "delta": {}, "finish_reason": d.finish_reason, "logprobs": None})
            return await self._stream(request, [{**head, "object": "chat.completion.chunk", "choices": [e]}
                                                for e in events], headers,
                                      {**head, "object": "chat.completion.chunk", "choices": [],
                                       "usage": self._usage(done)} if chat.stream_usage else None)
        return web.json_response({**head, "object": "chat.completion", "usage": self._usage(done),
                                  "choices": choices}, headers=headers)

    async def _completions(self, request: web.Request, body: dict, _, call: ChatRequest, done: list, told, headers):
        head = {"id": "cmpl-" + secrets.token_hex(12), "object": "text_completion", "created": int(time.time()),
                "model": body["model"], **told}
        choices = [{"index": i, "text": d.content or "", "finish_reason": d.finish_reason,
                    "logprobs": _text_logprobs(d) if call.logprobs else None,
                    **({"prompt_token_ids": d.prompt_token_ids, "token_ids": d.token_ids}
                       if call.return_token_ids else {})} for i, d in enumerate(done)]
        if call.stream:
            events = [{**c, "finish_reason": None} for c in choices] + \
                [{"index": i, "text": "", "finish_reason": d.finish_reason, "logprobs": None}
                 for i, d in enumerate(done)]
            return await self._stream(request, [{**head, "choices": [e]} for e in events], headers,
                                      {**head, "choices": [], "usage": self._usage(done)} if call.stream_usage
                                      else None)
        return web.json_response({**head, "usage": self._usage(done), "choices": choices}, headers=headers)

    async def _responses(self, request: web.Request, body: dict, key: str, call: ChatRequest, choices: list, told,
                         headers):
        (done,) = choices
        rid = "resp_" + secrets.token_hex(16)
        system = 1 if body.get("instructions") else 0  # instructions do not carry over to the next response
        if key in self.history:
            self.history[key][rid] = call.messages[system:] + [done.reply()]
        cut = done.finish_reason == "length"
        response = {
            "id": rid, "object": "response", "created_at": int(time.time()), "model": body["model"],
            # a reply cut at the token limit says so in incomplete_details; its status stays "completed": the
            # Agents SDK raises on "incomplete", which would end the episode over the policy's own long reply
            "status": "completed", "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "error": None, "instructions": body.get("instructions"), "output": _output_items(done, call.logprobs),
            "parallel_tool_calls": True, "tool_choice": "auto" if call.call_tools else "none",
            "tools": body.get("tools") or [], "temperature": self.sampling.temperature, "top_p": self.sampling.top_p,
            "max_output_tokens": call.max_tokens, "previous_response_id": body.get("previous_response_id"),
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": body.get("metadata") or {},
            "usage": {"input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": done.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": done.prompt_tokens + done.completion_tokens}, **told}
        if not call.stream:
            return web.json_response(response, headers=headers)
        events = [{"type": "response.created", "response": {**response, "status": "in_progress", "output": [],
                                                             "usage": None}}]
        for i, item in enumerate(response["output"]):
            events += [{"type": "response.output_item.added", "output_index": i, "item": item}]
            if item["type"] == "message" and item["content"][0]["text"]:
                events.append({"type": "response.output_text.delta", "output_index": i, "content_index": 0,
                               "item_id": item["id"], "delta": item["content"][0]["text"], "logprobs": []})
            events.append({"type": "response.output_item.done", "output_index": i, "item": item})
        events.append({"type": "response.completed", "response": response})
        return await self._stream(request, [{**e, "sequence_number": i} for i, e in enumerate(events)], headers,
                                  None, named=True)

    async def _stream(self, request: web.Request, events: list[dict], headers: dict, usage: dict | None,
                      named: bool = False):
        """The reply as server-sent events (chat: the role, the content, the tool calls, the finish reason of each
        choice; a text completion: the text, the finish reason; a response: its lifecycle events), the usage if
        asked for, then [DONE] (chat and text). A client gone meanwhile costs its own reply only."""
        def event(data: dict) -> bytes:
            return (f"event: {data['type']}\n" if named else "").encode() + f"data: {json.dumps(data)}\n\n".encode()

        parts = [event(e) for e in events] + ([event(usage)] if usage else []) + ([] if named else
                                                                                 [b"data: [DONE]\n\n"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               **headers})
        try:
            await response.prepare(request)
            for part in parts:
                await response.write(part)
            await response.write_eof()
        except ConnectionError:
            pass  # the client hung up: its reply is lost, nothing else
        return response


_ENDPOINT: tuple[int, Endpoint] | None = None  # (the process it serves, the endpoint)
_LOCK = threading.Lock()


def endpoint() -> Endpoint:
    """This process's endpoint (one explorer per process), started on first use. A process forked from one that
    had started it starts its own: the serving thread stayed in the parent."""
    global _ENDPOINT
    with _LOCK:
        if _ENDPOINT is None or _ENDPOINT[0] != os.getpid():
            _ENDPOINT = os.getpid(), Endpoint()
        return _ENDPOINT[1]
