"""The explorer's OpenAI-compatible endpoint: `/v1/chat/completions`, `/v1/completions` and `/v1/models` on
127.0.0.1, answered by the explorer's own engine, so an agent written for the `openai` client trains unchanged
(common/explorer/agent.py). `/v1/completions` takes one prompt, as text or as token ids (ids continue a sample
exactly: common/explorer/agent.py states the rule); its reply is text (with `return_token_ids: true`, as in vLLM,
also the ids fed and sampled, which the next prompt can extend); tools play no part.

Everything that arrives here is untrusted and is checked once, in `parse_chat` / `parse_completion`: a malformed
request gets an OpenAI-shaped error (`{"error": {"message", "type", "param", "code"}}`, status 400) naming the field,
never a traceback, and nothing an agent sends can stop the explorer. Each episode gets its own API key (`open`), a fresh
random token that ties every call to that episode; a call with any other key (unknown, or of an episode that has
ended: `close`) is refused with 401. The port is picked by the system and bound to localhost only.

Sampling stays the run's: the trainer assumes the behaviour policy is the run's `--temperature` / `--top-p`, so a
request may name them only with those values (else 400 naming the field). `max_tokens` / `max_completion_tokens`
cap the reply below the run's `--max-new-tokens`; `n` must be 1; `logprobs`, penalties and unknown fields are
refused, naming the field. `stream: true` gets the same reply as server-sent chunks (`chat.completion.chunk`, then
`data: [DONE]`), sent once the call is sampled: the engine answers whole calls, so nothing arrives token by token.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web

ROLES = ("system", "developer", "user", "assistant", "tool")
IGNORED = ("user", "metadata", "store", "parallel_tool_calls", "service_tier")  # no effect on sampling
REFUSED_UNLESS = {"n": (None, 1), "logprobs": (None, False), "top_logprobs": (None,),
                  "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (None,),
                  "seed": (None,), "response_format": (None,)}
COMMON = {"model", "temperature", "top_p", "max_tokens", "stop", "stream", "stream_options", *IGNORED, *REFUSED_UNLESS}
FIELDS = {"messages", "tools", "tool_choice", "max_completion_tokens", *COMMON}
COMPLETION_FIELDS = {"prompt", "echo", "suffix", "best_of", "return_token_ids", *COMMON}
COMPLETION_REFUSED_UNLESS = {"echo": (None, False), "suffix": (None,), "best_of": (None, 1)}


class BadRequest(Exception):
    """A request the endpoint refuses: its status and the OpenAI error body's fields."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status

    def body(self) -> dict:
        kind = "authentication_error" if self.status == 401 else "invalid_request_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """A checked /v1/chat/completions request. Messages are normalised: content is text, a tool call's arguments
    a dict (what chat templates render), so two requests compare as messages."""
    messages: list[dict]
    tools: list[dict] | None = None           # the functions' schemas ({"name", "description", "parameters"})
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    call_tools: bool = True                   # tool_choice "none": the reply is text
    stream: bool = False
    stream_usage: bool = False                # stream_options.include_usage: a last chunk with the usage
    prompt: str | list[int] | None = None     # /v1/completions: the prompt (messages is then empty)
    return_token_ids: bool = False            # /v1/completions: the reply carries the ids fed and sampled


def _fail(message: str, param: str) -> BadRequest:
    return BadRequest(message, param, "invalid_value" if "must" in message else None)


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
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


def _tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _fail("tools must be a list", "tools")
    out = []
    for j, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) \
                or not isinstance(f.get("parameters", {}), dict):
            raise _fail(f"tools[{j}] must be {{'type': 'function', 'function': {{'name': str, 'parameters': "
                        "object}}}}", f"tools[{j}]")
        out.append({k: f[k] for k in ("name", "description", "parameters") if k in f})
    return out or None


def _number(body: dict, name: str, run_value: float) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(f"{name} must be a number", name)
    if abs(value - run_value) > 1e-6:
        raise BadRequest(f"{name} is the run's ({run_value:g}): the trainer assumes the policy sampled with it; "
                         f"got {value:g}", name, "unsupported_value")


def _same(value, allowed) -> bool:
    """value == allowed, where True is not 1 and False is not 0 (JSON tells them apart)."""
    if value is None or allowed is None or isinstance(value, bool) or isinstance(allowed, bool):
        return value is allowed
    return value == allowed


def _checked(body, fields: set[str], refused: dict, temperature: float, top_p: float) -> ChatRequest:
    """The checks both kinds of request share; a ChatRequest with no messages yet."""
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
    _number(body, "temperature", temperature)
    _number(body, "top_p", top_p)
    caps = [(k, body[k]) for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
    for name, value in caps:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _fail(f"{name} must be a positive integer", name)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise _fail("stop must be a non-empty string or a list of at most 4 of them", "stop")
    stream, options = body.get("stream") or False, body.get("stream_options")
    if not isinstance(stream, bool):
        raise _fail("stream must be a boolean", "stream")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise _fail("stream_options must be {'include_usage': bool}, with stream true", "stream_options")
    return ChatRequest([], None, min(v for _, v in caps) if caps else None, stop, True, stream,
                       bool((options or {}).get("include_usage")))


def parse_chat(body, temperature: float, top_p: float) -> ChatRequest:
    """The one check of a chat completion request (its JSON body), against the run's sampling."""
    request = _checked(body, FIELDS, REFUSED_UNLESS, temperature, top_p)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _fail("messages must be a non-empty list", "messages")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise BadRequest("tool_choice must be 'auto' or 'none' (a sampled policy cannot be forced to call a tool)",
                         "tool_choice", "unsupported_value")
    request.messages = [_message(m, i) for i, m in enumerate(messages)]
    request.tools, request.call_tools = _tools(body.get("tools")), choice != "none"
    return request


