"""Code verifier: extract the program from a response and run the task's tests in `rewards.sandbox`.

Task formats:
- HumanEval: `prompt` (signature + docstring), `test` (defines `check(candidate)`), `entry_point`. The program is
  prompt + completion when the response continues the function body, or prompt + the response's code when it
  writes the whole function (the prompt stays in front for its imports and helpers; the later `def` wins). One
  sandbox run with a judge: pass_frac is 0 or 1.
- stdin/stdout: `tests: [{"input": str, "output": str}, ...]`; one run per case, outputs compared line by line
  with trailing whitespace ignored. pass_frac = passed / total.
Score 1 iff every test passes. Optional task fields: `timeout_s` (per run, default 4), `budget_s` (all runs of one
response, default 8: a run is not started unless it can finish within it, so that the RewardPool timeout
(default 10 s) is not hit), `memory_mb`.

Why a verdict cannot be forged (the design; an RL policy searches for holes in the verifier and finds them):
- HumanEval: the program's process holds only its own definitions. The test runs in a separate judge process
  (rewards/_sandbox_harness.py) that calls the candidate's entry point through a pipe, one call at a time, and
  gets back each return value as JSON of exact builtin types, decoded strictly (`from_tree`): an object with a
  lying `__eq__`, a subclass of int or str, anything that is not plain data, cannot reach the test's `==`; the
  test's comparisons run in the judge on the judge's own objects. Whatever goes wrong while the judge handles
  what the candidate sent (parsing, decoding, re-encoding it as an argument: a TypeError of an unhashable key,
  an OverflowError, a RecursionError of deep nesting) is the candidate's failure, raised as a BaseException that
  the test's `except Exception` cannot swallow; and an exception that the test's own code catches (it skips an
  input with `except Exception: continue`, or catches even BaseException) fails the verdict. The test code, its
  expected values, the nonce and the verdict pipe exist only in the judge (the spec comes in through a memfd
  that the candidate closes before its first line runs; the judge reads it only after forking the candidate).
  The judge runs under another uid than the program (as root; in a user namespace the program has no
  capabilities), is non-dumpable
  (no /proc/<pid>/mem, fd or environ access), is PID 1 of the sandbox (immune to the program's signals), and the
  seccomp filter forbids ptrace and process_vm_*. The verdict counts only if the judge saw `check` return after
  at least one call, and it carries the run's random nonce; exit status and stdout play no part, so
  SystemExit(0), atexit/os._exit, exception hooks, threads, os.execv and re-running with -O (asserts off) all
  fail. Tracing, builtins or sys.modules patches act only on the program's own process.
  What this asks of honest programs: the entry point returns plain data (None, bool, int, float, complex, str,
  bytes, and lists, tuples, sets, frozensets, dicts of them: not numpy scalars or own classes); changes it makes
  to its arguments in place are not seen by the test; the test's other names (helpers such as HumanEval's `poly`)
  are the prompt's own definitions, not the program's. All 164 HumanEval canonical solutions pass this way.
- stdin/stdout: the expected output stays in this process and is compared here; the program sees only its
  input. It must also exit 0 (printing the answer and exiting is the legitimate way).
- The sandbox's file system holds only the Python installation and the working directory: task files, the
  project and other runs' files are not there to read.
What it still cannot stop: a program that special-cases the visible inputs (HumanEval's tests are public and a
model may have memorised them: hold out your own tests for that); a test that is weak (few cases, loose
tolerance, or fooled by a plain value it computes with without raising); timing side channels; and
kernel bugs (seccomp and namespaces shrink the attack surface, they do not remove it). stdin tasks additionally
trust the exit status as "ran to the end", which a program can only game by printing the right answer.
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
    """The candidate's definitions only (the test goes to the judge, never into the program)."""
    entry = task["entry_point"]
    if re.search(rf"^def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
        return task["prompt"] + "\n\n" + code + "\n"  # a whole function: it replaces the prompt's stub
    return task["prompt"] + code + "\n"  # a continuation of the prompt's function body


def same_output(got: str, expected: str) -> bool:
    def norm(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]
    return norm(got) == norm(expected)


def score(response: str, task: dict):
    code = extract_code(response)
    if not code.strip():
        return Reward(0.0, {"reason": "no code", "format_ok": False, "pass_frac": 0.0})
    limits = Limits(timeout_s=float(task.get("timeout_s", 4.0)), memory_mb=int(task.get("memory_mb", 1024)))
    if "entry_point" in task:
        result = run(humaneval_program(code, task), limits=limits, harness=task)
        ok = result.passed
        reason = "passed" if ok else result.reason if result.verdict is None or result.limit or result.timed_out \
            else result.verdict["reason"]
        return Reward(float(ok), {"reason": reason if reason != "ok" else "no verdict", "pass_frac": float(ok),
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
