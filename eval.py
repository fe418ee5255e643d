"""Evaluate a model, or compare two, on benchmark tasksets: mean@N, pass@k and maj@k with 95% bootstrap intervals.

    python eval.py --model default --taskset arith --samples 8         # the embedded model, arith's held-out split
    python eval.py --model runs/demo/final --taskset gsm8k math500 --samples 4 --max-new-tokens 512
    python eval.py --compare default runs/demo --taskset arith --samples 8   # did it learn? B - A, paired interval

--model takes what a run's --model takes (default, tiny, a local HF folder, a Hub id) and a run: its folder (its
final/), its final/ or one of its checkpoints/step_N/; the run's config.json then gives the sampling (--temperature,
--top-p, --max-new-tokens, where not given here) and its chat template. --samples 1 is greedy, as a run's
evaluation; N > 1 samples N responses a task. The tasks are generated and scored as a run's held-out evaluation
(common/explorer/evaluation.py, `Evaluation`) by an explorer of its own (the same engines, workflows, verifiers and
sandboxes), --batch-size sequences per engine call; the estimators are common/explorer/eval_metrics.py. Both models
of --compare see the same tasks with the same seed. Outputs: the table on stdout, eval.json and eval.md in --out-dir.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import ClassVar, Literal

from common.cli import parse_args
from common.config import CommonArgs
from common.explorer import eval_metrics
from common.knobs import ConfigError, Range, check_numeric_ranges

SAMPLING = ("temperature", "top_p", "max_new_tokens")  # what a run's config.json gives an evaluation of its weights


@dataclass
class Args:
    model: str = "default"
    """The model: 'default', 'tiny', a local HF folder, a Hub id, or a run: its folder, its final/ or one of its
    checkpoints/step_N/ (the run's sampling and chat template come with it)."""
    compare: tuple[str, ...] = ()
    """Two models A B (each as --model takes it; --model is then unused), evaluated on the same tasks with the same
    seed: the scores of each, and B - A with a paired bootstrap interval."""
    taskset: tuple[str, ...] = ("arith",)
    """One or more tasksets: the presets gsm8k, math500, aime2024, aime2025 (from the Hub, else
    $TANDEM_CACHE/datasets/NAME.jsonl; NAME:FILE reads a file in the Hub dataset's columns), arith (the held-out
    split a run with the same --seed and --difficulty holds out), or what a run's --taskset takes (a .jsonl file,
    an HF dataset folder / file / Hub id, an environment's name)."""
    size: int = 0
    """Tasks per taskset: the first N (0: all of a dataset's; procedural tasksets such as arith: 48, a run's
    --eval-size)."""
    samples: int = 1
    """Samples per task: 1 is greedy (a run's evaluation); N > 1 samples at --temperature and reports mean@N and
    pass@k, maj@k for k = 2, 4, ..., N."""
    temperature: float | None = None
    """Sampling temperature with --samples > 1 (default: the run's, else common/config.py's)."""
    top_p: float | None = None
    """Nucleus sampling threshold (default: the run's, else 1.0)."""
    max_new_tokens: int | None = None
    """Longest response in tokens (default: the run's, else common/config.py's 48: raise it for gsm8k, math500,
    aime, e.g. 1024)."""
    difficulty: int = 1
    """Level of the procedural tasksets (arith 1..4, as a run's --difficulty)."""
    seed: int = 0
    """Seeds the procedural held-out split, the sampling and the bootstrap."""
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """Rollout engine, as a run's --engine: auto (vLLM where it imports and serves the model, else HF), hf or vllm."""
    device: str = "cpu"
    """Where the model runs: cpu or cuda[:N]."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the model."""
    batch_size: int = 128
    """Sequences per engine call (tasks x samples); the progress bar moves once per call."""
    resamples: int = 1000
    """Bootstrap resamples of the tasks for each interval."""
    out_dir: str = ""
    """Where eval.json and eval.md go (default: runs/eval-<time>)."""

    RANGES: ClassVar[dict[str, Range]] = {
        "samples": Range(ge=1), "batch_size": Range(ge=1), "resamples": Range(ge=100, why="fewer make the 2.5% "
                                                                                          "quantile a few draws"),
        "temperature": Range(gt=0, why="greedy is --samples 1"), "top_p": Range(gt=0, le=1),
        "max_new_tokens": Range(ge=1), "difficulty": Range(ge=1, le=4, why="the arith levels")}

    def validate(self):
        check_numeric_ranges(self)
        if self.compare and len(self.compare) != 2:
            raise ConfigError(f"--compare takes two models A B (got {len(self.compare)}: {' '.join(self.compare)})")
        if not self.taskset:
            raise ConfigError("--taskset: name at least one taskset")


def explorer_args(args: Args, model: str, run: dict | None, sampling: dict) -> CommonArgs:
    """The configuration of the explorer that evaluates `model`: common/config.py's defaults, the evaluation's own
    fields, and the training stream it builds but never draws from the cheapest procedural one."""
    return CommonArgs(
        model=model, seed=args.seed, engine=args.engine, dtype=args.dtype, out_dir=args.out_dir,
        explorer_devices=args.device, trainer_devices=args.device, taskset="parity", eval_size=1,
        eval_samples=args.samples, samples_per_task=args.samples, tasks_per_step=max(1, args.batch_size // args.samples),
        chat_template=(run or {}).get("chat_template"), **sampling)


def evaluate(args: Args, config: CommonArgs, tasksets: dict[str, list[dict]], bar) -> dict[str, dict]:
    """taskset -> metric -> its value per task (common/explorer/eval_metrics.py per_task) for one model."""
    import torch

    from common.explorer.evaluation import Evaluation
    from common.explorer.explorer import Explorer
    from common.runtime.metrics import Timeline

    explorer = Explorer(config, args.device, Timeline(args.out_dir, "eval"))
    per_call = max(1, args.batch_size // args.samples)
    out = {}
    try:
        for name, tasks in tasksets.items():
            torch.manual_seed(args.seed)  # the HF engine samples from torch's generator: the same draws for A and B
            correct, answers = [], []
            for start in range(0, len(tasks), per_call):
                evaluation = Evaluation(explorer.parts, explorer.version, 0, tasks[start:start + per_call])
                evaluation.generate()
                c, a = evaluation.outcomes()
                correct, answers = correct + c, answers + a
                bar.update(len(c))
            out[name] = eval_metrics.per_task(correct, answers, eval_metrics.report_ks(args.samples), args.seed)
    finally:
        explorer.close()
    return out


def table(models: dict[str, str], results: dict, compared: dict | None) -> str:
    """The markdown table: a row per taskset and metric, a column per model (value [95% interval]), and B - A."""
    labels = list(models)
    names = [f"{label}: {model}" if compared else model for label, model in models.items()]
    names = [f"{name} [95% interval]" for name in names]
    head = ["taskset", "tasks", "metric", *names] + (["B - A (95% paired interval)"] if compared else [])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, by_model in results.items():
        for metric in by_model[labels[0]]:
            cells = [eval_metrics.format_interval(**by_model[label][metric]) for label in labels]
            if compared:
                d = compared[name][metric]
                cells.append(f"{d['value']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]")
            rows.append(f"| {name} | {by_model['tasks']} | {metric} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main():
    from tqdm import tqdm

    from common.explorer.engine import resolve_engine
    from common.model import resolve_model
    from common.preflight import check_machine, check_tasks
    from common.run import check_out_dir, run_of
    from common.tasks import evaluation_tasks

    args = parse_args(Args)
    args.out_dir = args.out_dir or os.path.join("runs", f"eval-{time.strftime('%Y%m%d-%H%M%S')}")
    check_out_dir(args.out_dir)
    models = dict(zip("AB", args.compare)) if args.compare else {args.model: args.model}  # label -> model
    labels = list(models)
    found = [run_of(m) for m in models.values()]
    runs = [run for _, run in found if run]
    sampling = {k: getattr(args, k) if getattr(args, k) is not None else runs[0].get(k, getattr(CommonArgs, k))
                if runs else getattr(CommonArgs, k) for k in SAMPLING}
    tasksets = {name: evaluation_tasks(name, args.size, args.seed, args.difficulty) for name in args.taskset}
    configs = [explorer_args(args, model, run, sampling) for model, run in found]
    for config in configs:  # every one-line error before any model loads
        config.engine, why = resolve_engine(config.engine, resolve_model(config.model))
        check_machine(config)
        check_tasks(config, resolve_model(config.model), [t for ts in tasksets.values() for t in ts], memory=False)
        print(f"[tandem] eval: {config.model}: engine {config.engine} ({why})", flush=True)
    how = "greedy" if args.samples == 1 else ", ".join(f"{k.replace('_', '-')} {v}" for k, v in sampling.items())
    print(f"[tandem] eval: {args.samples} sample(s) a task ({how}), seed {args.seed}; "
          + ", ".join(f"{name} {len(tasks)} tasks" for name, tasks in tasksets.items()), flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    per_task, total = {}, sum(map(len, tasksets.values())) * len(labels)
    with tqdm(total=total, desc="eval", unit="task", dynamic_ncols=True) as bar:
        for label, config in zip(labels, configs):
            per_task[label] = evaluate(args, config, tasksets, bar)
    results = {name: {"tasks": len(tasks), **{label: eval_metrics.summarize(per_task[label][name], args.seed,
                                                                            args.resamples) for label in labels}}
               for name, tasks in tasksets.items()}
    compared = ({name: eval_metrics.compare(per_task[labels[0]][name], per_task[labels[1]][name], args.seed,
                                            args.resamples) for name in tasksets} if args.compare else None)
    markdown = table(models, results, compared)
    report = {"models": models, "samples": args.samples, "sampling": "greedy" if args.samples == 1 else sampling,
              "seed": args.seed, "resamples": args.resamples, "interval": eval_metrics.LEVEL, "results": results,
              "difference": compared, "task_ids": {name: [t["id"] for t in tasks] for name, tasks in tasksets.items()},
              "per_task": per_task}
    with open(os.path.join(args.out_dir, "eval.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(args.out_dir, "eval.md"), "w") as f:
        f.write(markdown + "\n")
    print(markdown)
    print(f"[tandem] eval: outputs in {args.out_dir}", flush=True)


if __name__ == "__main__":
    from common.run import run_entry

    run_entry(main)
