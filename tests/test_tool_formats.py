"""Tool-call formats (common/envs/tool_formats.py) against their families' published chat templates: each template
renders an assistant message with OpenAI-shaped `tool_calls`, the rendered turn is tokenised with a tokenizer built
here with the family's special tokens, decoded as the workflow decodes a sampled turn, and parsed back to the same
call; `--tool-call-format auto` recognises each template; and an episode in each format runs its tool and keeps
OpenAI-shaped messages (assistant `tool_calls`, tool messages with `tool_call_id` and `name`).

Templates: hermes is Qwen3's (tests/test_agents.py QWEN3_TEMPLATE, from Qwen/Qwen3-8B); the others are vLLM's
published tool templates for the family, tests/templates/ (vllm-project/vllm examples/: tool_chat_template_
llama3.1_json.jinja, tool_chat_template_mistral_parallel.jinja, tool_chat_template_qwen3coder.jinja, the last the
Qwen3-Coder model's own)."""

import os

import pytest

from common.envs.tool_formats import FORMATS, detect, tool_format
from common.explorer.chat import ChatRenderer, strip_reasoning
from common.explorer.engine import SamplingConfig
from common.explorer.rollouts import run_episodes
from common.explorer.workflow import Context
from common.model import build_tiny_tokenizer
from tests.test_agents import QWEN3_TEMPLATE, Scripted

HERE = os.path.join(os.path.dirname(__file__), "templates")

FAMILIES = {  # format: (template, bos, eos, the family's special tokens)
    "hermes": (QWEN3_TEMPLATE, "<|im_start|>", "<|im_end|>", []),
    "llama3_json": ("llama3.1_json.jinja", "<|begin_of_text|>", "<|eot_id|>",
                    ["<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>", "<|eom_id|>"]),
    "mistral": ("mistral_parallel.jinja", "<s>", "</s>",
                ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                 "[/TOOL_RESULTS]"]),
    "qwen3_coder": ("qwen3_coder.jinja", "<|im_start|>", "<|im_end|>", []),
}

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "description": "first"},
                                     "b": {"type": "integer", "description": "second"},
                                     "note": {"type": "string", "description": "a remark"}},
    "required": ["a", "b"]}}}


def family_tokenizer(name):
    template, bos, eos, specials = FAMILIES[name]
    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"bos_token": bos, "eos_token": eos, "additional_special_tokens": specials})
    tok.chat_template = template if "{" in template else open(os.path.join(HERE, template)).read()
    return tok


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_call_rendered_by_the_family_template_parses_back(name):
    tok = family_tokenizer(name)
    assert detect(tok.chat_template) == name
    fmt = tool_format(name)
    renderer = ChatRenderer(tok, keep_tokens=fmt.keep_tokens)
    call = {"name": "add", "arguments": {"a": 2, "b": 40, "note": "12 apples"}}
    user = [{"role": "user", "content": "What is 2 + 40?"}]
    assistant = {"role": "assistant", "content": "", "tool_calls": [{"id": "call00001", "type": "function",
                                                                       "function": call}]}
    prompt = renderer.render(user, add_generation_prompt=True, tools=[ADD])
    full = renderer.render(user + [assistant], tools=[ADD])
    # What the model writes for that message, as its template teaches it: what follows the user's turn and the
    # generation prompt (Mistral's puts the system text into the last user message, so not a plain prefix).
    tail = prompt[prompt.rindex(user[0]["content"]):]
    assert tail in full, (tail, full[-200:])
    turn = full[full.rindex(tail) + len(tail):]
    text = renderer.decode(tok(turn, add_special_tokens=False)["input_ids"])  # as a sampled turn is decoded
    content, calls = fmt.split(strip_reasoning(text), [ADD["function"]])
    assert calls == [call], (turn, text)
    assert content.strip() == ""
    # Plain text is no call; a broken one is a counted error, not a crash.
    assert fmt.split("The answer is 42.", [ADD["function"]])[1] is None
    broken = {"hermes": "<tool_call>{oops</tool_call>", "llama3_json": '<|python_tag|>{"name": "add", "param',
              "mistral": "[TOOL_CALLS] [{oops", "qwen3_coder": "<tool_call>\n<oops>\n</tool_call>"}[name]
    assert [c.reason for c in fmt.split(broken)[1]] == ["malformed"]


SCRIPTED_CALL = {
    "hermes": '<tool_call>\n{"name": "calculate", "arguments": {"expression": "6*7"}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "calculate", "parameters": {"expression": "6*7"}}',
    "mistral": '[TOOL_CALLS] [{"name": "calculate", "arguments": {"expression": "6*7"}, "id": "abcdefghi"}]',
    "qwen3_coder": "<tool_call>\n<function=calculate>\n<parameter=expression>\n6*7\n</parameter>\n</function>\n"
                   "</tool_call>",
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_an_episode_in_each_format_runs_its_tool_with_openai_shaped_messages(name):
    tok = family_tokenizer(name)
    ctx = Context(tok, max_new_tokens=200, max_turns=3, episode_token_budget=8000)  # --tool-call-format auto
    assert ctx.tool_format_name == name
    task = {"id": "c", "env": "calculator", "prompt": "6*7?", "answer": "42", "reward": "math"}
    groups, _ = run_episodes(Scripted(tok, [SCRIPTED_CALL[name], "Answer: 42"]), ctx, [task], SamplingConfig(n=1))
    e = groups[0].responses[0]
    assert e.end_reason == "done" and e.tool_calls == 1 and not e.tool_errors and e.final_text == "Answer: 42"
    asked = next(m for m in e.messages if m.get("tool_calls"))
    (answer,) = [m for m in e.messages if m["role"] == "tool"]
    assert asked["tool_calls"][0]["function"] == {"name": "calculate", "arguments": {"expression": "6*7"}}
    assert answer == {"role": "tool", "content": "42", "tool_call_id": asked["tool_calls"][0]["id"],
                      "name": "calculate"}
    # token-in/token-out: the sampled ids are in the sequence as sampled, the result as the template renders it
    sampled = tok(SCRIPTED_CALL[name], add_special_tokens=False)["input_ids"]
    assert e.response_ids[:len(sampled)] == sampled and "42" in tok.decode(e.response_ids[len(sampled):])


def test_every_format_is_in_the_config_choices():
    import typing

    from common.config import CommonArgs

    choices = typing.get_args(typing.get_type_hints(CommonArgs)["tool_call_format"])
    assert set(choices) == {"auto", *FORMATS}