def parse_completion(body, temperature: float, top_p: float) -> ChatRequest:
    """The one check of a /v1/completions request: one prompt, a non-empty string or a non-empty list of token ids
    (whether each id is in the vocabulary is the agent workflow's check: it knows the tokenizer)."""
    request = _checked(body, COMPLETION_FIELDS, {**REFUSED_UNLESS, **COMPLETION_REFUSED_UNLESS}, temperature, top_p)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        request.prompt = list(prompt)
    elif isinstance(prompt, str) and prompt:
        request.prompt = prompt
    else:
        raise _fail("prompt must be one non-empty string or one non-empty list of token ids (integers)", "prompt")
    if not isinstance(body.get("return_token_ids", False), bool):
        raise _fail("return_token_ids must be a boolean", "return_token_ids")
    request.return_token_ids = body.get("return_token_ids", False)
    return request


@dataclass
class Completion:
    """What a handler answers a call with."""
    content: str | None
    tool_calls: list[dict]   # OpenAI-shaped: {"id", "type": "function", "function": {"name", "arguments": str}}
    finish_reason: str       # stop | length | tool_calls
    prompt_tokens: int
    completion_tokens: int
    prompt_token_ids: list[int] = field(default_factory=list)  # the ids fed ...
    token_ids: list[int] = field(default_factory=list)         # ... and the ids sampled (kept)


