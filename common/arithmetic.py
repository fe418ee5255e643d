"""Arithmetic word problems, levels 1-4 (verifier math): the `arith` taskset (common/tasks/procedural.py) and the
calculator and retry environments (common/envs/) ask them."""

from __future__ import annotations

import random

# A worked line in the instruction: the 135M default model follows a shown format far more often than a described
# one (greedy accuracy at level 1: 0.00 with the description alone, 0.31 with the example; see README).
ANSWER_FORMAT = "Reply with one short line of working, then 'Answer: <number>'. Example: 3 + 4 = 7. Answer: 7"
NAMES = ["Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Max", "Nia", "Omar"]
ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cards", "shells", "stamps", "cookies"]


def arithmetic_task(rng: random.Random, difficulty: int) -> dict:
    """One word problem. Levels: 1 a+b (1-2 digits); 2 a+b-c (2 digits); 3 a*b+c; 4 (a+b)*c-d (larger numbers)."""
    name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    if difficulty <= 1:
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        text, answer = f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} does {name} have now?", a + b
    elif difficulty == 2:
        a, b = rng.randint(10, 60), rng.randint(5, 40)
        c = rng.randint(1, a + b - 1)
        text = (f"{name} has {a} {item} and finds {b} more, then gives {c} to {other}. "
                f"How many {item} does {name} have left?")
        answer = a + b - c
    elif difficulty == 3:
        a, b, c = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 30)
        text = f"{name} buys {a} bags with {b} {item} each and already had {c}. How many {item} does {name} have?"
        answer = a * b + c
    else:
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(2, 9)
        d = rng.randint(1, (a + b) * c - 1)
        text = (f"{name} and {other} pool {a} and {b} {item}, then {c} friends each get that many. "
                f"{d} are lost. How many {item} remain?")
        answer = (a + b) * c - d
    return {"prompt": f"{text}\n{ANSWER_FORMAT}", "answer": str(answer), "reward": "math", "difficulty": difficulty}
