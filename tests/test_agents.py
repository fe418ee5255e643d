"""Agents that hold up (common/explorer/multi_turn.py, chat.py, rollouts.py, common/envs/): a thinking-model
template (Qwen3's, built here from its published text) runs episodes past turn 1 token-in/token-out; a strict-role
template (Gemma style) works; template and environment errors end the episode with a counted reason; the reasoning
parser keeps <think> text from the environment; a hostile calculator expression ends within microseconds; the
verifier scores the final answer only (a cut last turn scores 0) and cut episodes are truncated; in-turn tool
calls append the result as masked tokens and go on; turn-level advantages; a slow tool does not slow the other
episodes' decoding (vLLM); grpo_turn and --in-turn-tools each train 2 tiny steps."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common.envs import ENVS, Env, StepResult, env_class, make_env, parse_env_settings
from common.experience import Experience, collate
from common.explorer.chat import ChatRenderer, strip_reasoning
from common.explorer.engine import Generation, HFEngine, RolloutEngine, SamplingConfig
from common.explorer.rollouts import run_episodes
from common.explorer.parts import rollout_metrics
from common.explorer.workflow import Context
from common.model import build_tiny_model, build_tiny_tokenizer
from common.trainer.forward import sequence_logprobs
from common.trainer.losses import turn_group_advantages, turn_returns
from tests.conftest import TINY, assert_trained, run_in_process, run_script


def mask_runs(e) -> list[tuple[int, int, int]]:
    """(start, end, trained) runs of an episode's response: sampled (1) and observation (0) tokens."""
    out, start = [], 0
    for i in range(1, len(e.mask) + 1):
        if i == len(e.mask) or e.mask[i] != e.mask[start]:
            out.append((start, i, e.mask[start]))
            start = i
    return out


# The published Qwen3 chat template (Qwen/Qwen3-8B tokenizer_config.json), as its text: it drops the <think> block
# of every assistant turn before the last user message and adds an empty one to the last assistant turn.
QWEN3_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n{%- endfor %}\n{%- for message in messages %}\n    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n    {%- else %}\n        {%- set content = '' %}\n"
    "    {%- endif %}\n    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') %}\n                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n        {%- endif %}\n        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}\n            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n            {%- endif %}\n"
    "        {%- else %}\n            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n                    {{- '\\n' }}\n"
    "                {%- endif %}\n                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}"
)

# Gemma 2 style: no system role, strict user/assistant alternation, no tool role (raise_exception otherwise).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}<|im_start|>{{ role + '\\n' + message['content'] | trim }}<|im_end|>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>model\\n{% endif %}"
)


def tiny_with(template: str | None = None):
    tok = build_tiny_tokenizer()
    if template is not None:
        tok.chat_template = template
    return tok


class Scripted(RolloutEngine):
    """A policy that writes what the test scripts, turn by turn (its text tokenised as a model's would be):
    the cases need exact outputs a random model would not write. Log-probs are 0."""

    def __init__(self, tokenizer, turns, stop=True):
        self.tokenizer, self.turns, self.calls, self.stop = tokenizer, turns, 0, stop

    def generate(self, prompts, sampling):
        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = (ids + [self.tokenizer.eos_token_id] if self.stop else ids)[:sampling.max_new_tokens]
        done = "stop" if self.stop and len(ids) < sampling.max_new_tokens + 1 and ids[-1] == self.tokenizer.eos_token_id \
            else "length"
        return [[Generation(list(p), ids, [0.0] * len(ids), done)] for p in prompts]

    def weight_buffers(self):
        return []


def token_exact(model, episodes, pad_id):
    """Behaviour log-probs == the trainer's recomputation over each whole episode sequence."""
    exps = [Experience(prompt_ids=e.prompt_ids, response_ids=e.response_ids, logprobs=e.logprobs,
                       loss_mask=e.loss_mask(), reward=0.0, group_id=0, task_id="t", policy_version=0)
            for e in episodes]
    batch = collate(exps, pad_id)
    with torch.no_grad():
        recomputed = sequence_logprobs(model, batch.input_ids, batch.attention_mask, 1.0, batch.response_mask)
    mask = batch.response_mask.bool()
    return (recomputed[mask] - batch.old_logprobs[mask]).abs().max().item()


