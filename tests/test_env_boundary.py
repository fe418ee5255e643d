"""The boundary around environments (common/envs/boundary.py), tried as a sloppy environment author and an adversarial
policy would: a fault-injection matrix {in-process sync, async, HTTP} x {BaseException, malformed result, None
result, non-finite intermediate reward, blocked event loop, swallowed cancellation, hang in close}, each ending its
own episode with its counted reason while the others finish; a real short run against faulty environments that
trains; nested and oversized tool calls in every format are malformed calls; the in-turn and per-turn paths score
the same scripted episodes the same; ToolEnv's default tools and the start-up check of their schemas; non-finite
values never train."""

import _thread
import asyncio
import json
import math
import threading
import time
from types import SimpleNamespace

import pytest

from common.envs import ENVS, Env, StepResult
from common.envs.boundary import EnvFailure, EpisodeEnv, abandoned_threads, late_results
from common.envs.http_env import EnvServer
from common.envs.tool_formats import FORMATS
from common.envs.tools import ToolEnv, check_tools
from common.explorer.engine import SamplingConfig
from common.explorer.rollouts import run_episodes
from common.explorer.parts import rollout_metrics
from common.explorer.workflow import Context
from tests.conftest import TINY, assert_trained, run_in_process
from tests.test_agents import Scripted, scored, tiny_with

HOLD_S = 5  # how long a hung call of these environments holds before it gives up by itself

FAULTS = {  # fault: the counted reason in process, and over HTTP (where the server's 500 is what the client sees)
    "base_exception": ("step_raised", "step_raised"),
    "malformed": ("step_invalid", "step_raised"),
    "none_result": ("step_invalid", "step_raised"),
    "nonfinite_reward": ("step_invalid", "step_raised"),
    "blocked_loop": ("step_timeout", "step_timeout"),
    "swallowed_cancel": ("step_timeout", "step_timeout"),
    "hang_in_close": ("close_timeout", "close_timeout"),
}
SAYS = {"base_exception": "KeyboardInterrupt: the game quits", "malformed": "reward is 'high', not a finite number",
        "none_result": "step returned None, not a StepResult", "nonfinite_reward": "reward is nan, not a finite number",
        "blocked_loop": "did not return within 2s", "swallowed_cancel": "did not return within 2s",
        "hang_in_close": "did not return within 2s"}


class Faulty(Env):
    """Two turns: reward 0.5 and "Again.", then done with a reward that depends on the answer (a learning signal).
    A task's "fault" strikes at turn 2 (the non-finite reward at turn 1: an intermediate step) or in close."""

    def reset(self, task):
        self.fault, self.turn, self.release = task.get("fault"), 0, threading.Event()
        return [{"role": "user", "content": "Say something."}]

    def outcome(self, action):
        self.turn += 1
        if self.turn == 1:
            reward = float("nan") if self.fault == "nonfinite_reward" else 0.5
            return StepResult([{"role": "user", "content": "Again."}], reward, False, {})
        if self.fault == "base_exception":
            raise KeyboardInterrupt("the game quits")  # raised by the environment: not the user's Ctrl-C
        if self.fault == "malformed":
            return StepResult([], "high", True, {})
        if self.fault == "none_result":
            return None
        return StepResult([], len(action) % 7 / 6, True, {})

    def step(self, action):
        result = self.outcome(action)
        if self.turn == 2 and self.fault in ("blocked_loop", "swallowed_cancel"):
            self.release.wait(HOLD_S)  # a plain function has no loop nor cancellation: it hangs
        return result

    def close(self):
        if self.fault == "hang_in_close":
            threading.Event().wait(HOLD_S)
        self.release.set()


class AsyncFaulty(Faulty):
    async def reset(self, task):
        return Faulty.reset(self, task)

    async def step(self, action):
        result = self.outcome(action)
        if self.turn == 2 and self.fault == "blocked_loop":
            self.release.wait(HOLD_S)  # blocks its event loop
        if self.turn == 2 and self.fault == "swallowed_cancel":
            give_up = time.monotonic() + HOLD_S
            while not self.release.is_set() and time.monotonic() < give_up:
                try:
                    await asyncio.sleep(0.02)
                except asyncio.CancelledError:
                    pass  # swallowed
        return result

    async def close(self):
        if self.fault == "hang_in_close":
            await asyncio.sleep(HOLD_S)
        self.release.set()


