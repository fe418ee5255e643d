"""Token-in/token-out between turns: the ids of what the chat template puts after a sampled assistant turn.

An episode is one token sequence, built only by appending: the first prompt's ids, then per turn the exact
sampled ids, then the ids of the observation as the template renders it. The engine's next prompt *is* that list
(`prompt_ids + response_ids`) and the trainer gets the same list, so the trainer scores exactly the ids the model
was conditioned on and sampled. The sampled text is decoded (for the environment) but never re-encoded:
re-tokenising "12 apples" may give other ids than the ones sampled (TRL #5224).

What is tokenised is only template text that comes *after* an assistant turn, rendered against a fixed two-message
probe conversation (user "hi", assistant SENTINEL) rather than the episode's own history:

    delta = render(probe + observation, generation prompt) after SENTINEL
          = glue (what the template writes after an assistant message, ChatML "<|im_end|>\\n")
            + the observation's messages + the generation prompt

minus the stop token the model sampled itself (so the sampled <|im_end|> stays the sampled one). Why the probe:
templates that rewrite earlier turns (thinking models such as Qwen3 and DeepSeek-R1 drop the `<think>` block of
every assistant turn before the last user message) never render the history as the episode holds it, so a diff
of two full renders of the real conversation cannot match; the probe's assistant turn has no reasoning to drop.
Cost: one render of a two-message conversation per turn, whatever the episode's length (no quadratic
re-render). Templates with strict roles (Gemma: no system role, user/assistant alternation, no tool role) get the
observation as one user message and the system text inside the first user message. A template that still raises
gives TemplateMismatch: that episode ends with reason "template" (counted), never the run.
"""

from __future__ import annotations

import re
import threading

import jinja2

from common.envs.tools import tools_system_prompt

SENTINEL = "TANDEMSENTINEL7"
PROBE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": SENTINEL}]


class TemplateMismatch(Exception):
    pass


def strip_reasoning(text: str, open_tag: str = "<think>", close_tag: str = "</think>") -> str:
    """The reasoning parser: what the environment and the tool parser see of a turn, so that a tool call or an
    answer written while thinking counts for nothing. Reasoning is everything between `<think>` and its matching
    `</think>` (nested blocks counted, a block may be re-opened later in the turn), and everything after a
    `<think>` that never closes. A turn whose first tag is `</think>` began inside reasoning (its template opened
    it): the text before that tag is reasoning too. Any other `</think>` that closes nothing is dropped."""
    if open_tag not in text and close_tag not in text:
        return text
    depth, visible = 0, []
    for i, part in enumerate(re.split(f"({re.escape(open_tag)}|{re.escape(close_tag)})", text)):
        if part == open_tag:
            depth += 1
        elif part == close_tag:
            if i == 1:  # the turn's first tag closes reasoning: the turn began inside it
                visible = []
            depth = max(0, depth - 1)
        elif depth == 0:
            visible.append(part)
    return "".join(visible).strip()


def as_user_message(observation: list[dict]) -> list[dict]:
    """An observation as one user message (for templates without a tool role or with strict alternation); tool
    results in Hermes <tool_response> blocks."""
    parts = [f"<tool_response>\n{m['content']}\n</tool_response>" if m["role"] == "tool" else m["content"]
             for m in observation]
    return [{"role": "user", "content": "\n".join(parts)}]


def merge_system(messages: list[dict]) -> list[dict]:
    """A leading system message moved into the first user message (templates that reject the system role)."""
    if not messages or messages[0]["role"] != "system":
        return messages
    system, rest = messages[0]["content"], messages[1:]
    if rest and rest[0]["role"] == "user":
        return [{**rest[0], "content": f"{system}\n\n{rest[0]['content']}"}] + rest[1:]
    return [{"role": "user", "content": system}] + rest


