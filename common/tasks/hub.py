"""Tasks from HF datasets the usual way (as TRL reads them): `--taskset` may be a Hub id (`openai/gsm8k`), a local
dataset folder (`save_to_disk`, or a folder of data files) or a data file (.parquet/.json/.jsonl/.csv), read with
`datasets.load_dataset` / `load_from_disk`. Columns are mapped to a tandem task (`--prompt-column`,
`--answer-column`, `--answer-regex`, `--default-reward`); the split is `--dataset-split`
(`--eval-dataset-split` for `--eval-taskset`) and the configuration `--dataset-config`.

Hub datasets go through the usual HF cache: offline (HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1) a dataset loaded
once before is read from there. Every failure is one line naming the dataset (and the row).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from common.knobs import read_utf8_lines
from common.tasks.validate import validate_task

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
DATA_FILES = {"parquet": "parquet", "json": "json", "jsonl": "json", "csv": "csv", "arrow": "arrow"}


@dataclass(frozen=True)
class DatasetOptions:
    """How dataset rows become tasks (the config fields of the same names)."""
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    answer_regex: str | None = None
    default_reward: str = "math"
    config: str | None = None
    check_reward: bool = True  # False with --reward-fn: the user's function scores every task, whatever its fields

    @classmethod
    def from_args(cls, args) -> "DatasetOptions":
        return cls(args.prompt_column, args.answer_column, args.answer_regex,
                   args.default_reward, args.dataset_config, check_reward=not args.reward_fn)

    def to_task(self, row: dict, where: str) -> dict:
        """One row -> a validated task: the prompt and answer columns renamed, the answer extracted; rows that
        carry 'messages' keep them."""
        if not isinstance(row, dict):
            return validate_task(row, where)  # the one-line error for a non-object row
        task = dict(row)
        if "messages" not in task and (self.prompt_column in task or self.prompt_column != "prompt"):
            if self.prompt_column not in task:
                raise SystemExit(f"error: {where}: missing column {self.prompt_column!r} (--prompt-column; the row "
                                 f"has {', '.join(map(repr, row)) or 'no columns'})")
            prompt = task.pop(self.prompt_column)
            task["prompt"] = prompt  # anything but text (messages, a wrong type) is validate_task's to judge
        if self.answer_column != "answer" and self.answer_column in task:
            task["answer"] = task.pop(self.answer_column)
        if self.answer_regex is not None and "answer" in task:
            match = re.search(self.answer_regex, str(task["answer"]))
            if match is None:
                raise SystemExit(f"error: {where}: --answer-regex {self.answer_regex!r} does not match the answer "
                                 f"{str(task['answer'])[-80:]!r}")
            task["answer"] = match.group(1).strip()
        task.setdefault("reward", self.default_reward)
        return validate_task(task, where, self.check_reward)


def load_dataset_rows(source: str, split: str, config: str | None = None):
    """The `datasets.Dataset` of `source` (a local folder or file, or a Hub id) and `split`."""
    import datasets

    if os.path.isdir(source) and (os.path.exists(os.path.join(source, "dataset_dict.json"))
                                  or os.path.exists(os.path.join(source, "dataset_info.json"))):
        ds = datasets.load_from_disk(source)  # save_to_disk
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split] if split in ds else ds[next(iter(ds))]
        return ds
    if os.path.isfile(source):
        kind = DATA_FILES.get(source.rsplit(".", 1)[-1])
        if kind is None:
            raise SystemExit(f"error: --taskset {source}: unknown dataset format "
                             f"(use .jsonl, .parquet, .json, .csv, .arrow, a dataset folder or a Hub id)")
        if kind in ("json", "csv"):
            read_utf8_lines(source)  # `file:line: not UTF-8` rather than a datasets traceback
        return datasets.load_dataset(kind, data_files=source, split="train")
    if not os.path.isdir(source) and (not HUB_ID.match(source) or source.rsplit(".", 1)[-1] in DATA_FILES):
        raise SystemExit(f"error: --taskset {source}: no such file or folder (nor a Hub dataset id like owner/name)")
    try:  # a Hub id, or a folder of data files
        return datasets.load_dataset(source, config, split=split)
    except (FileNotFoundError, ConnectionError, ValueError) as e:  # not found / offline and not cached / bad split
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"error: --taskset {source}"
                         f"{f' --dataset-config {config}' if config else ''} split {split!r}: {first}") from None


def load_dataset_tasks(source: str, split: str = "train", options: DatasetOptions | None = None) -> list[dict]:
    """Every row of `source`'s `split` as a task; ids are the dataset's own 'id' column or name:split:row."""
    options = options or DatasetOptions()
    ds = load_dataset_rows(source, split, options.config)
    name = os.path.basename(os.path.normpath(source))
    tasks = []
    for i, row in enumerate(ds):
        task = options.to_task(dict(row), f"{source}: {split} row {i}")
        task["id"] = str(task.get("id", f"{name}:{split}:{i}"))
        tasks.append(task)
    if not tasks:
        raise SystemExit(f"error: --taskset {source}: split {split!r} has no rows")
    return tasks
