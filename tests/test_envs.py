"""Environments and tools (common/envs): tool-call errors become observations and the episode goes on; each
built-in environment plays an episode; the TextArena adapter gets the library's own reward; reasoning-gym tasks
are scored by its score_answer; task processors; the partial-rollouts conflict is a one-line error."""

import time

import pytest

from common.explorer.engine import RolloutEngine, Generation, SamplingConfig
from common.envs import ENVS, make_env
from common.envs.tool_formats import split_hermes
from common.envs.tools import ToolEnv
from common.model import build_tiny_tokenizer
from common.explorer.rollouts import run_episodes
from common.explorer.parts import rollout_metrics
from common.explorer.workflow import Context
from tests.conftest import TINY, run_in_process


class Slow(ToolEnv):
    tools = ("add", "hang", "nap")

    def reset(self, task):
        return [{"role": "user", "content": "add 2 and 3"}]

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: first
            b: second
        """
        return a + b

    def hang(self) -> str:
        """Never answers."""
        time.sleep(3600)

    async def nap(self) -> str:
        """Never answers either, but waits as a coroutine (cancelled at the timeout)."""
        import asyncio

        await asyncio.sleep(3600)


class Scripted(RolloutEngine):
    """A policy that says what the test scripts, turn by turn (its text is tokenised to ids as a model's would be):
    the tool-error cases need exact malformed outputs a random model would not write. Log-probs are 0."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.calls = tokenizer, turns, 0

    def generate(self, prompts, sampling):
        text = self.turns[self.calls]
        self.calls += 1
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return [[Generation(list(p), ids, [0.0] * len(ids), "stop")] for p in prompts]

    def weight_buffers(self):
        return []


def test_parse_tool_calls():
    def parse_tool_calls(text):  # the Hermes format's calls of a turn; None: the turn is an answer
        return split_hermes(text)[1]

    assert parse_tool_calls("Answer: 5") is None
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>') == \
        [{"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert parse_tool_calls("<tool_call>{oops</tool_call>")[0].reason == "malformed"
    assert parse_tool_calls('<tool_call>{"name": "add"')[-1].reason == "malformed"


def test_tool_errors_are_observations_and_the_episode_goes_on(monkeypatch):
    monkeypatch.setitem(ENVS, "slow", "tests.test_envs:Slow")
    tok = build_tiny_tokenizer()
    turns = ["<tool_call>{not json</tool_call>",
             '<tool_call>{"name": "multiply", "arguments": {}}</tool_call>',
             '<tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>',
             '<tool_call>{"name": "hang", "arguments": {}}</tool_call>',
             '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
             "Answer: 5"]
    ctx = Context(tok, max_new_tokens=128, max_turns=8, episode_token_budget=4000, tool_timeout_s=0.5)
    t0 = time.time()
    groups, counts = run_episodes(Scripted(tok, turns), ctx, [{"id": "s", "env": "slow"}],
                                  SamplingConfig(temperature=1.0, n=1))
    assert time.time() - t0 < 30
    e = groups[0].responses[0]
    assert e.end_reason == "done" and e.turns == 6 and counts["engine_calls"] == 6
    tool_msgs = [m["content"] for m in e.messages if m["role"] == "tool"]
    assert [m.split(":")[0:2] for m in tool_msgs[:4]] == [["error", " malformed"], ["error", " unknown_tool"],
                                                           ["error", " bad_arguments"], ["error", " timeout"]]
    assert tool_msgs[4] == "5"
    metrics = rollout_metrics([(groups[0], e)])
    assert {k: v for k, v in metrics.items() if k.startswith("rollout/tool_error/")} == {
        "rollout/tool_error/malformed": 1, "rollout/tool_error/unknown_tool": 1,
        "rollout/tool_error/bad_arguments": 1, "rollout/tool_error/timeout": 1}
    # The schemas reached the model: SmolLM2-style templates ignore tools=, so they are in the system message.
    assert e.messages[0]["role"] == "system" and '"name":"add"' in e.messages[0]["content"]


def test_an_async_tool_that_hangs_is_cancelled_and_leaves_no_thread():
    import threading

    env = Slow(Slow.Settings(tool_timeout_s=0.5))
    env.reset({})
    out = env.step('<tool_call>{"name": "nap", "arguments": {}}</tool_call>')
    assert out.info["tool_errors"] == ["timeout"] and "error: timeout" in out.messages[0]["content"]
    assert not [t for t in threading.enumerate() if t.name == "tool-nap"]


def test_calculator_python_tool_runs_in_the_sandbox_and_a_hang_is_a_timeout():
    env = make_env("calculator")
    env.sandbox_timeout_s = 2.0
    env.reset({"prompt": "p"})
    out = env.step('<tool_call>{"name": "python", "arguments": {"code": "import os; print(6 * 7, os.getpid())"}}'
                   '</tool_call>')
    assert out.messages[0]["content"].startswith("42 ") and not out.done
    assert out.messages[0]["content"].split()[1] != str(__import__("os").getpid())  # another process
    hung = env.step('<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>')
    assert hung.info["tool_errors"] == ["timeout"] and "error: timeout" in hung.messages[0]["content"]
    calc = env.step('<tool_call>{"name": "calculate", "arguments": {"expression": "3 * (4 + 5)"}}</tool_call>')
    assert calc.messages[0]["content"] == "27"
    bad = env.step('<tool_call>{"name": "calculate", "arguments": {"expression": "__import__(\'os\')"}}</tool_call>')
    assert bad.info["tool_errors"] == ["exception"]
    assert env.step("Answer: 27").done


@pytest.mark.timeout(120)
def test_forty_tool_calls_in_one_turn_start_at_most_the_bounded_number_of_programs():
    """--max-tool-calls-per-turn 8: 40 sandboxed `python` calls in one turn run 8 programs (the rest are counted
    errors that start nothing), and --sandbox-procs 3 keeps at most 3 of them running at any moment."""
    from common.envs.tools import set_sandbox_slots

    set_sandbox_slots(3)
    try:
        env = make_env("calculator", {"max_tool_calls_per_turn": 8, "tool_timeout_s": 60.0})
        env.reset({"prompt": "p"})
        code = "import time; a = time.time(); time.sleep(0.4); print(a, time.time())"
        call = '<tool_call>{"name": "python", "arguments": {"code": "%s"}}</tool_call>' % code
        out = env.step(call * 40)
    finally:
        set_sandbox_slots(4)
    ran = [tuple(map(float, m["content"].split())) for m in out.messages if not m["content"].startswith("error")]
    assert len(ran) == 8 and out.info["tool_errors"] == ["too_many_calls"] * 32, out.messages[:2]
    assert out.info["tool_calls"] == 40 and "too_many_calls" in out.messages[-1]["content"]
    most = max(sum(a <= t < b for a, b in ran) for t, _ in ran)  # programs running when each one started
    assert most <= 3, ran


def test_guess_number_and_retry_feedback():
    env = make_env("guess_number")
    env.reset({"secret": 5, "high": 8})
    assert env.step("4").messages[0]["content"] == "Higher."
    assert env.step("I say 7").messages[0]["content"] == "Lower."
    won = env.step("5")
    assert won.done and won.reward == 1.0 and won.info["success"]
    retry = make_env("retry")
    retry.reset({"prompt": "2+2?", "answer": "4", "attempts": 3})
    first = retry.step("Answer: 5")
    assert not first.done and "not correct" in first.messages[0]["content"]
    second = retry.step("2 + 2 = 4. Answer: 4")
    assert second.done and second.reward == 0.5


def test_textarena_guess_the_number_scripted_binary_search_gets_the_library_reward():
    pytest.importorskip("textarena")
    import re

    env = make_env("textarena")
    first = env.reset({"game": "GuessTheNumber-v0", "seed": 3})
    assert "Guess The Number" in first[0]["content"]
    lo, hi, result = 1, 20, None
    for _ in range(10):
        guess = (lo + hi) // 2
        result = env.step(f"My guess is [{guess}]")
        if result.done:
            break
        hint = result.messages[0]["content"].lower()
        assert "higher" in hint or "lower" in hint, hint
        lo, hi = (guess + 1, hi) if "higher" in hint else (lo, guess - 1)
    assert result.done and result.reward == 1.0 and result.info["success"]
    assert re.search("correct", result.info["game"]["reason"], re.I)


def test_reasoning_gym_score_answer_is_the_verifier():
    pytest.importorskip("reasoning_gym")
    from common.envs.reasoning_gym_env import reasoning_gym_tasks

    task = reasoning_gym_tasks(["basic_arithmetic"], 2, 0, "rg-")[0]
    env = make_env("reasoning_gym")
    env.reset(task)
    assert env.step(f"Easy. Answer: {task['entry']['answer']}").reward == 1.0
    env.reset(task)
    assert env.step("Answer: not a number").reward == 0.0


def test_task_processors_and_partial_rollout_conflict(tmp_path):
    from common.tasks.processors import apply_task_processors

    class A:
        prompt_template, max_prompt_chars = "Q: {prompt}", 5

    tasks, counts = apply_task_processors([{"prompt": "abc"}, {"prompt": "abcdefgh"}],
                                          "difficulty_tag,max_prompt_chars", A)
    assert tasks == [] and counts["tasks/max_prompt_chars_dropped"] == 2  # --prompt-template applies first: "Q: abc" is 6 chars
    tasks, _ = apply_task_processors([{"prompt": "a", "difficulty": 2}], "difficulty_tag", A)
    assert tasks[0]["tags"] == ["difficulty:2"]
    proc = run_in_process("train_sync.py", *TINY, "--taskset", "arith+guess_number", "--rollout-token-budget", "4",
                          "--out-dir", str(tmp_path / "run"))
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
        "error: --rollout-token-budget (partial rollouts) works with single-turn tasks only, and --taskset "
        "arith+guess_number has multi-turn (env) tasks")