def test_qwen3_thinking_template_runs_past_turn_one_token_in_token_out():
    tok = tiny_with(QWEN3_TEMPLATE)
    renderer = ChatRenderer(tok)
    # The point of the test: Qwen3 rewrites an earlier assistant turn once a user message follows it, so the
    # episode's history never re-renders as it was sampled (a diff of two full renders cannot work).
    convo = [{"role": "user", "content": "Guess."}, {"role": "assistant", "content": "<think>hm</think>4"}]
    before = renderer.render(convo)
    after = renderer.render(convo + [{"role": "user", "content": "Higher."}], add_generation_prompt=True)
    assert not after.startswith(before)
    model = build_tiny_model(tok, seed=0).eval()
    engine = HFEngine(model, tok)
    # The random model seldom stops within 10 tokens: its cut turns go on (--truncated-turns continue).
    ctx = Context(tok, max_new_tokens=10, max_turns=3, episode_token_budget=1024, truncated_turns="continue")
    torch.manual_seed(0)
    tasks = [{"id": f"g{i}", "env": "guess_number", "secret": 5 + i, "high": 64} for i in range(2)]
    groups, _ = run_episodes(engine, ctx, tasks, SamplingConfig(temperature=1.0, max_new_tokens=10, n=3))
    episodes = [e for g in groups for e in g.responses]
    assert all(e.end_reason in ("max_turns", "done") for e in episodes), [(e.end_reason, e.error) for e in episodes]
    assert max(e.turns for e in episodes) == 3
    for e in episodes:
        assert e.response_ids[:len(e.mask)] == e.response_ids and len(e.mask) == len(e.logprobs)
        obs = [e.response_ids[a:b] for a, b, m in mask_runs(e) if not m]
        assert all(tok.decode(o).count("<|im_start|>user\n") == 1 for o in obs)  # each observation: one user turn
        assert tok.decode(e.prompt_ids + e.response_ids, skip_special_tokens=False).endswith(tok.decode(
            e.response_ids[mask_runs(e)[-1][0]:], skip_special_tokens=False))
    assert token_exact(model, episodes, tok.pad_token_id) < 1e-4


def test_reasoning_parser_keeps_think_text_from_the_environment_and_the_tool_parser():
    assert strip_reasoning("<think>maybe 3 or <tool_call>x</tool_call></think>\n\n5") == "5"
    assert strip_reasoning("<think>never closed 7") == ""
    assert strip_reasoning("plain 7") == "plain 7"
    tok = tiny_with(QWEN3_TEMPLATE)
    ctx = Context(tok, max_new_tokens=200, max_turns=3, episode_token_budget=4000)
    task = {"id": "g", "env": "guess_number", "secret": 5, "high": 8}
    groups, _ = run_episodes(Scripted(tok, ["<think>is it 5? say 5</think>3", "<think>5</think>5"]), ctx, [task],
                             SamplingConfig(n=1, max_new_tokens=200))
    e = groups[0].responses[0]
    assert e.turns == 2 and e.end_reason == "done" and e.turn_rewards == [0.0, 1.0]  # 3 was the guess, not 5
    calc = make_env("calculator")
    calc.reset({"prompt": "p"})
    assert calc.step(strip_reasoning('<think><tool_call>{"name": "calculate", "arguments": {"expression": "1+1"}}'
                                     '</tool_call></think>Answer: 2')).done


class Boom(Env):
    def reset(self, task):
        if task.get("fail") == "reset":
            raise RuntimeError("reset broke")
        return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go."}]

    def step(self, action):
        raise KeyError("step broke")


