"""Tool-call formats: how a model family writes a tool call, as a registry (`--tool-call-format`, FORMATS).

Each format splits a turn's text into (content, calls): `calls` is None when the turn calls no tool (it is an
answer), else one entry per call, {"name", "arguments"} or a ToolError("malformed", ...). The formats, each the one
its family's published chat template renders for an assistant message with `tool_calls` (tests/test_tool_formats.py
renders a call with each template and parses it back):

- hermes (Hermes, Qwen 2.5 / Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.
- llama3_json (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the turn is `{"name": ..., "parameters": {...}}`, optionally
  after `<|python_tag|>`; several calls separated by ";".
- mistral (Mistral 7B v0.3, Mixtral, Nemo...): `[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}, ...]`.
  `[TOOL_CALLS]` is a special token that decoding with skip_special_tokens removes, so the format names it in
  `keep_tokens` and the renderer keeps it when it decodes a turn (common/explorer/chat.py).
- qwen3_coder (Qwen3-Coder): `<tool_call>\n<function=NAME>\n<parameter=ARG>\nvalue\n</parameter>\n...</function>
  \n</tool_call>`; values are text, converted to the type the tool's JSON schema declares.

`--tool-call-format auto` (the default) picks the format whose marker the model's chat template contains
(`detect`), else hermes. `close` is the text that completes one call (in-turn tools cut the turn right after it);
formats whose call runs to the end of the turn (llama3_json, mistral) have none: the turn ends at the call anyway.

The text parsed is the policy's, so it is bounded input: a call longer than MAX_CALL_CHARS or whose JSON nests
deeper than MAX_DEPTH is a malformed call (the error observation the policy pays for, rollout/tool_error/malformed),
never a parser's RecursionError.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MAX_CALL_CHARS = 32_000  # the text of one call (llama3_json, mistral: of all the turn's calls)
MAX_DEPTH = 16           # nesting of [ and { in a call's JSON


class ToolError(Exception):
    """A tool call that cannot be served; `reason` is a short metric-friendly name."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _nesting(text: str) -> int:
    """The deepest nesting of [ and { in JSON text, outside strings (a linear scan: no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _check_bounds(text: str) -> None:
    """A ValueError when `text` is beyond the parser's limits (the caller's malformed call)."""
    if len(text) > MAX_CALL_CHARS:
        raise ValueError(f"longer than {MAX_CALL_CHARS} characters")
    if _nesting(text) > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")


def _json(text: str):
    """json.loads within the limits (a ValueError beyond them, as for text that is not JSON)."""
    _check_bounds(text)
    return json.loads(text)


def _call(obj, args_key: str = "arguments") -> dict | ToolError:
    """{"name", "arguments"} from a decoded JSON call, or a ToolError naming what is wrong with it."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolError("malformed", f'tool call needs {{"name": ..., "{args_key}": {{...}}}}')
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = _json(args)
        except ValueError:
            pass
    if not isinstance(args, dict):
        return ToolError("malformed", "tool call arguments must be a JSON object")
    return {"name": obj["name"], "arguments": args}


def split_hermes(text: str, schemas=None) -> tuple[str, list | None]:
    if "<tool_call>" not in text:
        return text, None
    calls: list = []
    for body in TOOL_CALL.findall(text):
        try:
            calls.append(_call(_json(body.strip())))
        except ValueError as e:
            calls.append(ToolError("malformed", f"tool call is not valid JSON within the limits ({e})"))
    if not calls or text.count("<tool_call>") > len(calls):  # an opened block that never closed
        calls.append(ToolError("malformed", "<tool_call> without a closing </tool_call>"))
    return TOOL_CALL.sub("", text).split("<tool_call>")[0].strip(), calls


def _json_values(text: str, sep: str) -> list:
    """The JSON values of `text`, one after another, separated by whitespace or `sep` (a ValueError otherwise, or
    beyond the limits)."""
    _check_bounds(text)
    decoder, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == sep):
            i += 1
        if i == len(text):
            return out
        value, i = decoder.raw_decode(text, i)
        out.append(value)


