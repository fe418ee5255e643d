"""Math verifier on a table of answer pairs (both directions), and the reward pool's failure handling."""

import os
import time

import pytest

from rewards import Reward, RewardPool, score
from rewards.math import extract_answer

EQUIVALENT = [("42", "42.0"), ("\\frac{1}{2}", "0.5"), ("1/2", "\\frac{1}{2}"), ("50\\%", "50"),
              ("\\{1, 2\\}", "\\{2, 1\\}"), ("(1, 2]", "(1, 2]"), ("2\\sqrt{2}", "\\sqrt{8}"), ("-3", "-3")]
DIFFERENT = [("42", "41"), ("\\frac{1}{2}", "0.25"), ("(1, 2]", "[1, 2]"), ("\\{1, 2\\}", "\\{1, 3\\}"), ("3", "-3"),
             ("50\\%", "0.5")]  # "%" is a unit (rewards/math.py)


@pytest.mark.parametrize("a,b", EQUIVALENT)
def test_equivalent_pairs_both_directions(a, b):
    assert score(f"so \\boxed{{{a}}}", {"id": "t", "answer": b}).score == 1.0
    assert score(f"Answer: {b}", {"id": "t", "answer": a}).score == 1.0


@pytest.mark.parametrize("a,b", DIFFERENT)
def test_different_pairs_both_directions(a, b):
    assert score(f"\\boxed{{{a}}}", {"id": "t", "answer": b}).score == 0.0
    assert score(f"Answer: {b}", {"id": "t", "answer": a}).score == 0.0


def test_extraction_and_no_answer():
    assert extract_answer("first \\boxed{1} then \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert extract_answer("Answer: 7\nmore text\nanswer: 9.") == "9"
    r = score("I think it is seven", {"id": "t", "answer": "7"})
    assert r.score == 0.0 and r.info["reason"] == "no answer"
    with pytest.raises(ValueError, match="task t9: unknown reward 'poetry'"):
        score("x", {"id": "t9", "answer": "1", "reward": "poetry"})


def hang_or_crash(response: str, task: dict) -> Reward:
    """A hostile verifier for the pool test: hangs, crashes the process, or raises, depending on the response."""
    if response == "hang":
        time.sleep(600)
    if response == "crash":
        os._exit(3)
    if response == "raise":
        raise ZeroDivisionError("bad verifier")
    return score(response, task)


def test_pool_survives_hang_crash_and_raise():
    task = {"id": "t", "answer": "4"}
    with RewardPool(num_workers=2, timeout_s=3, score_fn=hang_or_crash) as pool:
        start = time.time()
        got = pool.score_batch(["Answer: 4", "hang", "crash", "raise", "Answer: 5", "Answer: 4"], [task] * 6)
        assert time.time() - start < 15
        assert [r.score for r in got] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert "timeout" in got[1].info["reason"] and got[2].info["reason"].startswith("verifier crashed")
        assert "ZeroDivisionError" in got[3].info["reason"]
        assert pool.stats["timeouts"] == 1 and pool.stats["crashes"] == 1 and pool.stats["failed"] == 3
        assert [r.score for r in pool.score_batch(["Answer: 4"] * 3, [task] * 3)] == [1.0] * 3  # still serving


def test_score_works_off_the_main_thread():
    """math-verify's own timeouts use SIGALRM (main thread only); ours are disabled, so threads work."""
    import threading

    results = []
    thread = threading.Thread(target=lambda: results.append(score("Answer: 1/2", {"id": "t", "answer": "0.5"})))
    thread.start()
    thread.join(timeout=30)
    assert results and results[0].score == 1.0
