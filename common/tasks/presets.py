"""Benchmark presets: the test sets people report, by name (`--eval-taskset NAME`, `eval.py --taskset NAME`), each
with its prompt template and answer extraction, verifier math.

- gsm8k       openai/gsm8k (main), test split, 1319 grade-school word problems; the answer after '####'
- math500     HuggingFaceH4/MATH-500, test split, 500 competition problems (LaTeX answers)
- aime2024    HuggingFaceH4/aime_2024, 30 problems, integer answers
- aime2025    opencompass/AIME2025 (AIME2025-I and AIME2025-II), 30 problems, integer answers

`NAME` loads the dataset from the Hub (through the HF cache, so offline a dataset loaded once is read from there);
where that fails it reads `$TANDEM_CACHE/datasets/NAME.jsonl` (default ~/.cache/tandem) if it exists. `NAME:FILE`
reads FILE, a .jsonl / .json / .parquet / .csv with the Hub dataset's columns. The arith held-out split is the
procedural `arith` taskset itself (common/tasks/procedural.py). A preset is a test set: it is evaluated, never
trained on.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from common.model import cache_dir
from common.tasks.files import jsonl_rows
from common.tasks.hub import load_dataset_rows
from common.tasks.validate import validate_task

BOXED = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


@dataclass(frozen=True)
class Preset:
    hub_id: str
    configs: tuple[str | None, ...]  # Hub configurations, concatenated in this order
    split: str
    question: str                    # the column with the problem
    answer: str                      # the column with the reference answer
    answer_regex: str | None = None  # its first group is the answer (GSM8K's worked solutions end in '#### 42')
    template: str = BOXED            # the prompt, {question} replaced

    def task(self, name: str, row: dict, where: str, index: int) -> dict:
        """One dataset row -> a validated math task; one-line errors name the row."""
        if not isinstance(row, dict):
            raise SystemExit(f"error: {where}: a row must be an object with {self.question!r} and {self.answer!r}")
        for column in (self.question, self.answer):
            if column not in row:
                raise SystemExit(f"error: {where}: missing column {column!r} (preset {name} reads "
                                 f"{self.question!r} and {self.answer!r}; the row has {', '.join(map(repr, row))})")
        answer = str(row[self.answer]).strip()
        if self.answer_regex:
            match = re.search(self.answer_regex, answer)
            if match is None:
                raise SystemExit(f"error: {where}: preset {name}: the answer {answer[-60:]!r} does not match "
                                 f"{self.answer_regex!r}")
            answer = match.group(1).strip().replace(",", "")  # GSM8K writes 1,000 in some solutions
        prompt = self.template.format(question=str(row[self.question]).strip())
        return validate_task({"id": f"{name}-{index}", "prompt": prompt, "answer": answer, "reward": "math"}, where)


PRESETS = {
    "gsm8k": Preset("openai/gsm8k", ("main",), "test", "question", "answer", answer_regex=r"####\s*(.+)"),
    "math500": Preset("HuggingFaceH4/MATH-500", (None,), "test", "problem", "answer"),
    "aime2024": Preset("HuggingFaceH4/aime_2024", (None,), "train", "problem", "answer"),
    "aime2025": Preset("opencompass/AIME2025", ("AIME2025-I", "AIME2025-II"), "test", "question", "answer"),
}


def is_preset(taskset: str) -> bool:
    return taskset.partition(":")[0] in PRESETS


def local_copy(name: str) -> str:
    """Where a preset is read from when the Hub cannot give it."""
    return os.path.join(str(cache_dir()), "datasets", f"{name}.jsonl")


def file_rows(path: str):
    """The rows of a local file: .jsonl read here (errors name file:line), other formats by `datasets`."""
    if not path.endswith(".jsonl"):
        return load_dataset_rows(path, "train")
    return [row for _, row in jsonl_rows(path)]


def preset_tasks(taskset: str) -> list[dict]:
    """The tasks of `NAME` (the Hub, else its local copy) or `NAME:FILE`."""
    name, _, path = taskset.partition(":")
    preset = PRESETS[name]
    if path:
        if not os.path.isfile(path):
            raise SystemExit(f"error: --taskset {taskset}: no such file {path}")
        sources = [(path, file_rows(path))]
    else:
        try:
            sources = [(f"{preset.hub_id}{f' ({c})' if c else ''}", load_dataset_rows(preset.hub_id, preset.split, c))
                       for c in preset.configs]
        except SystemExit as hub_error:  # not reachable (offline, not cached): the local copy, if there is one
            if not os.path.isfile(local_copy(name)):
                raise SystemExit(f"error: {name}: from the Hub: {str(hub_error.code).removeprefix('error: ')}; no "
                                 f"local copy at {local_copy(name)} either (or pass {name}:FILE, a file with the "
                                 f"columns {preset.question!r}, {preset.answer!r})") from None
            sources = [(local_copy(name), file_rows(local_copy(name)))]
    tasks = []
    for source, rows in sources:
        tasks += [preset.task(name, row, f"{source}: row {i}", len(tasks) + i) for i, row in enumerate(rows)]
    if not tasks:
        raise SystemExit(f"error: --taskset {taskset}: no rows")
    return tasks
