"""Standard environment libraries behind tandem's boundary: verifiers (common/envs/verifiers_env.py) and OpenEnv
(common/envs/openenv_env.py), each trained end to end on the tiny model, and each adapter fed environments that
raise, hang or return garbage (one episode ends, with its reason; the next one plays)."""

import math
import random

import pytest

from tests.conftest import TINY, assert_trained, run_in_process

vf = pytest.importorskip("verifiers")
pytest.importorskip("openenv.core")

from common.envs import openenv_env, verifiers_env  # noqa: E402  (after the skips: they need the libraries)
from common.envs.boundary import EnvFailure, EpisodeEnv  # noqa: E402

TINY_ENV = "tests.verifiers_tiny_env"


@pytest.mark.parametrize("taskset", ["verifiers:tests.verifiers_tiny_env", "openenv:tests.openenv_tiny_env"])
def test_a_standard_env_trains(taskset, tmp_path):
    # Both tiny environments play two turns and pay the ASCII share of the policy's turns at the end. The random
    # tiny model seldom stops within --max-new-tokens: its cut turns go on, so both turns are played.
    proc = run_in_process("train_sync.py", *TINY, "--taskset", taskset, "--steps", "2",
                          "--truncated-turns", "continue", "--episode-token-budget", "200",
                          "--out-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = assert_trained(tmp_path / "run", steps=2)
    assert all(r["rollout/turns_mean"] == 2 and r["rollout/end/done"] == r["rollout/episodes"] for r in rows), rows
    assert all(0 < r["reward/mean"] < 1 for r in rows)  # the environment's ASCII share, never an error's 0


class Scripted(vf.MultiTurnEnv):
    """A two-turn environment whose env_response and rubric do what the test says."""

    def __init__(self, respond, score, **kwargs):
        from datasets import Dataset

        super().__init__(dataset=Dataset.from_list([{"question": "q", "answer": "a"}]),
                         rubric=vf.Rubric(funcs=[score]), max_turns=2, **kwargs)
        self.respond = respond

    async def env_response(self, messages, state, **kwargs):
        return self.respond(messages)


def ok_score(completion, **kwargs) -> float:
    return 0.5


def episode(name: str, env, actions=("one", "two"), timeout_s: float = 10):
    """Play `env` as verifiers environment `name` through the boundary: [reset's messages, step results...]."""
    verifiers_env._loaded[name] = env
    task = verifiers_env.verifiers_task_list(name, 1, 0, "t-")[0]
    ep = EpisodeEnv("verifiers", {}, timeout_s)
    try:
        out = [ep.reset(task)[0]]
        for action in actions:
            out.append(ep.step(action))
            if out[-1].done:
                break
        return out
    finally:
        ep.close()


def test_verifiers_adapter_plays_and_scores_in_process():
    first, turn, last = episode("good", Scripted(lambda m: [vf.UserMessage(content="again")], ok_score))
    assert first == [{"role": "user", "content": "q"}]
    assert (turn.messages, turn.reward, turn.done) == ([{"role": "user", "content": "again"}], 0.0, False)
    assert (last.reward, last.done) == (0.5, True) and last.info["stop_condition"] == "max_turns_reached"


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def answered(completion, answer, **kwargs) -> float:
    return float(any(m.role == "assistant" and isinstance(m.content, str) and answer in m.content
                     for m in completion))


def test_a_verifiers_tool_env_gets_tandem_parsed_calls():
    from datasets import Dataset

    env = vf.ToolEnv(dataset=Dataset.from_list([{"question": "2+3?", "answer": "5"}]), tools=[add],
                     rubric=vf.Rubric(funcs=[answered]), max_turns=4)
    verifiers_env._loaded["tool"] = env
    task = verifiers_env.verifiers_task_list("tool", 1, 0, "t-")[0]
    ep = EpisodeEnv("verifiers", {}, 10)
    try:
        _, tools = ep.reset(task)
        assert [t["function"]["name"] for t in tools] == ["add"]
        call = ep.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')  # hermes
        assert [m["content"] for m in call.messages] == ["5"] and not call.done and call.reward == 0
        assert call.info["calls"][0]["id"] == call.messages[0]["tool_call_id"]
        last = ep.step("It is 5.")
    finally:
        ep.close()
    assert (last.reward, last.done, last.info["stop_condition"]) == (1.0, True, "no_tools_called")


def boom(messages):
    raise RuntimeError("env_response broke")


def library_error(messages):
    raise vf.Error("the library's own error: it ends the rollout with state['error'], which the rubric would score")


@pytest.mark.parametrize("name,env,reason", [
    ("raises", Scripted(boom, ok_score), "error"),
    ("vf_error", Scripted(library_error, ok_score), "error"),
    ("garbage", Scripted(lambda m: 42, ok_score), "error"),
    ("nan", Scripted(lambda m: [vf.UserMessage(content="x")], lambda completion, **kw: math.nan), "error"),
    ("rewrites", Scripted(lambda m: [vf.UserMessage(content="x")], ok_score), "error"),
    ("hangs", Scripted(lambda m: [vf.UserMessage(content="x")], ok_score), "timeout"),
])
def test_a_bad_verifiers_env_ends_one_episode_with_a_reason(name, env, reason, monkeypatch):
    if name == "rewrites":  # the environment shows the policy a conversation other than the one it played
        async def rewritten(state):
            return [vf.UserMessage(content="a different start")] * (2 + len(state["trajectory"]))
        monkeypatch.setattr(env, "get_prompt_messages", rewritten)
    if name == "hangs":
        import asyncio

        async def forever(messages, state, **kwargs):
            await asyncio.sleep(3600)
        monkeypatch.setattr(env, "env_response", forever)
    with pytest.raises(EnvFailure) as failure:
        episode(name, env, timeout_s=2)
    assert failure.value.reason == reason and failure.value.call == "step", failure.value
    # the next episode of a sound environment plays on
    assert episode("good-after", Scripted(lambda m: [vf.UserMessage(content="again")], ok_score))[-1].reward == 0.5


def test_loading_a_verifiers_env_keeps_the_process_signals_and_works_in_a_thread():
    """verifiers' Environment sets the process's SIGINT/SIGTERM handlers when built (and raises outside the main
    thread, where an explorer's episode builds it): the adapter keeps tandem's."""
    import signal
    import threading

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    verifiers_env._loaded.pop(TINY_ENV, None)
    errors = []

    def load():
        try:
            verifiers_env.load(TINY_ENV)
        except RuntimeError as e:
            errors.append(e)

    thread = threading.Thread(target=load)
    thread.start()
    thread.join(60)
    verifiers_env._loaded.pop(TINY_ENV, None)
    verifiers_env.load(TINY_ENV)  # in the main thread too
    assert not errors and (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before, errors


def test_an_unknown_verifiers_env_is_a_one_line_error():
    with pytest.raises(SystemExit, match=r"verifiers:no_such_env_module: ValueError: Could not import"):
        verifiers_env.verifiers_task_list("no_such_env_module", 1, 0, "t-")


# ------------------------------------------------------------------------------------------------ OpenEnv
def openenv_episode(where: str, timeout_s: float = 20):
    if not openenv_env.is_url(where):  # started first: a server's start (~10 s on 2 busy cores) is no step's time
        openenv_env.serve_module(where)
    task = openenv_env.make_openenv_task(random.Random(0), 0, 0, where)
    ep = EpisodeEnv("openenv", {}, timeout_s)
    try:
        first, last = ep.reset(task)[0], ep.step("hello")
    except EnvFailure:
        ep.close_quietly = True
        raise
    finally:
        try:
            ep.close()
        except EnvFailure:  # after a failed step, the step's failure is the one the test is about
            if not getattr(ep, "close_quietly", False):
                raise
    return first, last


BAD = "tests.openenv_bad_envs"


def test_openenv_adapter_plays_a_served_module():
    first, last = openenv_episode(f"{BAD}:good")
    assert first == [{"role": "user", "content": "go"}] and (last.reward, last.done) == (0.25, True)


@pytest.mark.parametrize("app,reason", [("raising", "error"), ("hanging", "timeout")])
def test_a_bad_openenv_env_ends_one_episode_with_a_reason(app, reason):
    with pytest.raises(EnvFailure) as failure:
        openenv_episode(f"{BAD}:{app}", timeout_s=3)
    assert failure.value.reason == reason and failure.value.call == "step", failure.value
    assert openenv_episode(f"{BAD}:good")[-1].reward == 0.25  # the next episode plays on


def test_an_openenv_server_that_is_not_there_fails_reset():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(EnvFailure) as failure:
        openenv_episode(f"http://127.0.0.1:{port}", timeout_s=10)
    assert failure.value.call == "reset" and "Failed to connect" in str(failure.value)


def test_garbage_from_an_openenv_server_ends_one_episode():
    """A server that speaks the protocol but answers a step with garbage (OpenEnv's own server cannot send a
    non-finite reward: it serializes NaN as null, which the adapter reads as no reward, 0)."""
    import json
    import threading

    from websockets.sync.server import serve

    answers = iter([{"observation": {"prompt": "go"}, "reward": None, "done": False},
                    {"observation": {"prompt": "x"}, "reward": "lots", "done": False}])

    def handler(ws):
        for raw in ws:
            kind = json.loads(raw)["type"]
            if kind == "close":
                return
            ws.send(json.dumps({"type": "observation", "data": next(answers)}))

    with serve(handler, "127.0.0.1", 0) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        with pytest.raises(EnvFailure) as failure:
            openenv_episode(f"http://127.0.0.1:{server.socket.getsockname()[1]}", timeout_s=10)
        server.shutdown()
    assert failure.value.call == "step" and "reward is 'lots', not a finite number" in str(failure.value)
