"""Standard environment libraries behind tandem's boundary: verifiers (common/envs/verifiers_env.py), trained end
to end on the tiny model, and its adapter fed environments that raise or return garbage (one episode ends, with
its reason; the next one plays)."""

import math

import pytest

from tests.conftest import TINY, assert_trained, run_script

vf = pytest.importorskip("verifiers")

from common.envs import verifiers_env  # noqa: E402  (after the skip: it needs the library)
from common.envs.boundary import EnvFailure, EpisodeEnv  # noqa: E402

TINY_ENV = "tests.verifiers_tiny_env"


def test_verifiers_env_trains(tmp_path):
    # The random tiny model seldom stops within --max-new-tokens: its cut turns go on, so both turns are played
    # and the rubric scores each episode.
    proc = run_script("train_sync.py", *TINY, "--taskset", f"verifiers:{TINY_ENV}", "--steps", "2",
                      "--truncated-turns", "continue", "--episode-token-budget", "200",
                      "--out-dir", str(tmp_path / "run"), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = assert_trained(tmp_path / "run", steps=2)
    assert all(r["rollout/turns_mean"] == 2 and r["rollout/end/done"] == r["rollout/episodes"] for r in rows), rows
    assert all(0 < r["reward/mean"] < 1 for r in rows)  # the rubric's ASCII share, never an error's 0


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


def test_an_unknown_verifiers_env_is_a_one_line_error():
    with pytest.raises(SystemExit, match=r"verifiers:no_such_env_module: ValueError: Could not import"):
        verifiers_env.verifiers_task_list("no_such_env_module", 1, 0, "t-")
