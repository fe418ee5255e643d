"""Tasks from files: a tandem .jsonl (errors name file:line) or any HF dataset source (common/tasks/hub.py)."""

from __future__ import annotations

import json
import os

from common.knobs import read_utf8_lines
from common.tasks.hub import DatasetOptions, load_dataset_tasks


def jsonl_rows(path: str) -> list[tuple[int, object]]:
    """(line number, value) of every non-empty line of a .jsonl file; one-line errors name file:line (not UTF-8,
    not JSON)."""
    rows = []
    for lineno, line in enumerate(read_utf8_lines(path), 1):
        try:
            rows += [(lineno, json.loads(line))] if line.strip() else []
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: {path}:{lineno}: not valid JSON ({e.msg})") from None
    return rows


def load_jsonl(path: str, options=None) -> list[dict]:
    """A tandem .jsonl file, one task per line; `options` (common/tasks/hub.py DatasetOptions) maps other columns."""
    options = options or DatasetOptions()
    tasks = []
    for lineno, row in jsonl_rows(path):
        task = options.to_task(row, f"{path}:{lineno}")
        task["id"] = str(task.get("id", f"{os.path.basename(path)}:{lineno}"))
        tasks.append(task)
    if not tasks:
        raise SystemExit(f"error: {path}: no tasks in file")
    return tasks


def load_tasks(path: str, options=None, split: str = "train") -> list[dict]:
    """A .jsonl file (errors name file:line) or any HF dataset source, rows mapped by `options`."""
    if path.endswith(".jsonl") and os.path.isfile(path):
        return load_jsonl(path, options)
    return load_dataset_tasks(path, split, options)  # a dataset folder, a data file or a Hub id