class ChatRenderer:
    def __init__(self, tokenizer, keep_tokens: tuple[str, ...] = ()):
        if not tokenizer.chat_template:
            raise ValueError("multi-turn episodes need a tokenizer with a chat template (or --chat-template FILE)")
        self.tokenizer = tokenizer
        self.lock = threading.Lock()  # episodes step in worker threads; a fast tokenizer is not re-entrant
        # special tokens a tool-call format needs to see (Mistral's [TOOL_CALLS]), kept where decoding skips specials
        vocab = tokenizer.get_vocab()
        self.keep = {vocab[t]: t for t in keep_tokens if t in vocab}
        probe = self._renders(PROBE)
        if probe is None:
            raise ValueError("the chat template raises on a user + assistant conversation")
        if SENTINEL not in probe:
            raise ValueError("the chat template does not render an assistant message's content")
        self.glue_text = probe[probe.rindex(SENTINEL) + len(SENTINEL):]  # ChatML: "<|im_end|>\n"
        user = [{"role": "user", "content": "hi"}]
        schema = {"type": "function", "function": {"name": "probe_tool", "description": "probe",
                                                    "parameters": {"type": "object", "properties": {}}}}
        self.renders_tools = self._renders(user, tools=[schema]) not in (None, self._renders(user))
        self.renders_system = self._renders([{"role": "system", "content": "s"}] + user) is not None

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **kwargs)

    def _renders(self, messages: list[dict], **kwargs) -> str | None:
        """The render, or None where the template raises (raise_exception in its Jinja text)."""
        try:
            return self.render(messages, **kwargs)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError):
            return None

    def ids(self, text: str) -> list[int]:
        with self.lock:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """The text of sampled ids, special tokens skipped except those the tool-call format needs."""
        with self.lock:
            if not self.keep or not any(i in self.keep for i in ids):
                return self.tokenizer.decode(ids, skip_special_tokens=True)
            parts, start = [], 0
            for k, i in enumerate(ids + [None]):
                if i is None or i in self.keep:
                    parts.append(self.tokenizer.decode(ids[start:k], skip_special_tokens=True))
                    if i is not None:
                        parts.append(self.keep[i])
                    start = k + 1
            return "".join(parts)

    def with_tools(self, messages: list[dict], schemas: list[dict]) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools= argument): the schemas go to the template when it renders them, else into the system
        message (appended to an existing one) in the Hermes format."""
        if not schemas:
            return messages, None
        wrapped = [{"type": "function", "function": s} if "function" not in s else s for s in schemas]
        if self.renders_tools:
            return messages, wrapped
        text = tools_system_prompt([w["function"] for w in wrapped])
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}] + messages[1:], None
        return [{"role": "system", "content": text}] + messages, None

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The first prompt's ids; a template without a system role gets the system text in the first user
        message. TemplateMismatch where the template raises either way."""
        text = self._renders(messages, add_generation_prompt=True, tools=tools)
        if text is None and not self.renders_system:
            text = self._renders(merge_system(messages), add_generation_prompt=True, tools=tools)
        if text is None:
            raise TemplateMismatch("the chat template raises on the first prompt's messages")
        return self.ids(text)

    def observation_ids(self, observation: list[dict], sampled_stop: int | None) -> list[int]:
        """Ids to append after a sampled assistant turn so that the sequence goes on as the template renders
        `observation` after an assistant message, generation prompt included. `sampled_stop`: the stop token the
        model sampled at the end of its turn (None when the turn was cut at the token limit)."""
        delta = self._delta(observation)
        if delta is None:
            delta = self._delta(as_user_message(observation))
        if delta is None:
            raise TemplateMismatch("the chat template cannot render the observation after an assistant turn")
        ids = self.ids(delta)
        if sampled_stop is not None and ids and ids[0] == sampled_stop:
            ids = ids[1:]
        return ids

    def _delta(self, observation: list[dict]) -> str | None:
        after = self._renders(PROBE + observation, add_generation_prompt=True)
        if after is None or after.count(SENTINEL) != 1:
            return None
        delta = after[after.index(SENTINEL) + len(SENTINEL):]
        return delta if delta.startswith(self.glue_text) else None
