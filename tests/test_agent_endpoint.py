"""Agents trained through the explorer's OpenAI-compatible endpoint (common/explorer/endpoint.py, agent.py), with the
real `openai` client against the real endpoint on localhost: bad requests each get a clear OpenAI-shaped error and
the episode goes on; an episode's key dies with it; the token ids a sample trains are exactly those the engine was
fed and sampled, a continued call's observation masked, a rewritten context a second sample of the same episode;
tool calls come back OpenAI-shaped and the example agent's tool loop continues one sample, streamed too; a client
that hangs up costs its own reply; a raising, hanging or misbehaving agent ends its own episode, failed; the three
example agents of examples/agents/ (the plain openai client, the OpenAI Agents SDK, LangGraph + langchain-openai)
each run their tool loop as one sample and train end to end; `--agent-cmd` runs a program per episode the same way,
and a crashing, hung or mute program ends its own episode (the hung one killed with what it started)."""

import asyncio
import functools
import json
import sys
import time
import urllib.request

import aiohttp
import openai
import pytest

from common.cli import parse_args
from common.explorer import agent as agent_module
from common.explorer.endpoint import MAX_N
from common.explorer.engine import HFEngine, SamplingConfig
from common.explorer.rollouts import run_episodes
from common.explorer.workflow import Context
from common.knobs import ConfigError
from common.model import build_tiny_model, build_tiny_tokenizer
from tests.conftest import TINY, assert_trained, run_in_process
from tests.test_agents import Scripted

HERE = "tests/test_agent_endpoint.py"
# The same calculator agent on each client library: each request the library sends must pass the endpoint's checks.
EXAMPLES = ["examples/agents/openai_calculator.py", "examples/agents/agents_sdk_calculator.py",
            "examples/agents/langgraph_calculator.py"]
# ... and on libraries that requirements-test.txt adds: each is skipped, saying so, where it is not installed yet
MORE_EXAMPLES = {"examples/agents/pydantic_ai_calculator.py": "pydantic_ai",
                 "examples/agents/smolagents_calculator.py": "smolagents"}
CMD = f"{sys.executable} examples/agents/cmd_calculator.py"  # the openai_calculator agent as a program


@pytest.fixture(scope="module")
def tiny():
    tok = build_tiny_tokenizer()
    return tok, build_tiny_model(tok)


