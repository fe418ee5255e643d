"""Tasks: a seeded procedural arithmetic taskset with a held-out split, and loaders for JSONL and HF datasets.

A task is a dict with `id`, `prompt` (or `messages`), `reward` (the verifier) and the fields that verifier needs.
A bad row fails in one line naming the file, the line (or row) and the missing field.
"""

from __future__ import annotations

import json
import os
import random

from rewards.base import KINDS, missing_fields

# A worked line in the instruction: the 135M default model follows a shown format far more often than a described
# one (greedy accuracy at level 1: 0.00 with the description alone, 0.31 with the example; see README).
ANSWER_FORMAT = "Reply with one short line of working, then 'Answer: <number>'. Example: 3 + 4 = 7. Answer: 7"
WHERE = "_where"  # task key holding the file:line (or row) the task came from
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
                     curriculum: bool = False) -> tuple["TaskStream", list[dict]]:
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
                 curriculum: bool = False) -> tuple["TaskStream", list[dict]]:
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


def validate_task(task: dict, where: str, check_reward: bool = True) -> dict:
    if not isinstance(task, dict):
        raise SystemExit(f"error: {where}: a task must be a JSON object, got {type(task).__name__}")
    if "env" in task:  # a multi-turn row: its environment makes the prompt (common/workflows)
        from common.explorer.rollouts import validate_env_task

        return validate_env_task(task, where)
    if "prompt" not in task and "messages" not in task:
        raise SystemExit(f"error: {where}: missing field 'prompt' (or 'messages')")
    check_prompt_type(task, where)
    kind = task.setdefault("reward", "math")
    if not check_reward:  # --reward-fn scores every task: the kind's fields do not matter
        return task
    if kind not in KINDS:  # the one registry of verifiers: rewards/base.py
        raise SystemExit(f"error: {where}: unknown reward {kind!r} (one of {', '.join(KINDS)})")
    if kind == "code" and not isinstance(task.get("prompt"), str):
        raise SystemExit(f"error: {where}: reward 'code' needs 'prompt' as text (the function it completes)")
    missing = missing_fields(task, kind)
    if missing:
        raise SystemExit(f"error: {where}: missing field {missing[0]} (needed by reward {kind!r})")
    return task


def check_prompt_type(task: dict, where: str) -> None:
    """'prompt' must be non-empty text, or chat messages (a non-empty list of {role, content: text} objects)
    under 'messages' or under 'prompt' (TRL's conversational format; moved to 'messages')."""
    if isinstance(task.get("prompt"), list) and "messages" not in task:
        task["messages"] = task.pop("prompt")
    if task.get("messages") is not None:
        messages = task["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise SystemExit(f"error: {where}: 'messages' must be a non-empty list of "
                             f"{{\"role\": text, \"content\": text}} objects (got {str(messages)[:60]})")
    elif not isinstance(task.get("prompt"), str) or not task["prompt"].strip():
        raise SystemExit(f"error: {where}: 'prompt' must be non-empty text or a list of messages "
                         f"(got {type(task.get('prompt')).__name__} {str(task.get('prompt'))[:40]})")
    task[WHERE] = where  # for errors found later (e.g. a prompt longer than the model's context)


def load_jsonl(path: str, options=None) -> list[dict]:
    """A tandem .jsonl file, one task per line; `options` (common/hub_tasks.DatasetOptions) maps other columns."""
    from common.tasks.hub import DatasetOptions
    from common.knobs import read_utf8_lines

    options = options or DatasetOptions()
    tasks = []
    for lineno, line in enumerate(read_utf8_lines(path), 1):  # `file:line: not UTF-8` on a bad byte
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: {path}:{lineno}: not valid JSON ({e.msg})") from None
        task = options.to_task(row, f"{path}:{lineno}")
        task.setdefault("id", f"{os.path.basename(path)}:{lineno}")
        task["id"] = str(task["id"])
        tasks.append(task)
    if not tasks:
        raise SystemExit(f"error: {path}: no tasks in file")
    return tasks


def load_hf_dataset(path: str, split: str = "train", options=None) -> list[dict]:
    """An HF dataset: a folder (save_to_disk or data files), a data file, or a Hub id (common/tasks/hub.py)."""
    from common.tasks.hub import load_dataset_tasks

    return load_dataset_tasks(path, split, options)


def load_tasks(path: str, options=None, split: str = "train") -> list[dict]:
    """A .jsonl file (errors name file:line) or any HF dataset source, rows mapped by `options`."""
    if path.endswith(".jsonl") and os.path.isfile(path):
        return load_jsonl(path, options)
    return load_hf_dataset(path, split, options)