def test_readme_worked_example_env_runs(tmp_path, monkeypatch):
    """docs/USAGE.md's "adding an environment" example, taken from the doc as written, plays an episode."""
    import os
    import re
    import sys

    from tests.conftest import ROOT

    readme = open(os.path.join(ROOT, "docs", "USAGE.md")).read()
    block = re.search(r"```python\n# a new file in common/envs/ \(countdown\.py\)\n(.*?)```", readme, re.DOTALL)
    assert block, "the example environment's code block is missing from docs/USAGE.md"
    code = block.group(1)
    line = re.search(r'"countdown": "common\.envs\.countdown:Countdown"', readme)
    assert line, "the registry line of the example is missing from docs/USAGE.md"
    (tmp_path / "countdown_example.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(ENVS, "countdown", "countdown_example:Countdown")
    tok = build_tiny_tokenizer()
    ctx = Context(tok, max_new_tokens=16, max_turns=8, episode_token_budget=2000)
    groups, counts = run_episodes(Scripted(tok, ["3", "2", "1"]), ctx, [{"id": "c", "env": "countdown", "start": 3}],
                                  SamplingConfig(temperature=1.0, n=1))
    e = groups[0].responses[0]
    assert e.end_reason == "done" and e.turn_rewards == [1.0, 1.0, 1.0] and e.success
    sys.modules.pop("countdown_example", None)


def test_env_rows_are_checked_when_loaded(tmp_path):
    import json

    from common.tasks.files import load_jsonl

    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"env": "guess_number", "secret": 3}) + "\n" + json.dumps({"env": "guess_number"}))
    with pytest.raises(SystemExit, match=rf"^error: {path}:2: missing field 'secret' \(needed by env 'guess_number'\)$"):
        load_jsonl(str(path))
    path.write_text(json.dumps({"env": "retry", "answer": "4", "prompt": "2+2", "reward": "nope"}))
    with pytest.raises(SystemExit, match=r":1: unknown reward 'nope'"):
        load_jsonl(str(path))