class Recording(HFEngine):
    """The real HF engine, keeping every prompt it was fed and what it sampled for it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = []

    def generate(self, prompts, sampling, **kwargs):
        out = super().generate(prompts, sampling, **kwargs)
        self.calls += [(list(p), g[0]) for p, g in zip(prompts, out)]
        return out


def episodes(engine, tok, agent: str, tasks: list[dict], n: int = 1, **limits):
    ctx = Context(tok, max_new_tokens=8, episode_token_budget=limits.pop("budget", 512), agent=f"{HERE}:{agent}",
                  agent_timeout_s=limits.pop("timeout", 60), **limits)
    groups, _ = run_episodes(engine, ctx, tasks, SamplingConfig(max_new_tokens=8, n=n))
    return groups


async def _status(coro) -> tuple[int, dict]:
    try:
        await coro
        return 200, {}
    except openai.APIStatusError as e:
        return e.status_code, e.body


async def bad_requests(task, base_url, api_key):
    """Sends one bad request of each kind, logs (status, error body), then makes one good call."""
    log = task["log"]
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    hi = [{"role": "user", "content": "hi"}]
    create = client.chat.completions.create
    log.append(("n", *await _status(create(model="m", messages=hi, n=MAX_N + 1))))
    log.append(("temperature", *await _status(create(model="m", messages=hi, temperature="hot"))))
    log.append(("unknown", *await _status(create(model="m", messages=hi, extra_body={"foo": 1}))))
    log.append(("content", *await _status(create(model="m", messages=[{"role": "user", "content": 5}]))))
    log.append(("max_tokens", *await _status(create(model="m", messages=hi, max_tokens="x"))))
    log.append(("stream_options", *await _status(create(model="m", messages=hi,
                                                        extra_body={"stream_options": {"include_usage": True}}))))
    log.append(("long", *await _status(create(model="m", messages=[{"role": "user", "content": "x " * 600}]))))
    # megabytes are refused by their length, before they are tokenized
    log.append(("huge", *await _status(create(model="m", messages=[{"role": "user", "content": "x" * (5 << 20)}]))))
    stranger = openai.AsyncOpenAI(base_url=base_url, api_key="tandem-guessed", max_retries=0)
    log.append(("key", *await _status(stranger.chat.completions.create(model="m", messages=hi))))
    raw = {"json": b'{"model": "m", "messages": [', "list": b"[1, 2]",
           "messages": json.dumps({"model": "m", "messages": {"role": "user"}}).encode(),
           "messages[0].role": json.dumps({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}).encode(),
           "tools[0]": json.dumps({"model": "m", "messages": hi, "tools": [{"type": "x"}]}).encode(),
           "tool_choice": json.dumps({"model": "m", "messages": hi, "tool_choice": "required"}).encode(),
           "messages[1].tool_calls[0].function.arguments": json.dumps({"model": "m", "messages": hi + [
               {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                     "function": {"name": "f", "arguments": "{oops"}}]}]}).encode(),
           "deep": b'{"model": "m", "messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
           "nested": json.dumps({"model": "m", "messages": hi, "tools": [{"type": "function", "function": {
               "name": "f", "parameters": functools.reduce(lambda d, _: {"a": d}, range(100), {})}}]}).encode(),
           "body": b" " * (17 << 20)}
    async with aiohttp.ClientSession() as http:
        for name, data in raw.items():
            async with http.post(f"{base_url}/chat/completions", data=data,
                                 headers={"Authorization": f"Bearer {api_key}"}) as r:
                log.append((name, r.status, await r.json()))
        async with http.post(f"{base_url}/embeddings", json={}, headers={"Authorization": f"Bearer {api_key}"}) as r:
            log.append(("route", r.status, await r.json()))
    models = await client.models.list()
    reply = await create(model="m", messages=hi, max_tokens=3)
    log.append(("good", reply.choices[0].finish_reason, reply.usage.completion_tokens, [m.id for m in models.data]))
    log.append(("my key", base_url, api_key))
    return 1.0


def test_bad_requests_get_openai_shaped_errors_naming_the_field_and_the_episode_goes_on(tiny):
    tok, model = tiny
    log = []
    groups = episodes(HFEngine(model, tok), tok, "bad_requests", [{"id": "b", "prompt": "hi", "log": log}],
                      temperature=1.0)
    got = {entry[0]: entry[1:] for entry in log}
    for name, param in [("n", "n"), ("temperature", "temperature"), ("unknown", "foo"),
                        ("content", "messages[0].content"), ("max_tokens", "max_tokens"),
                        ("stream_options", "stream_options"), ("long", "messages"), ("huge", "messages")]:
        status, body = got[name]
        assert status == 400 and body["param"] == param, (name, status, body)
        assert body["message"] and "Traceback" not in body["message"]
    assert "512" in got["long"][1]["message"] and got["long"][1]["code"] == "context_length_exceeded"
    assert "characters" in got["huge"][1]["message"] and got["huge"][1]["code"] == "context_length_exceeded"
    for name, status in [("deep", 400), ("nested", 400), ("body", 413), ("route", 404)]:
        assert got[name][0] == status and got[name][1]["error"]["message"], (name, got[name])
    assert "POST /v1/responses" in got["route"][1]["error"]["message"]  # the 404 names the served routes
    assert got["key"][0] == 401 and got["key"][1]["code"] == "invalid_api_key"
    assert got["json"][0] == 400 and "JSON" in got["json"][1]["error"]["message"]
    assert got["list"][0] == 400 and "JSON object" in got["list"][1]["error"]["message"]
    for param in ("messages", "messages[0].role", "tools[0]", "tool_choice",
                  "messages[1].tool_calls[0].function.arguments"):
        assert got[param][0] == 400 and got[param][1]["error"]["param"] == param, got[param]
    finish, completion_tokens, model_ids = got["good"]
    assert finish in ("stop", "length") and 1 <= completion_tokens <= 3 and model_ids == ["policy"]
    (sample,) = groups[0].responses  # the bad calls made no sample; the good one did
    assert sample.episode.end_reason == "done" and sample.episode.calls == 1 and len(sample.response_ids) <= 3
    base_url, key = got["my key"]
    request = urllib.request.Request(f"{base_url}/models", headers={"Authorization": f"Bearer {key}"})
    with pytest.raises(urllib.error.HTTPError) as ended:  # the episode is over: its key is refused
        urllib.request.urlopen(request, timeout=30)
    assert ended.value.code == 401 and json.load(ended.value)["error"]["code"] == "invalid_api_key"


async def overriding(task, base_url, api_key):
    """Asks for other sampling than the run's in every field the API has, with n=2 and logprobs; then a small
    max_tokens, which is honoured."""
    from examples.agents.openai_calculator import TOOLS

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, temperature=1.0, top_p=0.9,
        max_tokens=500, seed=7, n=2, logprobs=True, top_logprobs=3, tool_choice="required", presence_penalty=0.5,
        response_format={"type": "json_object"}, parallel_tool_calls=False)
    short = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "more"}],
                                                 max_tokens=2)
    task["log"] += [raw.headers["x-sampling-overrides"], raw.parse(), short]
    return 1.0


def test_sampling_a_request_asks_for_is_served_with_the_runs_and_the_reply_says_so(tiny, monkeypatch, capsys):
    tok, model = tiny
    monkeypatch.setattr(agent_module, "_SAID", {})  # this process's once-only lines, afresh
    engine, log = Recording(model, tok), []
    groups = episodes(engine, tok, "overriding", [{"id": "o", "prompt": "hi", "log": log}], temperature=0.5)
    header, reply, short = log
    asked = {"temperature": (1.0, 0.5), "top_p": (0.9, 1.0), "max_tokens": (500, 8), "seed": (7, None),
             "top_logprobs": (3, 0), "tool_choice": ("required", "auto"), "presence_penalty": (0.5, 0),
             "response_format": ({"type": "json_object"}, {"type": "text"}), "parallel_tool_calls": (False, True)}
    assert set(header.split(",")) == set(asked)
    assert {k: (v["requested"], v["applied"]) for k, v in reply.sampling_overrides.items()} == asked
    a, b, c = groups[0].responses  # the two choices of the first call, then the short call: three samples
    episode = a.episode
    assert episode.end_reason == "done" and episode.calls == 2 and len(reply.choices) == 2
    for choice, sample in zip(reply.choices, (a, b)):  # the log-probs returned are the behaviour log-probs
        assert [t.logprob for t in choice.logprobs.content] == sample.logprobs and sample.prompt_ids == a.prompt_ids
        assert choice.message.content == tok.decode(sample.response_ids, skip_special_tokens=True)
        assert len(sample.response_ids) <= 8  # the run's --max-new-tokens
    assert [len(p) for p, _ in engine.calls[:2]] == [len(a.prompt_ids)] * 2
    counts = a.counts()
    assert all(counts[f"rollout/agent_override/{k}"] == 1 for k in asked)
    assert short.usage.completion_tokens <= 2 and not getattr(short, "sampling_overrides", None)
    # a reply cut at its token limit is recorded as truncated: --mask-truncated and rollout/truncated_frac see it
    assert c.finish_reason == ("length" if short.choices[0].finish_reason == "length" else "stop")
    printed = capsys.readouterr().err
    assert printed.count("served with the run's") == len(asked)  # one line per field, the first time
    assert "temperature=1.0: served with the run's 0.5" in printed


async def responding(task, base_url, api_key):
    """The Responses API: a tool call, its output by previous_response_id, the whole conversation again as an input
    list (as the Agents SDK sends it), then the same streamed."""
    from examples.agents.openai_calculator import TOOLS, calculate

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    common = {"model": "m", "instructions": "Use the tool.", "tools": tools}
    first = await client.responses.create(input=task["prompt"], temperature=1.0, **common)
    (call,) = [item for item in first.output if item.type == "function_call"]
    output = {"type": "function_call_output", "call_id": call.call_id,
              "output": calculate(json.loads(call.arguments)["expression"])}
    second = await client.responses.create(previous_response_id=first.id, input=[output], **common)
    history = [{"role": "user", "content": task["prompt"]}, *[i.model_dump() for i in first.output], output,
               *[i.model_dump() for i in second.output], {"role": "user", "content": "Sure?"}]
    third = await client.responses.create(input=history, **common)
    events = [e async for e in await client.responses.create(input=history + [
        *[i.model_dump() for i in third.output], {"role": "user", "content": "Really?"}], stream=True, **common)]
    task["log"] += [first, second, third, events]
    return events[-1].response.output_text


def test_the_responses_api_serves_tools_and_both_kinds_of_multi_turn_as_one_sample(tiny):
    tok, _ = tiny
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "(2+3)*4"}}</tool_call>'
    log = []
    ctx = Context(tok, max_new_tokens=128, episode_token_budget=4096, agent=f"{HERE}:responding", temperature=0.5)
    groups, _ = run_episodes(Scripted(tok, ["Let me see. " + call, "The answer is 20", "Yes", "Yes, 20"]), ctx,
                             [{"id": "r", "prompt": "(2+3)*4?", "log": log}], SamplingConfig(max_new_tokens=128))
    (sample,) = groups[0].responses
    episode = sample.episode
    assert episode.end_reason == "done" and episode.result == "Yes, 20", episode.error
    first, second, third, events = log
    assert [i.type for i in first.output] == ["message", "function_call"] and first.output[1].name == "calculate"
    assert first.output_text == "Let me see." and first.sampling_overrides["temperature"]["applied"] == 0.5
    assert second.output_text == "The answer is 20" and second.usage.input_tokens > first.usage.input_tokens
    assert third.output_text == "Yes" and events[0].type == "response.created"
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "Yes, 20"
    assert sample.turns == 4 and episode.calls == 4  # previous_response_id and input lists both continued it
    observations = tok.decode([t for t, m in zip(sample.response_ids, sample.mask) if not m])
    assert "20" in observations and "Sure?" in observations and "Really?" in observations
    assert "Use the tool." in tok.decode(sample.prompt_ids)


async def rewriting(task, base_url, api_key):
    """Two calls that continue one conversation, then one whose context is rewritten (a summary)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count: 1 2"}]
    first = (await client.chat.completions.create(model="m", messages=messages)).choices[0].message
    messages += [first.model_dump(exclude_none=True), {"role": "user", "content": "and 3?"}]
    second = (await client.chat.completions.create(model="m", messages=messages)).choices[0].message
    task["log"] += [first.content, second.content]
    summary = [{"role": "user", "content": f"Summary: {second.content[:5]}. Go on."}]
    third = (await client.chat.completions.create(model="m", messages=summary)).choices[0].message
    task["log"].append(third.content)
    return third.content


