"""Retry (`--taskset retry`): an arithmetic word problem; a wrong answer gets "not correct, try again" and another
attempt (up to the task's "attempts", default 3, and --max-turns). Reward 1 for a correct answer, discounted by
`retry_discount` per earlier wrong attempt (so answering right the first time is worth the most)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from common.arithmetic import arithmetic_task
from common.envs import Env, EnvSettings, StepResult
from rewards.math import extract_answer


def numbers_match(response: str, answer: str) -> bool:
    """The last 'Answer: x' (or \\boxed{x}, or last number) of `response` equals the numeric `answer`."""
    pred = extract_answer(response)
    if pred is None:
        found = re.findall(r"-?\d+(?:\.\d+)?", response)
        pred = found[-1] if found else None
    if pred is None:
        return False
    pred = pred.strip().rstrip(".").replace(",", "")
    try:
        return abs(float(pred) - float(answer)) < 1e-9
    except ValueError:
        return pred == str(answer).strip()


def retry_task(rng: random.Random, index: int, difficulty: int, arg: str | None = None) -> dict:
    task = arithmetic_task(rng, difficulty)
    task.pop("reward")  # the environment scores the answer itself
    return {**task, "id": f"retry-{index}", "env": "retry", "attempts": 3}


@dataclass
class RetrySettings(EnvSettings):
    retry_discount: float = 0.5
    """a correct answer after k wrong ones is worth retry_discount**k"""


class Retry(Env):
    Settings = RetrySettings
    required_fields = ("answer",)
    make_task = staticmethod(retry_task)

    def reset(self, task: dict) -> list[dict]:
        self.answer, self.attempts, self.tries = str(task["answer"]), int(task.get("attempts", 3)), 0
        return list(task.get("messages") or [{"role": "user", "content": task["prompt"]}])

    def step(self, action: str) -> StepResult:
        self.tries += 1
        if numbers_match(action, self.answer):
            return StepResult([], self.settings.retry_discount ** (self.tries - 1), True, {"success": True})
        if self.tries >= self.attempts:
            return StepResult([], 0.0, True, {"success": False})
        return StepResult([{"role": "user", "content": "That is not correct. Try again."}], 0.0, False, {})
