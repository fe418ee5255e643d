"""Guess the number (`--taskset guess_number`): the model guesses a secret integer, the environment answers
"higher" or "lower". Feedback matters: a policy that reads it needs about log2(range) turns, one that ignores it
far more. Reward 1 when the number is found (within --max-turns), else 0."""

from __future__ import annotations

import random
import re

from common.envs import Env, StepResult

NUMBER = re.compile(r"-?\d+")


def guess_number_task(rng: random.Random, index: int, difficulty: int, arg: str | None = None) -> dict:
    """Level 1: 1..8, 2: 1..16, 3: 1..32, 4: 1..64."""
    high = 2 ** (difficulty + 2)
    return {"id": f"guess-{index}", "env": "guess_number", "high": high, "secret": rng.randint(1, high),
            "difficulty": difficulty}


class GuessNumber(Env):
    required_fields = ("secret",)
    make_task = staticmethod(guess_number_task)

    def reset(self, task: dict) -> list[dict]:
        self.secret, self.high = int(task["secret"]), int(task.get("high", 16))
        self.guesses = 0
        return [{"role": "user", "content": f"Guess my secret number between 1 and {self.high}. I will say higher "
                                            f"or lower. Reply with one number."}]

    def step(self, action: str) -> StepResult:
        numbers = NUMBER.findall(action)
        if not numbers:
            return StepResult([{"role": "user", "content": "Reply with one number."}], 0.0, False,
                              {"invalid": True, "format_ok": False})
        guess = int(numbers[-1])
        self.guesses += 1
        if guess == self.secret:
            return StepResult([], 1.0, True, {"success": True, "guesses": self.guesses, "format_ok": True})
        hint = "Higher." if guess < self.secret else "Lower."
        return StepResult([{"role": "user", "content": hint}], 0.0, False, {"format_ok": True})