def test_trained_ids_are_the_ids_fed_and_sampled_and_a_rewritten_context_is_a_second_sample(tiny):
    tok, model = tiny
    engine, log = Recording(model, tok), []
    groups = episodes(engine, tok, "rewriting", [{"id": "r", "prompt": "x", "log": log}])
    samples = groups[0].responses
    assert len(samples) == 2 and samples[0].episode is samples[1].episode
    assert samples[0].episode.end_reason == "done" and samples[0].episode.calls == 3
    (p1, g1), (p2, g2), (p3, g3) = engine.calls
    a, b = samples
    # sample a: call 1's prompt | its sampled ids | the new user turn's ids (masked) | call 2's sampled ids
    assert a.prompt_ids == p1 and p2[:len(p1) + len(g1.response_ids)] == p1 + g1.response_ids
    observation = p2[len(p1) + len(g1.response_ids):]
    assert observation and a.response_ids == g1.response_ids + observation + g2.response_ids
    assert a.mask == [1] * len(g1.response_ids) + [0] * len(observation) + [1] * len(g2.response_ids)
    assert a.logprobs == g1.logprobs + [0.0] * len(observation) + g2.logprobs
    assert "and 3?" in tok.decode(observation)
    # sample b: the rewritten context, fed as rendered, its own sampled ids
    assert b.prompt_ids == p3 and b.response_ids == g3.response_ids and b.mask == [1] * len(g3.response_ids)
    # what the agent read is the text of the sampled ids (special tokens left out)
    assert log == [tok.decode(g.response_ids, skip_special_tokens=True) for g in (g1, g2, g3)]