class TaskStream:
    """Seeded, resumable stream of training tasks: procedural (a generator) or a list.

    A list is cycled in shuffled epochs, unless one of the Kimi k1.5 samplers is on:
    - `sampling="prioritized"`: a task is drawn with weight 1 - its success rate so far (`record`; a task not yet
      tried counts as 0 success, so it has the highest weight); no repeats within a batch while the pool allows;
      when every open task is solved the draw is uniform.
    - `curriculum`: the difficulty levels (sorted, m of them) open from easy to hard over the run: while
      `progress` (trainer steps done / --steps) is in [k/m, (k+1)/m) tasks of the k+1 easiest levels are drawn
      (the easier ones stay in the mix); a procedural stream draws its level uniformly among the open ones.
    """

    def __init__(self, tasks: list[dict] | None = None, generator=None, seed: int = 0, levels: list | None = None,
                 sampling: str = "uniform", curriculum: bool = False):
        self.tasks, self.generator, self.seed = tasks, generator, seed
        self.sampling, self.curriculum = sampling, curriculum
        if levels is None:  # a list's levels matter only to the curriculum (which checked that every task has one)
            levels = sorted({t["difficulty"] for t in tasks}) if curriculum else []
        self.levels = levels
        self.attempts: dict[str, list[int]] = {}  # task id -> [successes, attempts] (prioritized sampling)
        self.position = 0

    def next_batch(self, n: int, progress: float = 1.0) -> list[dict]:
        levels = self.open_levels(progress)
        if self.generator is not None:
            out = [self._generated(self.position + i, levels) for i in range(n)]
        elif self.sampling == "uniform" and not self.curriculum:
            out = [self._shuffled(self.position + i) for i in range(n)]
        else:
            out = self._weighted(n, levels)
        self.position += n
        return out

    def open_levels(self, progress: float) -> list:
        if not self.curriculum:
            return self.levels
        return self.levels[:min(len(self.levels), 1 + int(progress * len(self.levels)))]

    def record(self, task_id: str, successes: list[bool]) -> None:
        """Outcomes of one task's samples (prioritized sampling learns its success rate from them)."""
        if self.sampling == "prioritized":
            counts = self.attempts.setdefault(task_id, [0, 0])
            counts[0] += sum(successes)
            counts[1] += len(successes)

    def success_rate(self, task_id: str) -> float:
        done, tried = self.attempts.get(task_id, (0, 0))
        return done / tried if tried else 0.0

    def _generated(self, index: int, levels: list) -> dict:
        level = random.Random(f"{self.seed}-level-{index}").choice(levels) if self.curriculum else levels[-1]
        return self.generator(random.Random(f"{self.seed}-{index}"), index, level)

    def _shuffled(self, index: int) -> dict:
        epoch, offset = divmod(index, len(self.tasks))
        order = list(range(len(self.tasks)))
        random.Random(f"{self.seed}-epoch-{epoch}").shuffle(order)
        return self.tasks[order[offset]]

    # ALGO LOGIC: Kimi k1.5 prioritized sampling (weight 1 - success rate) over the tasks the curriculum opened
    def _weighted(self, n: int, levels: list) -> list[dict]:
        pool = [t for t in self.tasks if not self.curriculum or t["difficulty"] in levels]
        base = [1.0 - self.success_rate(t["id"]) if self.sampling == "prioritized" else 1.0 for t in pool]
        if not any(base):
            base = [1.0] * len(pool)
        rng, weights, out = random.Random(f"{self.seed}-batch-{self.position}"), list(base), []
        for _ in range(n):
            if not any(weights):  # the pool is smaller than the batch: start drawing again
                weights = list(base)
            i = rng.choices(range(len(pool)), weights=weights)[0]
            out.append(pool[i])
            weights[i] = 0.0
        return out


def build_tasksets(taskset: str, eval_taskset: str | None, difficulty: int, eval_size: int, seed: int,
                   sampling: str = "uniform", curriculum: bool = False, options=None, split: str = "train",
                   eval_split: str = "test"):
    """(training TaskStream, held-out list) from the config fields of the same names; `options`
    (common/hub_tasks.DatasetOptions) maps dataset columns, `split` / `eval_split` pick the datasets' splits."""
    from common.tasks.named import is_named_taskset, named_taskset

    if taskset == "arith":
        train, held_out = arithmetic_split(seed, difficulty, eval_size, curriculum)
    elif taskset == "parity":
        train, held_out = parity_split(seed, difficulty, eval_size, curriculum)
    elif is_named_taskset(taskset):  # environments' tasksets and mixtures A+B (common/tasks/named.py)
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
        held_out = load_tasks(eval_taskset, options, eval_split)[:eval_size]
    return train, held_out
