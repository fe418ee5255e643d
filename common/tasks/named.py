"""Procedural tasksets of the environments, by name (`--taskset NAME`), and the mixture of several (`--taskset A+B`,
built by common/tasks/__init__.py):

- guess_number          guess a secret number with higher/lower replies (--difficulty: range 1..2^(d+2))
- calculator            the arithmetic word problems with calculator + sandboxed Python tools, verifier math
- retry                 the arithmetic word problems, a wrong answer gets feedback and another attempt
- textarena:GAME[,GAME] TextArena single-player games (e.g. textarena:GuessTheNumber-v0), the library's reward
- reasoning_gym:NAME[,NAME]  reasoning-gym datasets, its score_answer as the verifier
- A+B                   round-robin over the tasksets A and B (any of the above, arith, or a .jsonl file):
                        e.g. arith+guess_number mixes single- and multi-turn tasks in every batch
"""

from __future__ import annotations

import json
import os
import random

from common.tasks.stream import TaskStream

ENV_TASKSETS = ("guess_number", "calculator", "retry")
REASONING_GYM_SIZE = 512  # questions drawn per dataset for training (the held-out ones use another seed)


def _generator(name: str):
    if name == "guess_number":
        from common.envs.guess_number import guess_number_task as fn
    elif name == "calculator":
        from common.envs.calculator import calculator_task as fn
    else:
        from common.envs.retry import retry_task as fn
    return fn


def is_named_taskset(taskset: str) -> bool:
    return taskset in ENV_TASKSETS or taskset.startswith(("textarena:", "reasoning_gym:"))


def taskset_has_envs(taskset: str) -> bool:
    """Whether a --taskset has multi-turn (env) tasks, without building it (files: any row with an "env")."""
    for part in taskset.split("+"):
        if part in ENV_TASKSETS or part.startswith(("textarena:", "reasoning_gym:")):
            return True
        if part.endswith(".jsonl") and os.path.exists(part):
            with open(part) as f:
                for line in f:
                    try:
                        row = json.loads(line) if line.strip() else {}
                    except json.JSONDecodeError:
                        continue  # load_jsonl reports it with its line number
                    if isinstance(row, dict) and "env" in row:
                        return True
    return False


class MixedStream:
    """Round-robin over several TaskStreams: index i of the mixture is index i // k of stream i % k."""

    def __init__(self, streams: list):
        self.streams = streams
        self.position = 0
        self.levels = sorted({lvl for s in streams for lvl in s.levels})

    @property
    def tasks(self) -> list[dict]:
        """The tasks of the finite streams (files) in the mixture."""
        return [t for s in self.streams for t in (s.tasks or [])]

    def next_batch(self, n: int, progress: float = 1.0) -> list[dict]:
        out = []
        for i in range(self.position, self.position + n):
            stream = self.streams[i % len(self.streams)]
            stream.position = i // len(self.streams)
            out += stream.next_batch(1, progress)
        self.position += n
        return out

    def open_levels(self, progress: float) -> list:
        return sorted({lvl for s in self.streams for lvl in s.open_levels(progress)}) or [0]

    def record(self, task_id: str, successes: list[bool]) -> None:
        for s in self.streams:
            s.record(task_id, successes)


def named_taskset(taskset: str, eval_taskset, difficulty: int, eval_size: int, seed: int, sampling: str,
                  curriculum: bool):
    """(training stream, held-out list) of an environment's taskset."""
    if taskset.startswith("reasoning_gym:"):
        from common.envs.reasoning_gym_env import reasoning_gym_tasks

        names = [n for n in taskset.split(":", 1)[1].split(",") if n]
        train = reasoning_gym_tasks(names, REASONING_GYM_SIZE, seed, "rg-")
        held_out = reasoning_gym_tasks(names, max(1, eval_size // len(names)), seed + 10_007, "rg-eval-")
        return TaskStream(tasks=train, seed=seed, sampling=sampling), held_out[:eval_size]
    if taskset.startswith("textarena:"):
        from common.envs.textarena_env import textarena_task

        games = [g for g in taskset.split(":", 1)[1].split(",") if g]

        def fn(rng, index, level):
            return textarena_task(games[index % len(games)], rng.randint(0, 2**31 - 1), index)
    else:
        fn = _generator(taskset)
    eval_rng = random.Random(f"{taskset}-eval-{seed}")
    held_out = [{**fn(eval_rng, i, difficulty), "id": f"{taskset}-eval-{i}"} for i in range(eval_size)]
    levels = list(range(1, difficulty + 1)) if curriculum else [difficulty]
    return TaskStream(generator=fn, seed=seed, levels=levels, curriculum=curriculum), held_out