async def completing(task, base_url, api_key):
    """/v1/completions: a text prompt, then its ids as returned plus new ids (continues the sample), a streamed call
    extending that, then a prompt that does not extend it (a second sample); bad prompts on the way."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    create, ids = client.completions.create, {"return_token_ids": True}
    first = (await create(model="m", prompt="Count: 1 2", extra_body=ids)).choices[0]
    more = task["more"]
    second = (await create(model="m", prompt=first.prompt_token_ids + first.token_ids + more,
                           extra_body=ids)).choices[0]
    parts = [c async for c in await create(model="m", prompt=second.prompt_token_ids + second.token_ids + more,
                                           stream=True, extra_body=ids)]
    streamed = parts[0].choices[0]
    task["log"] += [first.text, second.text, streamed.text, first.prompt_token_ids, first.token_ids,
                    second.token_ids, streamed.token_ids, parts[-1].choices[0].finish_reason]
    for name, call in [("vocab", create(model="m", prompt=[10 ** 9])),
                       ("empty", create(model="m", prompt=[])),
                       ("batch", create(model="m", prompt=["a", "b"])),
                       ("echo", create(model="m", prompt="a", echo=True)),
                       ("chat field", create(model="m", prompt="a", extra_body={"tools": []}))]:
        task["log"].append((name, *await _status(call)))
    other = (await create(model="m", prompt="Summary: go on.")).choices[0]
    return other.text


def test_completions_take_ids_or_text_continue_a_sample_exactly_and_refuse_bad_prompts(tiny):
    tok, model = tiny
    engine, log = Recording(model, tok), []
    more = tok.encode(" and 3?", add_special_tokens=False)
    groups = episodes(engine, tok, "completing", [{"id": "c", "prompt": "x", "log": log, "more": more}])
    a, b = groups[0].responses
    (p1, g1), (p2, g2), (p3, g3), (p4, g4) = engine.calls
    assert a.episode is b.episode and a.episode.end_reason == "done" and a.episode.calls == 4
    assert p1 == tok.encode("Count: 1 2", add_special_tokens=False) == a.prompt_ids
    assert p2 == p1 + g1.response_ids + more and p3 == p2 + g2.response_ids + more
    assert a.response_ids == g1.response_ids + more + g2.response_ids + more + g3.response_ids
    assert a.mask == [1] * len(g1.response_ids) + [0] * len(more) + [1] * len(g2.response_ids) + \
        [0] * len(more) + [1] * len(g3.response_ids)
    assert b.prompt_ids == p4 == tok.encode("Summary: go on.", add_special_tokens=False)
    texts, (ids1, out1, out2, out3, finish), errors = log[:3], log[3:8], {e[0]: e[1:] for e in log[8:]}
    assert ids1 == p1 and [out1, out2, out3] == [g.response_ids for g in (g1, g2, g3)]
    assert texts == [tok.decode(g.response_ids, skip_special_tokens=True) for g in (g1, g2, g3)]
    assert finish in ("stop", "length")
    for name, param in [("vocab", "prompt"), ("empty", "prompt"), ("batch", "prompt"), ("echo", "echo"),
                        ("chat field", "tools")]:
        status, body = errors[name]
        assert status == 400 and body["param"] == param, (name, status, body)


@pytest.mark.parametrize("agent", [{"agent": f"{e}:agent"} for e in [*EXAMPLES, *MORE_EXAMPLES]]
                         + [{"agent_cmd": CMD}], ids=[*EXAMPLES, *MORE_EXAMPLES, "agent_cmd"])
def test_tool_calls_come_back_openai_shaped_and_the_example_agents_tool_loop_continues_one_sample(tiny, agent):
    tok, _ = tiny
    library = MORE_EXAMPLES.get(agent.get("agent", "").removesuffix(":agent"))
    if library:
        pytest.importorskip(library, reason=f"{library} is not installed (make install-test)")
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "(2+3)*4"}}</tool_call>'
    answer = "The answer is 20"
    if library == "smolagents":  # it answers by calling its final_answer tool
        answer = '<tool_call>{"name": "final_answer", "arguments": {"answer": "The answer is 20"}}</tool_call>'
    engine = Scripted(tok, [call, answer])
    # smolagents' system prompt is ~3,400 characters, and the tiny tokenizer spends a token on each
    ctx = Context(tok, max_new_tokens=128, episode_token_budget=16384 if library == "smolagents" else 4096, **agent)
    groups, _ = run_episodes(engine, ctx, [{"id": "c", "prompt": "(2+3)*4?", "answer": "20", "reward": "math"}],
                             SamplingConfig(max_new_tokens=128))
    sample = groups[0].responses[0]
    assert sample.episode.end_reason == "done" and sample.episode.result == "The answer is 20", sample.episode.error
    if library == "smolagents":  # its own message format each step: a rewritten context, a new sample per call
        assert len(groups[0].responses) == sample.episode.calls == 2
        return
    assert len(groups[0].responses) == 1
    assert sample.turns == 2 and sample.episode.calls == 2, sample.episode.error
    observation = tok.decode([t for t, m in zip(sample.response_ids, sample.mask) if not m])
    assert observation == "\n<|im_start|>tool\n20<|im_end|>\n<|im_start|>assistant\n"  # the tool's result, masked
    assert sample.reward(None, "sum").score == 0.0  # an answer is the verifier's to score
    # a call of a tool that does not exist is the policy's doing, an answer (scored 0 or not), never a failure
    made_up = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    groups, _ = run_episodes(Scripted(tok, [made_up, "The answer is 20"]), ctx, [{"id": "m", "prompt": "1+1?"}],
                             SamplingConfig(max_new_tokens=128))
    episode = groups[0].responses[0].episode
    assert episode.end_reason == "done", episode.error
    assert episode.calls == 1  # not offered in `tools`: it came back as text, as the API never calls such a function


async def streaming(task, base_url, api_key):
    """The example agent's tool loop over stream=True: the tool calls and the answer rebuilt from the chunks."""
    from examples.agents.openai_calculator import TOOLS, calculate

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(2):
        text, calls, usage = "", {}, None
        async for chunk in await client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                                                stream=True, stream_options={"include_usage": True}):
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                for c in choice.delta.tool_calls or []:
                    calls.setdefault(c.index, {"id": c.id, "type": "function",
                                               "function": {"name": c.function.name, "arguments": ""}})
                    calls[c.index]["function"]["arguments"] += c.function.arguments or ""
        task["log"].append(usage.completion_tokens)
        if not calls:
            return text
        messages.append({"role": "assistant", "content": text or None, "tool_calls": list(calls.values())})
        messages += [{"role": "tool", "tool_call_id": c["id"],
                      "content": calculate(json.loads(c["function"]["arguments"])["expression"])}
                     for c in calls.values()]
    return ""


