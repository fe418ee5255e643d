"""Token-in/token-out between turns: the ids of what the chat template puts after a sampled assistant turn.

An episode is one token sequence: the first prompt's ids, then per turn the exact sampled ids, then the ids of the
observation as the template renders it. The sampled text is decoded (for the environment) but never re-encoded:
re-tokenising "12 apples" may give other ids than the ones sampled, and the trainer would then score tokens the
policy never chose (TRL #5224). What is tokenised is only template text *after* the assistant turn:

    glue:  what the template writes after an assistant message's content (SmolLM2/ChatML: "<|im_end|>\\n"), minus
           the stop token the model sampled itself (so the sampled <|im_end|> stays the sampled one);
    delta: render(conversation + observation, generation prompt) minus render(conversation), checked prefix-wise
           on text and on ids (a template that does not extend prefix-wise raises TemplateMismatch: that episode
           ends with reason "template" rather than being re-tokenised).
"""

from __future__ import annotations

SENTINEL = "TANDEMSENTINEL7"


class TemplateMismatch(Exception):
    pass


class ChatRenderer:
    def __init__(self, tokenizer):
        if not tokenizer.chat_template:
            raise ValueError("multi-turn episodes need a tokenizer with a chat template")
        self.tokenizer = tokenizer
        probe = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": SENTINEL}])
        self.glue_text = probe[probe.rindex(SENTINEL) + len(SENTINEL):]  # ChatML: "<|im_end|>\n"
        self.glue_ids = self.ids(self.glue_text)
        user = [{"role": "user", "content": "hi"}]
        schema = {"type": "function", "function": {"name": "probe_tool", "description": "probe",
                                                    "parameters": {"type": "object", "properties": {}}}}
        self.renders_tools = self.render(user, tools=[schema]) != self.render(user)

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **kwargs)

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def with_tools(self, messages: list[dict], schemas: list[dict]) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools= argument): the schemas go to the template when it renders them, else into the system
        message (appended to an existing one) in the Hermes format."""
        if not schemas:
            return messages, None
        wrapped = [{"type": "function", "function": s} if "function" not in s else s for s in schemas]
        if self.renders_tools:
            return messages, wrapped
        from common.envs.tools import tools_system_prompt

        text = tools_system_prompt([w["function"] for w in wrapped])
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}] + messages[1:], None
        return [{"role": "system", "content": text}] + messages, None

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.ids(self.render(messages, add_generation_prompt=True, tools=tools))

    def observation_ids(self, conversation: list[dict], observation: list[dict], sampled_stop: int | None,
                        tools: list[dict] | None = None) -> list[int]:
        """Ids to append after a sampled assistant turn (the last message of `conversation`) so that the sequence
        continues as the template renders `conversation + observation` with a generation prompt. `sampled_stop`:
        the stop token the model sampled at the end of its turn (None when the turn was cut at the token limit)."""
        content = conversation[-1]["content"]
        before = self.render(conversation, tools=tools)
        if not before.endswith(content + self.glue_text):
            raise TemplateMismatch("the template does not render the assistant turn verbatim")
        after = self.render(conversation + observation, add_generation_prompt=True, tools=tools)
        if not after.startswith(before):
            raise TemplateMismatch("the template does not extend the conversation prefix-wise")
        before_ids, after_ids = self.ids(before), self.ids(after)
        if after_ids[:len(before_ids)] != before_ids:
            raise TemplateMismatch("the rendered conversation's ids do not extend prefix-wise")
        glue = self.glue_ids
        if sampled_stop is not None and glue and glue[0] == sampled_stop:
            glue = glue[1:]
        return list(glue) + after_ids[len(before_ids):]