def test_strict_role_template_and_errors_end_the_episode_counted(monkeypatch):
    monkeypatch.setitem(ENVS, "boom", "tests.test_agents:Boom")
    tok = tiny_with(GEMMA_TEMPLATE)
    renderer = ChatRenderer(tok)
    assert not renderer.renders_system
    # Calculator: tools in the system text (merged into the first user message), tool results as a user message.
    ctx = Context(tok, max_new_tokens=200, max_turns=3, episode_token_budget=8000)
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "6*7"}}</tool_call>'
    task = {"id": "c", "env": "calculator", "prompt": "6*7?", "answer": "42", "reward": "math"}
    groups, _ = run_episodes(Scripted(tok, [call, "Answer: 42"]), ctx, [task], SamplingConfig(n=1))
    e = groups[0].responses[0]
    assert e.end_reason == "done" and e.turns == 2 and e.tool_calls == 1 and e.final_text == "Answer: 42"
    text = tok.decode(e.prompt_ids + e.response_ids, skip_special_tokens=False)
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>" in text and "system" not in text
    # A template that raises, a reset that raises, a step that raises: that episode ends, counted; the rest run.
    tok.chat_template = "{{ raise_exception('no') }}"
    ctx = Context(tok, max_new_tokens=8, max_turns=2, episode_token_budget=1000)
    with pytest.raises(ValueError):  # a template that renders nothing at all is refused up front
        run_episodes(Scripted(tok, ["x"]), ctx, [{"id": "b", "env": "boom"}], SamplingConfig(n=1))
    tok.chat_template = GEMMA_TEMPLATE.replace("{% for message in messages %}", "{% for message in messages %}{% if "
                                               "message['content'] == 'Higher.' %}{{ raise_exception('no hints') }}"
                                               "{% endif %}")
    ctx = Context(tok, max_new_tokens=8, max_turns=3, episode_token_budget=1000)
    tasks = [{"id": "b1", "env": "boom", "fail": "reset"}, {"id": "b2", "env": "boom"},
             {"id": "g", "env": "guess_number", "secret": 3, "high": 8}]
    groups, _ = run_episodes(Scripted(tok, ["1", "2"]), ctx, tasks, SamplingConfig(n=1))
    flat = [(g, e) for g in groups for e in g.responses]
    ends = {g.task["id"]: e.end_reason for g, e in flat}
    assert ends == {"b1": "error", "b2": "error", "g": "template"}, ends
    metrics = rollout_metrics(flat)
    assert metrics["rollout/end/error"] == 2 and metrics["rollout/end/template"] == 1
    assert [e.response_ids for g, e in flat if g.task["id"] == "b1"] == [[]]


def test_hostile_calculator_expressions_end_within_the_timeout():
    env = make_env("calculator", parse_env_settings(["calculator.tool_timeout_s=0.5"]))
    env.reset({"prompt": "p"})
    for expression in ["((((9**64)**64)**64)**64)", "9**9**9**9", "(10**4000)*(10**4000)", "2**(2**62)",
                       "1" * 5000, "(" * 300 + "1" + ")" * 300, "-" * 999 + "1"]:
        out = env.step(f'<tool_call>{{"name": "calculate", "arguments": {{"expression": "{expression}"}}}}'
                       f'</tool_call>')
        # refused before computing ("exception"), not cut by the tool timeout ("timeout")
        assert out.info["tool_errors"] == ["exception"] and "error:" in out.messages[0]["content"], expression
    assert env.step('<tool_call>{"name": "calculate", "arguments": {"expression": "2**100"}}</tool_call>'
                    ).messages[0]["content"] == str(2 ** 100)
    # The calls of one turn run in parallel: each of two 1 s sandboxed programs starts before the other ends.
    env.settings.tool_timeout_s = 10
    code = "import time; start = time.time(); time.sleep(1); print(start, time.time())"
    out = env.step(f'<tool_call>{{"name": "python", "arguments": {{"code": "{code}"}}}}</tool_call>' * 2)
    (start_a, end_a), (start_b, end_b) = ([float(x) for x in m["content"].split()] for m in out.messages)
    assert start_a < end_b and start_b < end_a, out.messages


def test_the_final_answer_is_scored_and_cut_episodes_are_truncated():
    from rewards import score

    tok = tiny_with()
    task = {"id": "c", "env": "calculator", "prompt": "3+4?", "answer": "7", "reward": "math"}
    early = 'Answer: 7 <tool_call>{"name": "calculate", "arguments": {"expression": "3+4"}}</tool_call>'
    # Turn 2 is cut by the episode budget: there is no final answer, so the verifier scores "" (0), not turn 1.
    ctx = Context(tok, max_new_tokens=300, max_turns=4, episode_token_budget=1000)
    groups, _ = run_episodes(Scripted(tok, [early, "x" * 2000]), ctx, [task], SamplingConfig(n=1, max_new_tokens=300))
    e = groups[0].responses[0]
    assert e.end_reason == "budget" and e.finish_reason == "length" and e.final_text == ""
    assert score(e.verifier_input(task, tok), task).score == 0.0
    # Max turns: a legitimate end, not a cut (--mask-truncated must not mask every episode that ran out of turns).
    ctx = Context(tok, max_new_tokens=300, max_turns=2, episode_token_budget=4000)
    groups, _ = run_episodes(Scripted(tok, [early]), ctx, [task], SamplingConfig(n=1, max_new_tokens=300))
    e = groups[0].responses[0]
    assert e.end_reason == "max_turns" and e.finish_reason == "stop" and e.final_text == ""
    # A right final answer after a tool call is scored; the length counted is the sampled tokens only.
    groups, _ = run_episodes(Scripted(tok, [early, "It is 7. Answer: 7"]), ctx, [task],
                             SamplingConfig(n=1, max_new_tokens=300))
    e = groups[0].responses[0]
    assert e.final_text == "It is 7. Answer: 7" and score(e.verifier_input(task, tok), task).score == 1.0
    assert e.sampled_tokens == sum(e.mask) < len(e.response_ids)