async def hanging_up(task, base_url, api_key):
    """A client that goes away before its streamed reply is read, then a call that is answered."""
    hi = [{"role": "user", "content": "hi"}]
    async with aiohttp.ClientSession() as http:
        r = await http.post(f"{base_url}/chat/completions", json={"model": "m", "messages": hi, "stream": True},
                            headers={"Authorization": f"Bearer {api_key}"})
        r.close()  # drops the connection without reading the stream
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = await client.chat.completions.create(model="m", messages=hi + [{"role": "user", "content": "again"}])
    return reply.choices[0].message.content


def test_streamed_replies_carry_the_same_tool_calls_and_a_client_that_hangs_up_costs_its_own_reply(tiny):
    tok, model = tiny
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "6*7"}}</tool_call>'
    log = []
    ctx = Context(tok, max_new_tokens=128, episode_token_budget=4096, agent=f"{HERE}:streaming")
    groups, _ = run_episodes(Scripted(tok, [call, "It is 42"]), ctx, [{"id": "s", "prompt": "6*7?", "log": log}],
                             SamplingConfig(max_new_tokens=128))
    (sample,) = groups[0].responses
    assert sample.episode.end_reason == "done" and sample.episode.result == "It is 42", sample.episode.error
    assert sample.turns == 2 and log == [len(tok(call)["input_ids"]) + 1, len(tok("It is 42")["input_ids"]) + 1]
    groups = episodes(HFEngine(model, tok), tok, "hanging_up", [{"id": "h", "prompt": "hi"}])
    episode = groups[0].responses[0].episode
    assert episode.end_reason == "done" and episode.calls == 2, episode.error


