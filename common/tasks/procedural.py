"""Procedural tasksets, endless and seeded, each with a fixed held-out split: `arith` (word problems, levels 1-4,
verifier math) and `parity` (the smoke task, verifier parity)."""

from __future__ import annotations

import random

from common.arithmetic import arithmetic_task
from common.tasks.stream import TaskStream


def held_out_split(name: str, make, key: str, seed: int, difficulty: int, eval_size: int,
                   curriculum: bool = False) -> tuple[TaskStream, list[dict]]:
    """(endless training stream of `make(rng, level)`'s tasks, fixed held-out list at `difficulty`); no training
    task has a held-out task's `key` (its prompt, its image). With `curriculum` the stream draws levels
    1..difficulty (see TaskStream)."""
    rng = random.Random(f"{name}-eval-{seed}")
    eval_tasks = [{**make(rng, difficulty), "id": f"{name}-eval-{i}"} for i in range(eval_size)]
    held_out = {t[key] for t in eval_tasks}

    def generate(rng: random.Random, index: int, level: int) -> dict:
        while True:
            task = make(rng, level)
            if task[key] not in held_out:
                return {**task, "id": f"{name}-{index}"}

    return TaskStream(generator=generate, seed=seed, difficulty=difficulty, curriculum=curriculum), eval_tasks


def arithmetic_split(seed: int, difficulty: int, eval_size: int,
                     curriculum: bool = False) -> tuple[TaskStream, list[dict]]:
    """The arith taskset; held-out prompts never appear in training."""
    return held_out_split("arith", arithmetic_task, "prompt", seed, difficulty, eval_size, curriculum)


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
    held_out = [task(rng, i, difficulty, prefix="parity-eval") for i in range(eval_size)]
    return TaskStream(generator=task, seed=seed, difficulty=difficulty, curriculum=curriculum), held_out