class Rigged(Env):
    """Pays 0.5 for a first answer and goes on; raises when the reply says "crash" (a policy that found how to
    break it), ends on anything else."""

    def reset(self, task):
        self.turn = 0
        return [{"role": "user", "content": "What is 3+4?"}]

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return StepResult([{"role": "user", "content": "Sure?"}], 0.5, False, {"format_ok": True})
        if "crash" in action:
            raise RuntimeError("the environment broke")
        return StepResult([], 0.0, True, {"format_ok": True})


def scored(groups, tok):
    """(episode, Reward, Experience) of every episode, scored as the explorer does (verifier in-process)."""
    from rewards import score

    out = []
    for g in groups:
        for e in g.responses:
            text = e.verifier_input(g.task, tok)
            reward = e.reward(score(text, g.task) if text is not None else None, "sum")
            out.append((e, reward, Experience(prompt_ids=e.prompt_ids, response_ids=e.response_ids,
                                              logprobs=e.logprobs, loss_mask=e.loss_mask(), reward=reward.score,
                                              group_id=0, task_id="t", policy_version=0,
                                              reward_info=reward.info, finish_reason=e.finish_reason)))
    return out


def test_an_environment_error_after_a_winning_looking_turn_pays_no_more_than_a_loss(monkeypatch):
    """Turn 1 writes the right answer (the verifier would pay 1) and earns a step reward; turn 2 makes the
    environment raise. That episode must score no more than one that goes on to lose, be marked failed, and be
    dropped under --drop-failed-rewards, counted by reason."""
    from types import SimpleNamespace

    from common.trainer.filters import drop_invalid_rewards

    monkeypatch.setitem(ENVS, "rigged", "tests.test_agents:Rigged")
    tok = tiny_with()
    ctx = Context(tok, max_new_tokens=50, max_turns=4, episode_token_budget=2000)
    task = {"id": "r", "env": "rigged", "answer": "7", "reward": "math"}
    (crash, r_crash, x_crash), = scored(run_episodes(Scripted(tok, ["Answer: 7", "crash"]), ctx, [task],
                                                     SamplingConfig(n=1))[0], tok)
    (loss, r_loss, x_loss), = scored(run_episodes(Scripted(tok, ["Answer: 7", "Answer: 3"]), ctx, [task],
                                                  SamplingConfig(n=1))[0], tok)
    assert r_crash.score <= r_loss.score and r_crash.score == Rigged.worst_reward, (r_crash, r_loss)
    assert crash.end_reason == "error" and crash.failed and crash.final_text == "" and loss.end_reason == "done"
    assert r_crash.info["failed"] and r_crash.info["failed_reason"] == "error" and not r_crash.info["format_ok"]
    kept, counts = drop_invalid_rewards([x_crash, x_loss], SimpleNamespace(drop_failed_rewards=True))
    assert kept == [x_loss] and counts["filter/failed_dropped/error"] == 1
    kept, _ = drop_invalid_rewards([x_crash, x_loss], SimpleNamespace(drop_failed_rewards=False))
    assert kept == [x_crash, x_loss]
    # Shaping never lifts it above the group's worst legitimate sample (a short crash vs a long loss).
    from rewards.shaping import shape_batch

    shaped = shape_batch([r_crash, r_loss], [1, 100], 2, length_penalty_weight=1.0, format_weight=1.0)
    assert shaped[0][0] <= shaped[1][0]


def test_a_turn_cut_at_max_new_tokens_is_reported_and_masked():
    """A turn cut at --max-new-tokens is not an answer: the environment never steps it (here it would have found
    the number), the episode ends "truncated" with finish reason "length", and --mask-truncated masks it; an
    episode that ran out of turns is not masked."""
    from types import SimpleNamespace

    from common.trainer.filters import mask_truncated

    tok = tiny_with()
    ctx = Context(tok, max_new_tokens=10, max_turns=2, episode_token_budget=2000)
    task = {"id": "g", "env": "guess_number", "secret": 5, "high": 8, "answer": "5", "reward": "math"}
    (cut, r_cut, x_cut), = scored(run_episodes(Scripted(tok, ["Answer: 5 because " + "x" * 40]), ctx, [task],
                                               SamplingConfig(n=1, max_new_tokens=10))[0], tok)
    (out, _, x_out), = scored(run_episodes(Scripted(tok, ["1", "2"]), ctx, [task],
                                           SamplingConfig(n=1, max_new_tokens=10))[0], tok)
    assert cut.end_reason == "truncated" and cut.finish_reason == "length" and cut.turns == 1
    assert cut.final_text == "" and cut.turn_rewards == [0.0] and r_cut.score == 0.0
    assert out.end_reason == "max_turns" and out.finish_reason == "stop"
    assert rollout_metrics([(None, cut), (None, out)])["rollout/end/truncated"] == 1
    masked, counts = mask_truncated([x_cut, x_out], SimpleNamespace(mask_truncated=True))
    assert sum(masked[0].loss_mask) == 0 and masked[1].loss_mask == x_out.loss_mask and sum(x_out.loss_mask) > 0
    assert counts["filter/truncated_masked"] == 1