@pytest.fixture
def faulty_envs(monkeypatch):
    monkeypatch.setitem(ENVS, "faulty", "tests.test_env_boundary:Faulty")
    monkeypatch.setitem(ENVS, "async_faulty", "tests.test_env_boundary:AsyncFaulty")


@pytest.fixture(scope="module")
def server():
    """An environment server in this process (so it serves the test's environments), over real HTTP."""
    srv = EnvServer(("127.0.0.1", 0), step_timeout_s=30)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("kind", ["sync", "async", "http"])
def test_a_fault_ends_its_own_episode_with_its_reason(faulty_envs, server, kind, fault):
    tok = tiny_with()
    remote = {"env_server": server, "env_setting": ("http.request_timeout_s=10",)} if kind == "http" else {}
    # 2 s per environment call: the hung ones end there; the well-behaved one (its first call makes it) must not,
    # on a machine three test processes load (1 s was missed once)
    ctx = Context(tok, max_new_tokens=20, max_turns=4, episode_token_budget=2000, env_step_timeout_s=2.0,
                  env_workers=4, **remote)
    env = "faulty" if kind == "sync" else "async_faulty"
    tasks = [{"id": "bad", "env": env, "fault": fault}, {"id": "ok", "env": env}]
    groups, _ = run_episodes(Scripted(tok, ["1", "22"]), ctx, tasks, SamplingConfig(n=1))
    (g_bad, bad), (g_ok, ok) = [(g, e) for g in groups for e in g.responses]
    assert ok.end_reason == "done" and ok.turn_rewards == [0.5, 2 / 6] and not ok.failed, (ok.end_reason, ok.error)
    reason = FAULTS[fault][kind == "http"]
    assert bad.failed and bad.failure == reason, (bad.end_reason, bad.failure, bad.error)
    assert SAYS[fault] in bad.error and f"environment {env!r}" in bad.error, bad.error
    assert all(math.isfinite(r) and r == 0 for r in bad.turn_rewards) and bad.turns <= 2
    reward = bad.reward(None, "sum")
    assert reward.score == Faulty.worst_reward and reward.info["failed_reason"] == bad.end_reason
    metrics = rollout_metrics([(g_bad, bad), (g_ok, ok)])
    assert metrics[f"rollout/env_failure/{reason}"] == 1 and metrics[f"rollout/end/{bad.end_reason}"] == 1


class Quitter(Env):
    def reset(self, task):
        return [{"role": "user", "content": "Go."}]

    def step(self, action):
        raise {"exit": SystemExit(3), "cancel": asyncio.CancelledError(), "bad_str": BadStr()}[action]


class BadStr(Exception):
    def __str__(self):
        raise RuntimeError("no text for you")