async def stopping(task, base_url, api_key):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}],
                                                 stop=["STOP", "never"])
    task["log"].append((reply.choices[0].message.content, reply.choices[0].finish_reason))
    return 1.0


def test_a_stop_string_ends_the_reply_and_the_sample_keeps_exactly_the_ids_sampled_up_to_it(tiny):
    tok, _ = tiny
    log = []
    ctx = Context(tok, max_new_tokens=64, episode_token_budget=1024, agent=f"{HERE}:stopping")
    groups, _ = run_episodes(Scripted(tok, ["abc STOP def"]), ctx, [{"id": "s", "prompt": "go", "log": log}],
                             SamplingConfig(max_new_tokens=64))
    (sample,) = groups[0].responses
    assert log == [("abc ", "stop")]
    assert sample.response_ids == tok("abc STOP", add_special_tokens=False)["input_ids"] and sum(sample.mask) == 8


async def greedy(task, base_url, api_key):
    """Calls until the endpoint refuses, each call a fresh context."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    for i in range(10):
        status, body = await _status(client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"call {i}"}]))
        if status != 200:
            task["log"].append((i, status, body["code"]))
            return "gave up"
    return "never refused"


def test_a_call_beyond_agent_max_calls_is_refused_and_the_episode_is_marked_cut(tiny):
    tok, model = tiny
    log = []
    groups = episodes(HFEngine(model, tok), tok, "greedy", [{"id": "g", "prompt": "hi", "log": log}],
                      agent_max_calls=2)
    assert log == [(2, 400, "episode_call_limit")]
    samples = groups[0].responses
    assert len(samples) == 2 and all(s.finish_reason == "length" for s in samples)  # cut: --mask-truncated sees it
    assert samples[0].counts()["rollout/agent_cut/max_calls"] == 1 and samples[0].episode.result == "gave up"


async def raising(task, base_url, api_key):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("agent bug")


async def hanging(task, base_url, api_key):
    await asyncio.sleep(3600)


def blocking(task, base_url, api_key):
    async def run():
        import time
        time.sleep(30)  # blocking code in an async agent: its thread is abandoned at the limit
    return run()


async def lying(task, base_url, api_key):
    return float("nan")


@pytest.mark.parametrize("agent,reason", [("raising", "error"), ("hanging", "timeout"), ("blocking", "timeout"),
                                          ("lying", "bad_return")])
def test_a_broken_agent_ends_its_own_episode_failed_and_never_pays(tiny, agent, reason):
    tok, model = tiny
    # Only the agents that time out run to the limit: the others must end on their own, even on a loaded machine.
    groups = episodes(HFEngine(model, tok), tok, agent, [{"id": "x", "prompt": "hi"}],
                      timeout=1.0 if reason == "timeout" else 60.0)
    (sample,) = groups[0].responses  # raising: its one call; the others: an empty sample that trains nothing
    assert sample.episode.end_reason == reason, sample.episode.error
    assert bool(sample.response_ids) == (agent == "raising") and sum(sample.mask) == len(sample.response_ids)
    reward = sample.reward(None, "sum")
    assert reward.score == 0.0 and reward.info["failed"] and reward.info["failed_reason"] == reason
    assert sample.counts()[f"rollout/end/{reason}"] == 1


@pytest.mark.parametrize("example,schedule", zip(EXAMPLES, [["train_async.py", "--num-explorers", "2"],
                                                               ["train_offpolicy.py"], ["train_sync.py"]]))
def test_the_example_agent_trains(tmp_path, example, schedule):
    """One short run each, under another schedule (streaming episodes in two explorers, one step off-policy,
    synchronous): the random tiny model writes no tool calls, so the tool loop itself is the scripted test's; this
    is the library inside a real explorer process."""
    out = tmp_path / "run"
    result = run_in_process(schedule[0], *TINY, *schedule[1:], "--steps", "2", "--max-new-tokens", "16",
                            "--agent", f"{example}:agent", "--out-dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = assert_trained(out, steps=2)
    assert rows[0]["rollout/agent_calls"] >= rows[0]["rollout/episodes"] > 0
    assert all(r["rollout/end/done"] == r["rollout/episodes"] for r in rows), rows  # no episode failed


def _ascii_share(text: str) -> float:
    """A reward the random tiny model's replies differ in (so the group advantages carry a signal)."""
    return sum(c.isascii() for c in text) / len(text) if text else 0.0