class Hung(Env):
    """A step that never returns for tasks with "hang" (sync: until close() releases it; or async); the others
    end at once."""

    def reset(self, task):
        self.hang, self.released = task.get("hang"), __import__("threading").Event()
        if self.hang == "reset":
            self.released.wait(3600)
        return [{"role": "user", "content": "Go."}]

    def step(self, action):
        if self.hang == "sync":
            self.released.wait(3600)
        return StepResult([], 1.0, True, {})

    def close(self):
        self.released.set()


class AsyncHung(Env):
    async def reset(self, task):
        self.hang = task.get("hang")
        return [{"role": "user", "content": "Go."}]

    async def step(self, action):
        import asyncio

        if self.hang:
            await asyncio.sleep(3600)
        return StepResult([], 1.0, True, {})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env_workers", [0, 4])
def test_a_hung_step_ends_its_episode_and_the_run_goes_on(monkeypatch, env_workers):
    import threading

    monkeypatch.setitem(ENVS, "hung", "tests.test_agents:Hung")
    monkeypatch.setitem(ENVS, "async_hung", "tests.test_agents:AsyncHung")
    tok = tiny_with()
    ctx = Context(tok, max_new_tokens=20, max_turns=2, episode_token_budget=2000, env_step_timeout_s=1.0,
                  env_workers=env_workers)
    tasks = [{"id": "sync", "env": "hung", "hang": "sync"}, {"id": "async", "env": "async_hung", "hang": True},
             {"id": "ok", "env": "hung"}, {"id": "ok_async", "env": "async_hung"},
             {"id": "reset", "env": "hung", "hang": "reset"}]
    groups, _ = run_episodes(Scripted(tok, ["1"]), ctx, tasks, SamplingConfig(n=2))
    ends = {g.task["id"]: [e.end_reason for e in g.responses] for g in groups}
    assert ends == {"sync": ["timeout"] * 2, "async": ["timeout"] * 2, "ok": ["done"] * 2, "ok_async": ["done"] * 2,
                    "reset": ["timeout"] * 2}
    flat = [(g, e) for g in groups for e in g.responses]
    assert all(e.failed and "did not return within 1s" in e.error for g, e in flat if g.task.get("hang"))
    metrics = rollout_metrics(flat)
    assert metrics["rollout/end/timeout"] == 6
    # Nothing left behind: close() released the sync step's thread, the async step was cancelled.
    from common.envs.boundary import abandoned_threads

    deadline = time.monotonic() + 10
    while abandoned_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert abandoned_threads() == 0 and not [t for t in threading.enumerate() if t.name.startswith("env-call-")]


def test_in_turn_tool_call_result_is_masked_and_the_turn_goes_on():
    tok = tiny_with()
    ctx = Context(tok, max_new_tokens=300, max_turns=4, episode_token_budget=4000, in_turn_tools=True)
    task = {"id": "c", "env": "calculator", "prompt": "6*7?", "answer": "42", "reward": "math"}
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "6*7"}}</tool_call>'
    groups, counts = run_episodes(Scripted(tok, ["Let me compute. " + call + " and junk after the call",
                                                 " So Answer: 42"]), ctx, [task], SamplingConfig(n=1))
    e = groups[0].responses[0]
    assert e.turns == 1 and e.tool_calls == 1 and e.end_reason == "done" and counts["engine_calls"] == 2
    spans = mask_runs(e)
    assert [m for _, _, m in spans] == [1, 0, 1]
    first, result, rest = (tok.decode(e.response_ids[a:b]) for a, b, _ in spans)
    assert first.endswith("</tool_call>") and "junk" not in first  # ids after the call are dropped
    assert result == "\n<tool_response>\n42\n</tool_response>\n"
    assert rest.startswith(" So Answer: 42") and e.final_text == " So Answer: 42"
    # A call written inside reasoning that never closes counts for nothing: no tool runs, the turn is not cut,
    # and the episode ends on its (empty) answer, not with an error.
    groups, _ = run_episodes(Scripted(tok, ["<think>maybe " + call + " then more thoughts"]), ctx, [task],
                             SamplingConfig(n=1))
    e = groups[0].responses[0]
    assert e.end_reason == "done" and e.tool_calls == 0 and not e.error and e.final_text == "", (e.end_reason, e.error)
    assert tok.decode(e.response_ids, skip_special_tokens=True).endswith("then more thoughts")