def split_llama3_json(text: str, schemas=None) -> tuple[str, list | None]:
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").strip()
    if not tagged and not re.match(r'\{\s*"(name|type)"', body):
        return text, None
    try:
        values = _json_values(body, ";")
    except ValueError as e:
        return "", [ToolError("malformed", f"tool call is not valid JSON ({e})")]
    values = [v["function"] if isinstance(v, dict) and isinstance(v.get("function"), dict) else v for v in values]
    return "", [_call(v, "parameters") for v in values] or [ToolError("malformed", "empty tool call")]


def split_mistral(text: str, schemas=None) -> tuple[str, list | None]:
    if "[TOOL_CALLS]" not in text:
        return text, None
    content, _, body = text.partition("[TOOL_CALLS]")
    try:
        values = _json_values(body.strip(), ",")
    except ValueError as e:
        return content.strip(), [ToolError("malformed", f"tool calls are not valid JSON ({e})")]
    flat = [c for v in values for c in (v if isinstance(v, list) else [v])]
    return content.strip(), [_call(c) for c in flat] or [ToolError("malformed", "empty [TOOL_CALLS]")]


FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _typed(value: str, kind: str | None):
    """A qwen3_coder parameter's text as the type its schema declares (text when it does not parse as one)."""
    if kind == "string":
        return value
    try:
        parsed = json.loads(value)  # bounded by split_qwen3_coder
    except json.JSONDecodeError:
        return value
    if kind is None or (kind, type(parsed)) in {("integer", int), ("number", int), ("number", float),
                                                ("boolean", bool), ("object", dict), ("array", list)}:
        return parsed
    return value


def split_qwen3_coder(text: str, schemas=None) -> tuple[str, list | None]:
    if "<tool_call>" not in text:
        return text, None
    types = {s.get("name"): {k: v.get("type") for k, v in s.get("parameters", {}).get("properties", {}).items()}
             for s in (schemas or [])}
    calls: list = []
    for body in TOOL_CALL.findall(text):
        function = FUNCTION.search(body)
        if function is None:
            calls.append(ToolError("malformed", "tool call needs <function=NAME>...</function>"))
            continue
        name = function.group(1).strip()
        kinds = types.get(name, {})
        parameters = PARAMETER.findall(function.group(2))
        try:
            if len(body) > MAX_CALL_CHARS:
                raise ValueError(f"longer than {MAX_CALL_CHARS} characters")
            for k, v in parameters:
                if kinds.get(k.strip()) != "string":  # the values _typed parses as JSON
                    _check_bounds(v)
        except ValueError as e:
            calls.append(ToolError("malformed", f"tool call beyond the limits ({e})"))
            continue
        calls.append({"name": name, "arguments": {k.strip(): _typed(v, kinds.get(k.strip())) for k, v in parameters}})
    if not calls or text.count("<tool_call>") > len(calls):
        calls.append(ToolError("malformed", "<tool_call> without a closing </tool_call>"))
    return TOOL_CALL.sub("", text).split("<tool_call>")[0].strip(), calls


@dataclass(frozen=True)
class ToolFormat:
    split: Callable        # (text, tool schemas or None) -> (content, calls or None)
    marker: str            # text of a chat template that teaches this format (detect)
    close: str | None      # text that completes one call (in-turn tools), None: the call ends the turn
    keep_tokens: tuple[str, ...] = ()  # special tokens the parser needs to see in the decoded turn


FORMATS = {  # detect tries them in this order: the most specific marker first
    "qwen3_coder": ToolFormat(split_qwen3_coder, "<function=", "</tool_call>"),
    "mistral": ToolFormat(split_mistral, "[TOOL_CALLS]", None, ("[TOOL_CALLS]",)),
    "llama3_json": ToolFormat(split_llama3_json, "ipython<|end_header_id|>", None, ("<|python_tag|>",)),
    "hermes": ToolFormat(split_hermes, "<tool_call>", "</tool_call>"),
}


def detect(chat_template: str | None) -> str:
    """The format a chat template teaches (its marker), else hermes."""
    for name, fmt in FORMATS.items():
        if chat_template and fmt.marker in chat_template:
            return name
    return "hermes"


def tool_format(name: str) -> ToolFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r} (one of {', '.join(FORMATS)})")
    return FORMATS[name]
