"""Tasksets, one registry end to end: `build_tasksets` turns `--taskset` / `--eval-taskset` into (training stream,
held-out list).

- arith, parity                 procedural (common/tasks/procedural.py)
- shapes                        procedural image questions, verifier vision (common/tasks/shapes.py)
- an environment's name, textarena:GAME, reasoning_gym:NAME, A+B mixtures   (common/tasks/named.py)
- a .jsonl file, an HF dataset folder / file / Hub id                      (common/tasks/files.py, hub.py)
- gsm8k, math500, aime2024, aime2025: benchmark presets, held-out only      (common/tasks/presets.py)

Every row is checked when loaded (common/tasks/validate.py); task processors (common/tasks/processors.py) run
later, in the explorer, between the taskset and the workflow.
"""

from __future__ import annotations

import random

from common.tasks.files import load_tasks
from common.tasks.hub import DatasetOptions
from common.tasks.named import MixedStream, is_named_taskset, named_taskset
from common.tasks.presets import is_preset, preset_tasks
from common.tasks.procedural import arithmetic_split, parity_split
from common.tasks.shapes import shapes_split
from common.tasks.stream import TaskStream


def tasksets_of(args, explorer: int = 0):
    """build_tasksets with the run's config; each explorer draws its training stream with its own seed."""
    return build_tasksets(args.taskset, args.eval_taskset, args.difficulty, args.eval_size, args.seed + 1000 * explorer,
                          args.task_sampling, args.curriculum, DatasetOptions.from_args(args), args.dataset_split,
                          args.eval_dataset_split)


def build_tasksets(taskset: str, eval_taskset: str | None, difficulty: int, eval_size: int, seed: int,
                   sampling: str = "uniform", curriculum: bool = False, options=None, split: str = "train",
                   eval_split: str = "test"):
    """(training TaskStream, held-out list) from the config fields of the same names; `options`
    (common/tasks/hub.py DatasetOptions) maps dataset columns, `split` / `eval_split` pick the datasets' splits."""
    if "+" in taskset:  # a mixture: round-robin over its parts
        parts = [p for p in taskset.split("+") if p]
        built = [build_tasksets(p, None, difficulty, max(1, eval_size // len(parts)), seed + k, sampling, curriculum,
                                options, split, eval_split) for k, p in enumerate(parts)]
        train, held_out = MixedStream([s for s, _ in built]), [t for _, h in built for t in h]
    elif taskset == "arith":
        train, held_out = arithmetic_split(seed, difficulty, eval_size, curriculum)
    elif taskset == "parity":
        train, held_out = parity_split(seed, difficulty, eval_size, curriculum)
    elif taskset == "shapes":
        train, held_out = shapes_split(seed, difficulty, eval_size, curriculum)
    elif is_preset(taskset):
        raise SystemExit(f"error: --taskset {taskset}: a benchmark preset is a test set, evaluated, never trained on "
                         f"(pass it as --eval-taskset)")
    elif is_named_taskset(taskset):  # environments' tasksets (common/tasks/named.py)
        train, held_out = named_taskset(taskset, eval_taskset, difficulty, eval_size, seed, sampling, curriculum)
    else:
        tasks = load_tasks(taskset, options, split)
        if eval_taskset is None:  # hold out a seeded sample of the file itself
            if len(tasks) <= eval_size:
                raise SystemExit(f"error: --taskset {taskset}: {len(tasks)} tasks, too few to hold out "
                                 f"--eval-size {eval_size}; pass --eval-size {max(1, len(tasks) // 5)} or "
                                 f"--eval-taskset")
            order = list(range(len(tasks)))
            random.Random(seed).shuffle(order)
            held_out = [tasks[i] for i in order[:eval_size]]
            tasks = [tasks[i] for i in order[eval_size:]]
        if curriculum:
            for t in tasks:
                if not isinstance(t.get("difficulty"), (int, float)):
                    raise SystemExit(f"error: --curriculum: task {t['id']} in {taskset} has no numeric 'difficulty'")
        train = TaskStream(tasks=tasks, seed=seed, sampling=sampling, curriculum=curriculum)
    if eval_taskset is not None:
        held_out = (preset_tasks(eval_taskset) if is_preset(eval_taskset)
                    else load_tasks(eval_taskset, options, eval_split))[:eval_size]
    return train, held_out


PROCEDURAL_EVAL_SIZE = 48  # a procedural taskset's held-out split when no size is given: a run's --eval-size default


def evaluation_tasks(taskset: str, size: int, seed: int, difficulty: int = 1) -> list[dict]:
    """The tasks an evaluation of `taskset` runs (eval.py): a preset's or a dataset's first `size` (0: all of them),
    or a procedural taskset's held-out split of `size` tasks (0: 48), the very tasks a run with that --seed,
    --difficulty and --eval-size holds out."""
    if is_preset(taskset):
        tasks = preset_tasks(taskset)
    elif taskset in ("arith", "parity", "shapes") or is_named_taskset(taskset) or "+" in taskset:
        return build_tasksets(taskset, None, difficulty, size or PROCEDURAL_EVAL_SIZE, seed)[1]
    else:
        tasks = load_tasks(taskset, split="test")
    return tasks[:size] if size else tasks
