"""Run set-up and wrap-up shared by the entry scripts (launcher process only)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

from common.config import ConfigError
from common.engine import resolve_engine
from common.metrics import plot_reward_curve, read_metrics, write_timeline
from common.model import resolve_model
from common.tasks import build_tasksets
from common.trainer import latest_checkpoint


def prepare_run(args, schedule: str) -> None:
    """Resolve the model (converting the default once, before any worker starts), check and create out_dir."""
    if not args.out_dir:
        args.out_dir = os.path.join("runs", f"{schedule}-{time.strftime('%Y%m%d-%H%M%S')}")
    model_path = resolve_model(args.model)
    args.engine, why = resolve_engine(args.engine, model_path)  # the workers get hf or vllm, never auto
    print(f"[tandem] {schedule}: rollout engine {args.engine} ({why})", flush=True)
    if getattr(args, "critic_model", None):
        resolve_model(args.critic_model, "--critic-model")
    train, held_out = build_tasksets(args.taskset, args.eval_taskset, args.difficulty, args.eval_size, args.seed,
                                     args.task_sampling, args.curriculum)  # bad rows fail here
    if not args.rm_model and any(t["reward"] == "rm" and not t.get("rm_model") for t in (train.tasks or []) + held_out):
        raise ConfigError("--taskset has tasks with reward 'rm' that name no rm_model: pass --rm-model")
    if args.resume and latest_checkpoint(args.out_dir) is None:
        raise ConfigError(f"--resume: no checkpoint in {args.out_dir}/checkpoints")
    if not args.resume and os.path.exists(os.path.join(args.out_dir, "metrics.jsonl")):
        if not args.overwrite:
            raise ConfigError(f"--out-dir {args.out_dir} already holds a run; pass --resume to continue it or "
                              "--overwrite to replace it")
        shutil.rmtree(args.out_dir)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump({"schedule": schedule, **dataclasses.asdict(args)}, f, indent=2)


def threads_per_worker(args, num_workers: int) -> int:
    """torch threads per worker when workers run at the same time: the cores split evenly (at least one)."""
    return args.num_threads or max(1, (os.cpu_count() or 1) // num_workers)


def finish_run(args, title: str) -> None:
    """timeline.json/png and reward.png from what the workers wrote; a one-paragraph summary on stdout."""
    write_timeline(args.out_dir, title=title)
    plot_reward_curve(args.out_dir)
    rows = read_metrics(args.out_dir)
    summary_path = os.path.join(args.out_dir, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    if rows:
        rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]  # partial rollouts: early steps may train none
        reward = f"{rewards[0]:.3f} -> {rewards[-1]:.3f}" if rewards else "none (no batch finished)"
        print(f"[tandem] {len(rows)} steps in {rows[-1]['time/elapsed']:.0f}s; reward {reward}; "
              f"held-out accuracy {summary.get('eval_before')} -> "
              f"{summary.get('eval_after')}; outputs in {args.out_dir}")
