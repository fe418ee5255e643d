"""Environments out of process (common/envs/http_env.py), against a real server started with its one command: the
same seed gives the same episodes in process and over HTTP (observations and ids), tool environments work remotely
(schemas and calls), an environment's error comes back as the episode's error, a server that is not there is a
bounded, counted failure, and a training run with --env-server trains."""

import subprocess
import sys
import time

import pytest
import torch

from common.envs import make_env
from common.explorer.engine import HFEngine, SamplingConfig
from common.explorer.rollouts import run_episodes
from common.explorer.workflow import Context
from common.model import build_tiny_model, build_tiny_tokenizer
from tests.conftest import ROOT, TINY, assert_trained, run_in_process
from tests.test_agents import Scripted


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen([sys.executable, "-m", "common.envs.http_env", "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # "listening on http://127.0.0.1:PORT" once it serves
        assert line.startswith("listening on "), (line, proc.stderr.read() if proc.poll() is not None else "")
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def episodes(ctx, tasks, seed=0):
    tok = ctx.tokenizer
    model = build_tiny_model(tok, seed=0).eval()
    torch.manual_seed(seed)
    groups, _ = run_episodes(HFEngine(model, tok), ctx, tasks, SamplingConfig(temperature=1.0, max_new_tokens=10, n=2))
    return [e for g in groups for e in g.responses]


def test_the_same_seed_gives_the_same_episodes_in_process_and_over_http(server):
    tok = build_tiny_tokenizer()
    tasks = [{"id": f"g{i}", "env": "guess_number", "secret": 3 + i, "high": 8} for i in range(2)]
    kw = dict(max_new_tokens=10, max_turns=3, episode_token_budget=1024, truncated_turns="continue", env_workers=0)
    local = episodes(Context(tok, **kw), tasks)
    remote = episodes(Context(tok, **kw, env_server=server), tasks)
    assert [e.turns for e in local] == [e.turns for e in remote] and max(e.turns for e in local) > 1
    for a, b in zip(local, remote):
        assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids and a.mask == b.mask
        assert a.messages == b.messages and a.turn_rewards == b.turn_rewards and a.end_reason == b.end_reason


def test_a_tool_environment_over_http_and_its_failures(server):
    tok = build_tiny_tokenizer()
    ctx = Context(tok, max_new_tokens=200, max_turns=3, episode_token_budget=8000, env_server=server)
    task = {"id": "c", "env": "calculator", "prompt": "6*7?", "answer": "42", "reward": "math"}
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "6*7"}}</tool_call>'
    (g,), _ = run_episodes(Scripted(tok, [call, "Answer: 42"]), ctx, [task], SamplingConfig(n=1))
    e = g.responses[0]
    assert e.end_reason == "done" and e.tool_calls == 1 and e.final_text == "Answer: 42"
    assert [m for m in e.messages if m["role"] == "tool"][0]["content"] == "42"
    assert '"name":"calculate"' in e.messages[0]["content"]  # the schemas came from the server
    # The environment's own error (a row without its field) ends the episode with the server's one-line reason.
    (g,), _ = run_episodes(Scripted(tok, ["1"]), ctx, [{"id": "bad", "env": "guess_number"}], SamplingConfig(n=1))
    error = g.responses[0].error
    assert g.responses[0].end_reason == "error" and "HTTP 500: reset of environment 'guess_number': KeyError: " \
        "'secret'" in error
    # No server: a bounded number of tries, then that episode fails (counted); nothing hangs.
    env = make_env("guess_number", {"env_server": "http://127.0.0.1:9", "http.retries": 1,
                                    "http.retry_backoff_s": 0.1})
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"after 2 tries"):
        env.reset({"secret": 3})
    assert time.monotonic() - t0 < 10


@pytest.mark.timeout(600)
def test_an_agent_run_against_the_http_environment_trains(server, tmp_path):
    out = tmp_path / "run"
    proc = run_in_process("train_sync.py", *TINY, "--taskset", "guess_number", "--env-server", server, "--steps", "2",
                          "--max-turns", "3", "--episode-token-budget", "400", "--truncated-turns", "continue",
                          "--format-reward", "1", "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = assert_trained(out, steps=2)
    assert all(r["rollout/turns_mean"] > 1 and not r.get("rollout/end/error") for r in rows)
