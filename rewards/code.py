"""Code verifier: extract the program from a response and run the task's tests in `rewards.sandbox`.

Task formats:
- HumanEval: `prompt` (signature + docstring), `test` (defines `check(candidate)`), `entry_point`. The program is
  prompt + completion when the response continues the function body, or prompt + the response's code when it
  writes the whole function (the prompt stays in front for its imports and helpers; the later `def` wins). Then
  the test and `check(<entry_point>)`. One sandbox run: pass_frac is 0 or 1.
- stdin/stdout: `tests: [{"input": str, "output": str}, ...]`; one run per case, outputs compared line by line
  with trailing whitespace ignored. pass_frac = passed / total.
Score 1 iff every test passes. Optional task fields: `timeout_s` (per run, default 4), `budget_s` (all runs of one
response, default 8: a run is not started unless it can finish within it, so that the RewardPool timeout
(default 10 s) is not hit), `memory_mb`.
"""

from __future__ import annotations

import re
import time

from rewards.base import Reward
from rewards.sandbox import Limits, run

FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
OPEN_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*)$", re.DOTALL | re.IGNORECASE)


def extract_code(response: str) -> str:
    """The last fenced code block (```python, ```py or bare ```), an unclosed last fence (generation cut off),
    or the whole response as bare code."""
    blocks = FENCE.findall(response)
    if blocks:
        return blocks[-1]
    tail = OPEN_FENCE.search(response)
    if tail:
        return tail.group(1)
    return response


def humaneval_program(code: str, task: dict) -> str:
    entry = task["entry_point"]
    if re.search(rf"^def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
        body = task["prompt"] + "\n\n" + code  # a whole function: it replaces the prompt's stub
    else:
        body = task["prompt"] + code  # a continuation of the prompt's function body
    return f"{body}\n\n{task['test']}\n\ncheck({entry})\n"


def same_output(got: str, expected: str) -> bool:
    def norm(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]
    return norm(got) == norm(expected)


def _limits(task: dict) -> Limits:
    return Limits(timeout_s=float(task.get("timeout_s", 4.0)), memory_mb=int(task.get("memory_mb", 1024)))


def score(response: str, task: dict):
    code = extract_code(response)
    if not code.strip():
        return Reward(0.0, {"reason": "no code", "format_ok": False, "pass_frac": 0.0})
    limits = _limits(task)
    if "entry_point" in task:
        result = run(humaneval_program(code, task), limits=limits)
        ok = result.ok
        return Reward(float(ok), {"reason": "passed" if ok else result.reason, "pass_frac": float(ok),
                                  "format_ok": True, "sandbox": result.mode, "duration_s": result.duration_s})
    tests = task.get("tests")
    if not tests:
        raise ValueError(f"task {task.get('id')}: a code task needs `entry_point`+`test` (HumanEval) or `tests`")
    budget, start = float(task.get("budget_s", 8.0)), time.monotonic()
    passed, first_failure, mode = 0, None, ""
    for k, case in enumerate(tests):
        if k and time.monotonic() - start + limits.timeout_s > budget:  # stay inside the pool's timeout
            first_failure = first_failure or f"time budget of {budget:g}s used up after {k} of {len(tests)} tests"
            break
        result = run(code, stdin=str(case.get("input", "")), limits=limits)
        mode = result.mode
        if result.ok and same_output(result.stdout, str(case["output"])):
            passed += 1
            continue
        first_failure = first_failure or (f"test {k}: " + (result.reason if not result.ok else "wrong output"))
        if result.timed_out:  # later cases would likely time out too: stop and count them as failed
            break
    frac = passed / len(tests)
    return Reward(float(passed == len(tests)), {"reason": first_failure or "passed", "pass_frac": frac,
                                                "passed": passed, "total": len(tests), "format_ok": True,
                                                "sandbox": mode})
