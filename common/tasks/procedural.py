"""Procedural tasksets, endless and seeded, each with a fixed held-out split: `arith` (word problems, levels 1-4,
verifier math) and `parity` (the smoke task, verifier parity)."""

from __future__ import annotations

import random

from common.tasks.stream import TaskStream

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


def arithmetic_split(seed: int, difficulty: int, eval_size: int,
                     curriculum: bool = False) -> tuple[TaskStream, list[dict]]:
    """(endless training stream, fixed held-out list at `difficulty`); held-out prompts never appear in training.
    With `curriculum` the stream draws levels 1..difficulty (see TaskStream)."""
    rng = random.Random(f"arith-eval-{seed}")
    eval_tasks = []
    for i in range(eval_size):
        task = arithmetic_task(rng, difficulty)
        eval_tasks.append({**task, "id": f"arith-eval-{i}"})
    held_out = {t["prompt"] for t in eval_tasks}

    def generate(rng: random.Random, index: int, level: int) -> dict:
        while True:
            task = arithmetic_task(rng, level)
            if task["prompt"] not in held_out:
                return {**task, "id": f"arith-{index}"}

    levels = list(range(1, difficulty + 1)) if curriculum else [difficulty]
    return TaskStream(generator=generate, seed=seed, levels=levels, curriculum=curriculum), eval_tasks


def parity_split(seed: int, difficulty: int, eval_size: int,
                 curriculum: bool = False) -> tuple[TaskStream, list[dict]]:
    """The smoke-test taskset (`--taskset parity`, reward rewards/parity.py): write characters whose code points
    are even (or odd). Its reward is a property of the sampled tokens, so a random model already gets mixed
    rewards and every end-to-end test computes a real policy gradient. Level d asks for 4d..8d characters."""
    def task(rng: random.Random, index: int, level: int, prefix: str = "parity") -> dict:
        parity = rng.choice(["even", "odd"])
        n = rng.randint(4 * level, 8 * level)
        return {"id": f"{prefix}-{index}", "reward": "parity", "parity": parity, "difficulty": level,
                "prompt": f"Write {n} characters, each with an {parity} Unicode code point (for example "
                          f"{'b, d, f' if parity == 'even' else 'a, c, e'})."}

    rng = random.Random(f"parity-eval-{seed}")
    levels = list(range(1, difficulty + 1)) if curriculum else [difficulty]
    held_out = [task(rng, i, difficulty, prefix="parity-eval") for i in range(eval_size)]
    return TaskStream(generator=task, seed=seed, levels=levels, curriculum=curriculum), held_out
