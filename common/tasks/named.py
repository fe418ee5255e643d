"""Procedural tasksets of the environments, by name (`--taskset NAME[:ARG]`), and the mixture of several
(`--taskset A+B`, built by common/tasks/__init__.py). Every environment in common/envs' `ENVS` registry that names
a task generator (`make_task`) or a task list (`task_list`) is a taskset, nothing to add here:

- guess_number          guess a secret number with higher/lower replies (--difficulty: range 1..2^(d+2))
- calculator            the arithmetic word problems with calculator + sandboxed Python tools, verifier math
- retry                 the arithmetic word problems, a wrong answer gets feedback and another attempt
- textarena:GAME[,GAME] TextArena single-player games (e.g. textarena:GuessTheNumber-v0), the library's reward
- reasoning_gym:NAME[,NAME]  reasoning-gym datasets, its score_answer as the verifier
- gem:ENV_ID[,ENV_ID]   GEM environments (pip install --no-deps gem-llm==0.1.0), GEM's rewards
- A+B                   round-robin over the tasksets A and B (any of the above, arith, or a .jsonl file):
                        e.g. arith+guess_number mixes single- and multi-turn tasks in every batch
"""

from __future__ import annotations

import json
import os
import random

from common.envs import ENVS, env_class
from common.tasks.stream import TaskStream

TASK_LIST_SIZE = 512  # tasks drawn from a finite source (reasoning-gym) for training (the held-out: another seed)


def env_taskset(taskset: str):
    """(name, arg, environment class) when `taskset` is NAME or NAME:ARG of an environment with tasks, else None."""
    name, _, arg = taskset.partition(":")
    if name not in ENVS:
        return None
    cls = env_class(name)
    return (name, arg or None, cls) if cls.make_task is not None or cls.task_list is not None else None


def is_named_taskset(taskset: str) -> bool:
    return env_taskset(taskset) is not None


def taskset_has_envs(taskset: str) -> bool:
    """Whether a --taskset has multi-turn (env) tasks, without building it (files: any row with an "env")."""
    for part in taskset.split("+"):
        if is_named_taskset(part):
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
    name, arg, cls = env_taskset(taskset)
    if cls.task_list is not None:
        train = cls.task_list(arg, TASK_LIST_SIZE, seed, f"{name}-")
        held_out = cls.task_list(arg, eval_size, seed + 10_007, f"{name}-eval-")
        return TaskStream(tasks=train, seed=seed, sampling=sampling), held_out[:eval_size]

    def fn(rng, index, level):
        return cls.make_task(rng, index, level, arg)

    fn(random.Random(seed), 0, difficulty)  # a bad ARG is a one-line error now, before any compute
    eval_rng = random.Random(f"{taskset}-eval-{seed}")
    held_out = [{**fn(eval_rng, i, difficulty), "id": f"{taskset}-eval-{i}"} for i in range(eval_size)]
    return TaskStream(generator=fn, seed=seed, difficulty=difficulty, curriculum=curriculum), held_out