async def asking_chat(task, base_url, api_key):
    """An agent that sets its own sampling, as framework code does: temperature, max_tokens, tool_choice
    "required", JSON output."""
    from examples.agents.openai_calculator import TOOLS

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = await client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": task["prompt"]}], tools=TOOLS, temperature=1.0,
        max_tokens=24, tool_choice="required", response_format={"type": "json_object"})
    return _ascii_share(reply.choices[0].message.content or "")


async def asking_responses(task, base_url, api_key):
    """The same through client.responses.create."""
    from examples.agents.openai_calculator import TOOLS

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = await client.responses.create(model="gpt-4o", input=task["prompt"], temperature=1.0, max_output_tokens=24,
                                          tools=[{"type": "function", **TOOLS[0]["function"]}], tool_choice="required",
                                          text={"format": {"type": "json_object"}})
    return _ascii_share(reply.output_text)


@pytest.mark.parametrize("agent,schedule", [("asking_chat", "train_sync.py"), ("asking_responses", "train_async.py")])
def test_agents_that_set_their_own_sampling_train_with_the_runs(tmp_path, agent, schedule):
    out = tmp_path / "run"
    result = run_in_process(schedule, *TINY, "--steps", "2", "--max-new-tokens", "16", "--temperature", "0.7",
                            "--agent", f"{HERE}:{agent}", "--out-dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = assert_trained(out, steps=2)
    max_tokens = "max_tokens" if agent == "asking_chat" else "max_output_tokens"
    fields = ["temperature", max_tokens, "tool_choice", "response_format" if agent == "asking_chat" else "text.format"]
    for row in rows:  # every call was served, each of its fields the run's way, and counted
        assert row["rollout/end/done"] == row["rollout/episodes"] == row["rollout/agent_calls"] > 0, row
        assert all(row[f"rollout/agent_override/{f}"] == row["rollout/agent_calls"] for f in fields), row
    assert "temperature=1.0: served with the run's 0.7" in result.stderr
    assert f"{max_tokens}=24: served with the run's 16" in result.stderr


async def failing(task, base_url, api_key):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])
    raise RuntimeError("agent bug: no parser for this reply")