class Endpoint:
    """The HTTP server, on its own thread and event loop; `open(handler)` gives an episode its key. A handler is
    called as handler(ChatRequest) in a worker thread and returns a concurrent.futures.Future of a Completion (or
    raises BadRequest)."""

    def __init__(self, host: str = "127.0.0.1"):
        self.handlers: dict[str, object] = {}
        self.loop = asyncio.new_event_loop()
        self.sampling = (1.0, 1.0)   # (temperature, top_p) of the run; set by whoever serves the engine
        app = web.Application(client_max_size=16 << 20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
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

    def open(self, handler) -> str:
        key = "tandem-" + secrets.token_urlsafe(24)
        self.handlers[key] = handler
        return key

    def close(self, key: str) -> None:
        self.handlers.pop(key, None)

    def _handler(self, request: web.Request):
        auth = request.headers.get("Authorization", "")
        handler = self.handlers.get(auth.removeprefix("Bearer ").strip()) if auth.startswith("Bearer ") else None
        if handler is None:
            raise BadRequest("Incorrect API key provided: no running episode has it (an episode's key is valid "
                             "while it runs)", None, "invalid_api_key", 401)
        return handler

    @staticmethod
    def _error(e: BadRequest) -> web.Response:
        return web.json_response(e.body(), status=e.status)

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._handler(request)
        except BadRequest as e:
            return self._error(e)
        return web.json_response({"object": "list", "data": [
            {"id": "policy", "object": "model", "created": 0, "owned_by": "tandem"}]})

    async def _answer(self, request: web.Request, parse) -> tuple[dict, ChatRequest, Completion] | web.Response:
        """Check the call, hand it to its episode's handler and wait for the completion; or the error reply."""
        try:
            handler = self._handler(request)
            try:
                body = json.loads(await request.read())
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise BadRequest("We could not parse the JSON body of your request.") from None
            call = parse(body, *self.sampling)
            future = await self.loop.run_in_executor(None, handler, call)
            done: Completion = await asyncio.wrap_future(future)
        except BadRequest as e:
            return self._error(e)
        except Exception as e:  # noqa: BLE001  (a bug of ours answers this one call, never stops the endpoint)
            return web.json_response({"error": {"message": f"internal error: {type(e).__name__}: {e}",
                                                "type": "server_error", "param": None, "code": None}}, status=500)
        return body, call, done

    @staticmethod
    def _usage(done: Completion) -> dict:
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens}

    async def _chat(self, request: web.Request) -> web.Response:
        answered = await self._answer(request, parse_chat)
        if isinstance(answered, web.Response):
            return answered
        body, chat, done = answered
        head = {"id": "chatcmpl-" + secrets.token_hex(12), "created": int(time.time()), "model": body["model"]}
        message = {"role": "assistant", "content": done.content}
        if done.tool_calls:
            message["tool_calls"] = done.tool_calls
        if chat.stream:
            calls = [{"index": i, **c} for i, c in enumerate(done.tool_calls)]
            deltas = [{"role": "assistant", "content": ""}] + ([{"content": done.content}] if done.content else []) \
                + ([{"tool_calls": calls}] if calls else [])
            return await self._stream(request, {**head, "object": "chat.completion.chunk"},
                                      [{"delta": d, "finish_reason": None} for d in deltas]
                                      + [{"delta": {}, "finish_reason": done.finish_reason}],
                                      self._usage(done) if chat.stream_usage else None)
        return web.json_response({**head, "object": "chat.completion", "usage": self._usage(done), "choices": [
            {"index": 0, "message": message, "finish_reason": done.finish_reason, "logprobs": None}]})

    async def _completions(self, request: web.Request) -> web.Response:
        answered = await self._answer(request, parse_completion)
        if isinstance(answered, web.Response):
            return answered
        body, call, done = answered
        head = {"id": "cmpl-" + secrets.token_hex(12), "object": "text_completion", "created": int(time.time()),
                "model": body["model"]}
        ids = {"prompt_token_ids": done.prompt_token_ids, "token_ids": done.token_ids} if call.return_token_ids else {}
        if call.stream:
            return await self._stream(request, head, [{"text": done.content or "", "finish_reason": None, **ids},
                                                      {"text": "", "finish_reason": done.finish_reason}],
                                      self._usage(done) if call.stream_usage else None)
        return web.json_response({**head, "usage": self._usage(done), "choices": [
            {"index": 0, "text": done.content or "", "finish_reason": done.finish_reason, "logprobs": None, **ids}]})

    async def _stream(self, request: web.Request, head: dict, choices: list[dict], usage: dict | None):
        """The reply as server-sent events, one per choice part (a chat reply: the role, the content, the tool
        calls, the finish reason; a text completion: the text, the finish reason), the usage if asked for, then
        [DONE]. A client gone meanwhile costs its own reply only."""
        def event(choice: dict | None, **extra) -> bytes:
            choices = [] if choice is None else [{"index": 0, **choice, "logprobs": None}]
            return f"data: {json.dumps({**head, 'choices': choices, **extra})}\n\n".encode()

        parts = [event(c) for c in choices] + ([event(None, usage=usage)] if usage else []) + [b"data: [DONE]\n\n"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
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