def test_every_base_exception_is_the_episodes_and_a_real_ctrl_c_still_stops(monkeypatch):
    monkeypatch.setitem(ENVS, "quitter", "tests.test_env_boundary:Quitter")
    for action, says in [("exit", "SystemExit: 3"), ("cancel", "CancelledError"), ("bad_str", r"its str\(\) raised")]:
        env = EpisodeEnv("quitter", {}, timeout_s=5)
        env.reset({})
        with pytest.raises(EnvFailure, match=says) as failure:
            env.step(action)
        assert failure.value.metric == "step_raised"
        env.close()
    # The user's Ctrl-C arrives in the main thread while it waits on an environment: it is not the episode's.
    monkeypatch.setitem(ENVS, "faulty", "tests.test_env_boundary:Faulty")
    env = EpisodeEnv("faulty", {}, timeout_s=60)
    env.reset({"fault": "blocked_loop"})
    env.step("1")
    threading.Timer(0.5, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        env.step("2")
    env.close()


def test_a_late_result_is_discarded_and_counted(monkeypatch):
    """A step that swallows its cancellation returns after the limit (once close releases it): the episode
    failed at the limit, and the result is counted as late, not used."""
    monkeypatch.setitem(ENVS, "async_faulty", "tests.test_env_boundary:AsyncFaulty")
    deadline = time.monotonic() + 60
    while abandoned_threads() and time.monotonic() < deadline:  # the calls other tests gave up on, ended
        time.sleep(0.05)
    late = late_results()
    env = EpisodeEnv("async_faulty", {}, timeout_s=1)
    env.reset({"fault": "swallowed_cancel"})
    env.step("1")
    with pytest.raises(EnvFailure, match="did not return within 1s"):
        env.step("2")
    env.close()
    while late_results() == late and time.monotonic() < deadline:
        time.sleep(0.05)
    assert late_results() == late + 1


def test_a_tool_that_exits_is_a_counted_tool_error():
    class Exits(ToolEnv):
        def reset(self, task):
            return [{"role": "user", "content": "Go."}]

        def leave(self) -> str:
            """Leave the game."""
            raise SystemExit("bye")

    out = Exits().step('<tool_call>{"name": "leave", "arguments": {}}</tool_call>')
    assert out.info["tool_errors"] == ["exception"]
    assert out.messages[0]["content"] == "error: exception: SystemExit: bye"


@pytest.mark.timeout(900)
def test_a_run_against_faulty_environments_trains(faulty_envs, server, tmp_path):
    """A real run (over an environment server, so the faulty environments reach its workers): turn-level GRPO
    with the last step's reward (an intermediate NaN would reach the advantages), faults in half the tasks, and it
    trains."""
    rows = [{"id": f"ok{i}", "env": "http", "remote_env": "faulty"} for i in range(4)]
    rows += [{"id": f, "env": "http", "remote_env": "faulty", "fault": f}
             for f in ("base_exception", "malformed", "none_result", "nonfinite_reward")]
    taskset, held_out = tmp_path / "faulty.jsonl", tmp_path / "eval.jsonl"
    taskset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out.write_text(json.dumps(rows[0]) + "\n")
    out = tmp_path / "run"
    proc = run_in_process("train_sync.py", *TINY, "--taskset", str(taskset), "--eval-taskset", str(held_out),
                          "--eval-size", "1", "--env-setting", f"http.url={server}",
                          "--algo", "grpo_turn", "--env-reward", "last", "--steps", "2", "--tasks-per-step", "8",
                          "--max-turns", "3", "--episode-token-budget", "400", "--truncated-turns", "continue",
                          "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = assert_trained(out, steps=2)
    assert sum(r.get("rollout/end/error", 0) for r in rows) > 0
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert all(0 < r["rollout/turns_mean"] <= 3 for r in rows)  # the metric is there; at most --max-turns


DEEP = '{"x": ' * 5000 + "1" + "}" * 5000
HUGE = '{"a": "' + "a" * 40_000 + '"}'
WRITE = {  # format: the turn calling `add` with these arguments (JSON text), as its family writes it
    "hermes": lambda a: '<tool_call>{"name": "add", "arguments": %s}</tool_call>' % a,
    "llama3_json": lambda a: '<|python_tag|>{"name": "add", "parameters": %s}' % a,
    "mistral": lambda a: '[TOOL_CALLS] [{"name": "add", "arguments": %s}]' % a,
    "qwen3_coder": lambda a: ("<tool_call>\n<function=add>\n<parameter=a>\n%s\n</parameter>\n</function>\n"
                              "</tool_call>") % a,
}


class Adder(ToolEnv):
    def reset(self, task):
        return [{"role": "user", "content": "Add."}]

    def add(self, a: object = 0, b: int = 0) -> str:
        """Add two numbers.

        Args:
            a: first
            b: second
        """
        return "ok"


@pytest.mark.parametrize("name", list(FORMATS))
def test_nested_and_oversized_tool_calls_are_malformed_calls_in_every_format(name):
    assert set(WRITE) == set(FORMATS)
    env = Adder(Adder.Settings(tool_call_format=name))
    for arguments in (DEEP, HUGE):
        out = env.step(WRITE[name](arguments))  # never a RecursionError: the policy's malformed call
        assert out.info["tool_errors"] == ["malformed"] and not out.done, (name, out.info)
    assert env.step(WRITE[name]('{"a": 1}')).info["tool_errors"] == []


class Chatty(Adder):
    """An answer does not end the episode ("Noted."): only --max-turns does."""

    def answer(self, text):
        return StepResult([{"role": "user", "content": "Noted."}], 0.0, False, {})


CALL = '<tool_call>{"name": "add", "arguments": {"a": 40, "b": 2}}</tool_call>'
LAST_TURN = [  # the scripted turns (the last one repeats), the verifier's score of the episode, tools that ran
    (["Answer: 42"], 1.0, 0),
    ([CALL, "Answer: 42"], 1.0, 1),
    (["Answer: 42", CALL], 0.0, 2),  # an earlier answer, then only tool calls until --max-turns: no answer
    (["Answer: 42", f"<think>{CALL}</think>Answer: 41"], 0.0, 0),
    (["Answer: 42", f"<think>a</think>Answer: 41<think>{CALL}"], 0.0, 0),  # a call in re-opened reasoning
    ([f"<think>a<think>{CALL}</think>b</think>Answer: 42"], 1.0, 0),  # nested reasoning
    (["<think>a</think>Answer: 42<think>x</think>"], 1.0, 0),
]


def test_the_in_turn_and_per_turn_paths_score_the_same_episodes_the_same(monkeypatch):
    monkeypatch.setitem(ENVS, "chatty", "tests.test_env_boundary:Chatty")
    tok = tiny_with()
    task = {"id": "c", "env": "chatty", "answer": "42", "reward": "math"}
    for turns, score, tools in LAST_TURN:
        for in_turn in (False, True):
            ctx = Context(tok, max_new_tokens=200, max_turns=3, episode_token_budget=4000, in_turn_tools=in_turn)
            (e, reward, _), = scored(run_episodes(Scripted(tok, turns), ctx, [task], SamplingConfig(n=1))[0], tok)
            assert e.end_reason == "max_turns" and (reward.score, min(e.tool_calls, 2)) == (score, tools), \
                (turns, in_turn, reward.score, e.tool_calls, e.final_text)


def test_tool_env_defaults_offer_exactly_its_own_tools_and_a_bad_schema_stops_the_start(monkeypatch):
    from common.knobs import ConfigError
    from common.preflight import check_episode_prompts

    assert Adder().tool_names() == ["add"] and [s["function"]["name"] for s in Adder().tool_schemas()] == ["add"]

    class Undocumented(Adder):
        def peek(self, x):
            return x

    check_tools(Adder)
    with pytest.raises(ValueError, match="environment Undocumented: no JSON schema for tool 'peek'"):
        check_tools(Undocumented)
    monkeypatch.setattr(Undocumented, "__module__", __name__)
    monkeypatch.setattr(__import__(__name__), "Undocumented", Undocumented, raising=False)
    monkeypatch.setitem(ENVS, "undocumented", f"{__name__}:Undocumented")
    with pytest.raises(ConfigError, match="tool 'peek'"):
        check_episode_prompts(SimpleNamespace(taskset="tasks.jsonl"), [{"id": "u", "env": "undocumented"}])


def test_non_finite_values_never_train():
    import torch

    from common.experience import Experience
    from common.trainer.filters import NonFinite, check_finite, drop_invalid_rewards

    def exp(reward, turns):
        return Experience(prompt_ids=[1], response_ids=[2], logprobs=[0.0], loss_mask=[1], reward=reward, group_id=0,
                          task_id="t", policy_version=0, turn_rewards=turns)

    clean = exp(1.0, [0.5, 0.5])
    kept, counts = drop_invalid_rewards([exp(1.0, [float("nan"), 1.0]), exp(float("inf"), []), clean],
                                        SimpleNamespace(drop_failed_rewards=False))
    assert kept == [clean] and counts["filter/invalid_dropped"] == 2
    check_finite(3, advantages=torch.zeros(4), returns=None, loss=0.5)
    with pytest.raises(NonFinite, match=r"step 3: 1 non-finite value\(s\) in the advantages"):
        check_finite(3, advantages=torch.tensor([0.0, float("nan")]))
    with pytest.raises(NonFinite, match="in the loss"):
        check_finite(7, grad_norm=torch.tensor(1.0), loss=torch.tensor(float("inf")))


def nan_loss(mb) -> tuple:
    """A --loss-fn with a numerical fault: the surrogate times NaN."""
    return (mb.logprobs * mb.mask).sum() * float("nan"), {}


@pytest.mark.timeout(600)
def test_a_non_finite_loss_stops_the_run_before_the_update(tmp_path):
    out = tmp_path / "run"
    proc = run_in_process("train_sync.py", *TINY, "--steps", "2", "--loss-fn", "tests.test_env_boundary:nan_loss",
                          "--out-dir", str(out))
    assert proc.returncode != 0
    assert "NonFinite: step 1: 1 non-finite value(s) in the loss: the update was not applied" in proc.stderr, \
        proc.stderr[-2000:]