def test_a_run_where_every_episode_fails_says_why_and_stops(tmp_path):
    out = tmp_path / "run"
    result = run_in_process("train_sync.py", *TINY, "--steps", "5", "--max-failed-steps", "2", "--log-samples-every",
                            "1", "--agent", f"{HERE}:failing", "--out-dir", str(out))
    assert result.returncode != 0
    err = result.stderr
    # the first error of its kind, with the end of the agent's traceback
    assert err.count("an agent episode failed (error): RuntimeError: agent bug") == 1, err[-3000:]
    assert 'raise RuntimeError("agent bug: no parser for this reply")' in err
    assert "step 1: every sample failed" in err and "step 2: every sample failed" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error:") and "the last 2 steps" in last and "RuntimeError: agent bug" in last, last
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(rows) == 2 and all(r["rollout/agent_failed/RuntimeError"] == r["rollout/episodes"] for r in rows)
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert samples and all("RuntimeError: agent bug" in s["error"] for s in samples)


def _gone(pid: int, timeout: float = 10) -> bool:
    """The process has ended (a zombie counts: it runs nothing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


PROGRAMS = {  # python -c CODE PIDFILE: (CODE, how its episode ends)
    "crashing": ("import sys; print('agent bug', file=sys.stderr); sys.exit(3)", "error"),
    "hung": ("import os, subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', "
             "'import time; time.sleep(600)']); print(os.getpid(), child.pid, file=open(sys.argv[1], 'w'), "
             "flush=True); time.sleep(600)", "timeout"),
    "mute": ("print('working...'); print(42)", "bad_return"),
    "rewarding": ("import json, os, sys, urllib.request; assert json.load(sys.stdin)['id'] == 'p'; "
                  "call = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions', json.dumps("
                  "{'model': 'm', 'messages': [{'role': 'user', 'content': 'hi'}]}).encode(), {'Authorization': "
                  "'Bearer ' + os.environ['OPENAI_API_KEY'], 'Content-Type': 'application/json'}); "
                  "urllib.request.urlopen(call, timeout=60).read(); print(json.dumps({'reward': 0.5}))", "done"),
    "silent": ("import json; print(json.dumps({'reward': 1.0}))", "no_call"),  # a cache's replay: no call made
}


@pytest.mark.parametrize("program", PROGRAMS)
def test_agent_cmd_reads_the_result_line_and_a_crashing_hung_or_mute_program_ends_its_episode(tiny, tmp_path, program):
    tok, model = tiny
    code, reason = PROGRAMS[program]
    pids = tmp_path / "pids"
    # The hung program has 5 s to start and write its pids (it then sleeps); the others must end on their own.
    ctx = Context(tok, max_new_tokens=8, episode_token_budget=512, agent_timeout_s=5.0 if reason == "timeout" else 60.0,
                  agent_cmd=f"{sys.executable} -c \"{code}\" {pids}")
    groups, _ = run_episodes(HFEngine(model, tok), ctx, [{"id": "p", "prompt": "hi"}], SamplingConfig(max_new_tokens=8))
    (sample,) = groups[0].responses
    episode, reward = sample.episode, sample.reward(None, "sum")
    assert episode.end_reason == reason, episode.error
    if program == "rewarding":
        assert reward.score == 0.5 and not reward.info.get("failed")
        return
    assert reward.score == 0.0 and reward.info["failed_reason"] == reason
    assert {"crashing": "status 3: agent bug", "mute": "got '42'", "silent": "made no call"}.get(program, "agent-timeout-s") in episode.error
    if program == "hung":  # the program and the process it started are killed with the episode
        assert all(_gone(int(pid)) for pid in pids.read_text().split())


def test_agent_cmd_reaches_the_explorer_and_is_checked_before_the_run(tiny):
    from train_sync import Args

    args = parse_args(Args, ["--model", "tiny", "--agent-cmd", CMD])
    assert Context.from_args(tiny[0], args).agent_cmd == CMD
    for argv, error in [(["--agent-cmd", CMD, "--agent", f"{EXAMPLES[0]}:agent"], "give one"),
                        (["--agent-cmd", "no-such-program --x"], "no such program 'no-such-program'"),
                        (["--agent-cmd", "python 'unclosed"], "No closing quotation")]:
        with pytest.raises(ConfigError, match=error):
            parse_args(Args, ["--model", "tiny", *argv])