def test_turn_level_returns_and_advantages():
    # Two episodes of one group, 2 turns each, tokens [t t | t t] with rewards at the turn ends.
    ends = torch.tensor([[0, 1, 0, 1], [0, 1, 0, 1]], dtype=torch.float)
    rewards = torch.tensor([[0, 1.0, 0, 0.0], [0, 0.0, 0, 1.0]])
    mask = torch.ones(2, 4)
    g = turn_returns(rewards, ends, mask, gamma=0.5)
    assert g.tolist() == [[1.0, 1.0, 0.0, 0.0], [0.5, 0.5, 1.0, 1.0]]
    adv = turn_group_advantages(g, ends, mask, torch.tensor([0, 0]), normalize_std=False)
    assert torch.allclose(adv, g - 0.625)
    # collate puts each turn's reward at its last sampled token
    e = Experience(prompt_ids=[1, 2], response_ids=[3, 4, 5, 6, 7], logprobs=[0.0] * 5, loss_mask=[1, 1, 0, 1, 1],
                   reward=2.0, group_id=0, task_id="t", policy_version=0, turn_ends=[2, 5], turn_rewards=[0.5, 1.5])
    b = collate([e], 0)
    assert b.turn_ends[0].tolist() == [0, 0, 1, 0, 0, 1] and b.turn_rewards[0, 5].item() == 1.5


def test_env_settings_are_typed_and_checked():
    assert parse_env_settings(["calculator.sandbox_timeout_s=2"]) == {"calculator.sandbox_timeout_s": 2.0}
    env = make_env("calculator", {"tool_timeout_s": 3.0, "calculator.sandbox_timeout_s": 2.0})
    assert env.settings.sandbox_timeout_s == 2.0 and env.settings.tool_timeout_s == 3.0
    assert make_env("retry", {"retry.retry_discount": 0.25}).settings.retry_discount == 0.25
    for bad, words in [("calculator.nope=1", "no setting 'nope'"), ("calculator.sandbox_timeout_s=x", "not a float"),
                       ("nosuch.x=1", "unknown env"), ("calculator=1", "NAME.FIELD=VALUE")]:
        with pytest.raises(ValueError, match=words):
            parse_env_settings([bad])


def test_grpo_turn_and_in_turn_tools_each_train_two_steps(tmp_path):
    template = tmp_path / "qwen3.jinja"
    template.write_text(QWEN3_TEMPLATE)
    common = [*TINY, "--steps", "2", "--max-turns", "3", "--episode-token-budget", "400", "--truncated-turns",
              "continue"]  # the random model seldom stops: its cut turns go on
    # --format-reward: guess_number says per turn whether the reply held a number (format_ok), so the random tiny
    # model's episodes differ in reward and the turn-level advantages carry a signal (zero-signal groups dropped).
    # The random tiny model never solves calculator's problems: --reward-fn scores each episode by the share of
    # ASCII in what it wrote, which differs within a group, so the policy gradient has a signal to train on.
    # Both runs at once: a tiny run keeps about half a core busy.
    with ThreadPoolExecutor(2) as pool:
        turn = pool.submit(run_script, "train_sync.py", *common, "--taskset", "guess_number", "--algo", "grpo_turn",
                           "--gamma", "0.9", "--format-reward", "1", "--chat-template", str(template),
                           "--log-samples-every", "1", "--out-dir", str(tmp_path / "turn"))
        inturn = pool.submit(run_script, "train_sync.py", *common, "--taskset", "calculator", "--in-turn-tools",
                             "--reward-fn", "tests.test_agents:trajectory_ascii_share", "--episode-token-budget",
                             "900", "--out-dir", str(tmp_path / "inturn"))
        turn, inturn = turn.result(), inturn.result()
    assert turn.returncode == 0, turn.stderr[-3000:]
    rows = assert_trained(tmp_path / "turn", steps=2)
    assert all(r["rollout/turns_mean"] > 1 and not r.get("rollout/end/template") for r in rows)
    assert all(r["filter/zero_signal_frac"] < 1 and r["reward/format_mean"] > 0 for r in rows)
    import json

    sample = json.loads(open(tmp_path / "turn" / "samples.jsonl").readline())
    assert {"turns", "loss_mask_spans", "turn_rewards", "end_reason"} <= set(sample)
    assert inturn.returncode == 0, inturn.stderr[-3000:]
    assert_trained(tmp_path / "inturn", steps=2)
    bad = run_in_process("train_sync.py", *common, "--taskset", "guess_number", "--chat-template", str(tmp_path / "no"),
                         "--out-dir", str(tmp_path / "bad"))
    assert bad.returncode != 0 and "--chat-template" in bad.stderr and "Traceback" not in bad.stderr


def trajectory_ascii_share(response: str, task: dict) -> float:
    """A --reward-fn over the whole trajectory: the share of ASCII characters the policy wrote (the random tiny
    model's turns are cut, so its final answer is always "": the trajectory is where the signal is)."""
    text = "".join(m.get("content") or "" for m in task["trajectory"] if m["role"] == "assistant")
    return sum(ord(c) < 128 for c in text) / len(text) if text else 0.0


class Sleepy(Env):
    """A slow tool beside fast ones, ordered by state, not by the clock: each of a "slow" task's first "slow_steps"
    steps (default: every step) waits until the three "fast" episodes have ended, at most the task's "sleep_s", and
    records whether they had (`waited`); the fast episodes answer at once. Never done (runs to --max-turns)."""

    def reset(self, task):
        self.fast = task["id"].startswith("fast")
        self.sleep_s, self.slow_steps = float(task.get("sleep_s", 0)), task.get("slow_steps", 1 << 30)
        return [{"role": "user", "content": task["prompt"]}]

    def step(self, action):
        if self.slow_steps > 0 and self.sleep_s:
            self.slow_steps -= 1
            Sleepy.waited.append(Sleepy.fast_ended.wait(self.sleep_s))
        return StepResult([{"role": "user", "content": "Go on."}], 0.0, False, {})

    def close(self):
        with Sleepy.lock:  # close runs the moment an episode ends, in whichever thread stepped it
            Sleepy.closed += self.fast
            if Sleepy.closed == 3:
                Sleepy.fast_ended.set()


Sleepy.lock, Sleepy.fast_ended = threading.Lock(), threading.Event()
Sleepy.closed = 0  # fast episodes ended
Sleepy.waited = []  # each slow step: True when the fast episodes ended while it waited


def slow_beside_fast(engine, tok, env_workers: int, slow_s: float, slow_steps: int = 3):
    """One episode whose first `slow_steps` steps (all 3) wait for the three fast episodes beside it (at most
    `slow_s` each), 3 turns each, through the engine's loop: what each slow step saw (True: the fast episodes had
    ended while it waited) and the fast episodes' sampled tokens."""
    from common.explorer.rollouts import Rollouts

    ctx = Context(tok, max_new_tokens=16, max_turns=3, episode_token_budget=400, env_workers=env_workers,
                  truncated_turns="continue")  # the random model seldom stops: its cut turns go on
    rollouts = Rollouts(ctx)
    tasks = [{"id": "slow", "env": "sleepy", "prompt": "Count.", "sleep_s": slow_s,
              "slow_steps": slow_steps}] + \
        [{"id": f"fast{i}", "env": "sleepy", "prompt": f"Count to {i}."} for i in range(3)]
    for i, task in enumerate(tasks):
        rollouts.start(task, i, 1)
    episodes = [w.group.responses[0] for w in rollouts.workflows]
    cls = env_class("sleepy")  # the class as the registry imports it (the module may load twice)
    cls.closed, cls.waited = 0, []
    cls.fast_ended.clear()
    rollouts.generate(engine, SamplingConfig(temperature=1.0, max_new_tokens=16, n=1), 0)
    assert all(e.end_reason == "max_turns" and e.turns == 3 for e in episodes)
    return cls.waited, sum(e.sampled_tokens for e in episodes[1:])


def test_stop_tokens_come_from_the_generation_config_too(tmp_path):
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok)
    other = tok.convert_tokens_to_ids("<|im_start|>")
    model.generation_config.eos_token_id = [other, tok.eos_token_id]
    assert HFEngine(model, tok).stop_ids == [tok.eos_token_id, other]
    model.save_pretrained(tmp_path)
    from common.explorer.engine import default_stop_ids, folder_generation_config

    assert default_stop_ids(tok, folder_generation_config(str(tmp_path))) == [tok.eos_token_id, other]
    assert folder_generation_config(str(tmp_path / "none")) is None


class Counting(Env):
    """A new environment with a task generator: one file plus one registry line makes `--taskset counting`."""

    make_task = staticmethod(lambda rng, index, difficulty, arg=None: {"id": f"count-{index}", "env": "counting",
                                                                        "upto": difficulty + int(arg or 0)})

    def reset(self, task):
        return [{"role": "user", "content": f"Count to {task['upto']}."}]

    def step(self, action):
        return StepResult([], 1.0, True, {})


def test_env_tasksets_come_from_the_registry_and_games_without_their_data_are_refused(monkeypatch):
    from common.tasks import build_tasksets

    monkeypatch.setitem(ENVS, "counting", "tests.test_agents:Counting")
    train, held_out = build_tasksets("counting:10", None, 2, 3, 0)
    assert [t["upto"] for t in held_out] == [12, 12, 12] and train.next_batch(1)[0]["env"] == "counting"
    pytest.importorskip("textarena")
    from common.envs.textarena_env import nltk_words_installed

    if not nltk_words_installed():
        with pytest.raises(SystemExit, match=r"textarena:Wordle-v0: the game needs NLTK's 'words' corpus"):
            build_tasksets("textarena:Wordle-v0", None, 1, 2, 0)
    assert build_tasksets("textarena:GuessTheNumber-v0", None, 1, 2, 0)[1][0]["game"] == "GuessTheNumber-v0"


def test_gem_adapter_plays_a_gem_game():
    """GEM (gem-llm 0.1.0) is installed beside the pins with --no-deps (common/envs/gem_env.py says why)."""
    pytest.importorskip("gem", reason="gem-llm not installed (pip install --no-deps gem-llm==0.1.0)")
    from common.tasks import build_tasksets

    _, held_out = build_tasksets("gem:game:GuessTheNumber-v0-easy", None, 1, 1, 0)
    env = make_env("gem")
    first = env.reset(held_out[0])
    assert "Guess The Number" in first[0]["content"]
    lo, hi, result = 1, 10, None
    for _ in range(4):
        guess = (lo + hi) // 2
        result = env.step(f"\\boxed{{{guess}}}")
        if result.done:
            break
        hint = result.messages[0]["content"]
        lo, hi = (guess + 1, hi) if "higher" in hint else (lo, guess - 1)
    assert result.done and result.reward > 0


def test_reward_fn_gets_the_whole_trajectory_and_shaping_sees_episodes(tmp_path):
    from rewards import RewardPool, UserReward
    from rewards.shaping import shape_batch
    from common.explorer.parts import ScoreFuture

    fn = tmp_path / "traj_reward.py"
    fn.write_text("def score(response, task):\n"
                  "    turns = [m for m in task['trajectory'] if m['role'] == 'assistant']\n"
                  "    return len(turns) + sum(task['turn_rewards']) + (task['end_reason'] == 'done')\n")
    tok = tiny_with()
    ctx = Context(tok, max_new_tokens=50, max_turns=4, episode_token_budget=2000)
    task = {"id": "g", "env": "guess_number", "secret": 5, "high": 8}
    groups, _ = run_episodes(Scripted(tok, ["3", "no idea", "5"]), ctx, [task], SamplingConfig(n=1))
    flat = [(groups[0], e) for e in groups[0].responses]
    pool = RewardPool(num_workers=1, timeout_s=20, score_fn=UserReward(f"{fn}:score"))
    try:
        rewards = ScoreFuture(pool, flat, tok, "sum", whole_episodes=True).result(timeout=60)
    finally:
        pool.close()
    # 3 assistant turns + env reward 1 (found) + done; plus the env's own sum (1.0) that Episode.reward adds
    assert rewards[0].score == 3 + 1 + 1 + 1.0
    assert rewards[0].info["format_ok"] is True  # the last step's verdict (it held a number)
    shaped = shape_batch(rewards, [flat[0][1].sampled_tokens], 1, format_weight=0.5)
    assert shaped[0][1]["format"] == 0.5


def test_an_over_long_environment_task_is_rejected_at_load_with_file_and_line(tmp_path):
    import json

    rows = [{"env": "retry", "prompt": "2+2?", "answer": "4"}, {"env": "retry", "prompt": "x" * 3000, "answer": "1"}]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    proc = run_in_process("train_sync.py", *TINY, "--taskset", str(path), "--eval-size", "1", "--steps", "1",
                          "--episode-token-budget", "1000", "--out-dir", str(tmp_path / "r"))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {path}:2: the episode cannot start") and "--episode-token-budget 1000" in last
