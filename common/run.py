"""Run set-up and wrap-up shared by the entry scripts (launcher process only)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time

from common.config import ConfigError
from common.explorer.engine import resolve_engine
from common.tasks.hub import DatasetOptions
from common.explorer.rollouts import WORKFLOWS, workflow_name
from common.runtime.launcher import start_quiet_resource_tracker
from common.trainer.checkpoints import MARGIN_BYTES, ensure_free_space, folder_bytes, remove_newer, remove_partial
from common.runtime.metrics import plot_reward_curve, read_metrics, rewind_metrics, write_timeline
from common.model import chat_prompt_ids, load_tokenizer, resolve_model
from common.tasks.named import taskset_has_envs
from common.tasks.validate import WHERE
from common.tasks import build_tasksets
from common.trainer.trainer import latest_checkpoint


def prepare_run(args, schedule: str) -> None:
    """Resolve the model (converting the default once, before any worker starts), check and create out_dir."""
    if not args.out_dir:
        args.out_dir = os.path.join("runs", f"{schedule}-{time.strftime('%Y%m%d-%H%M%S')}")
    check_out_dir(args.out_dir)
    model_path = resolve_model(args.model)
    args.engine, why = resolve_engine(args.engine, model_path)  # the workers get hf or vllm, never auto
    print(f"[tandem] {schedule}: rollout engine {args.engine} ({why})", flush=True)
    if getattr(args, "critic_model", None):
        resolve_model(args.critic_model, "--critic-model")
    train, held_out = build_tasksets(args.taskset, args.eval_taskset, args.difficulty, args.eval_size, args.seed,
                                     args.task_sampling, args.curriculum, DatasetOptions.from_args(args),
                                     args.dataset_split, args.eval_dataset_split)  # bad rows fail here
    check_workflows((train.tasks or []) + held_out)
    check_prompt_lengths(args, (train.tasks or []) + held_out)
    needs_rm = [t for t in (train.tasks or []) + held_out if t.get("reward") == "rm" and not t.get("rm_model")]
    if needs_rm and not args.rm_model and not args.reward_fn:
        raise ConfigError("--taskset has tasks with reward 'rm' that name no rm_model: pass --rm-model")
    if args.resume:
        rewind_to_checkpoint(args)
    if not args.resume and os.path.exists(os.path.join(args.out_dir, "metrics.jsonl")):
        if not args.overwrite:
            raise ConfigError(f"--out-dir {args.out_dir} already holds a run; pass --resume to continue it or "
                              "--overwrite to replace it")
        shutil.rmtree(args.out_dir)
    os.makedirs(args.out_dir, exist_ok=True)
    remove_partial(args.out_dir)  # .tmp-* of saves a killed run never finished
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump({"schedule": schedule, **dataclasses.asdict(args)}, f, indent=2)
    start_quiet_resource_tracker()  # before the entry script's queues: see common/runtime/launcher.py


def check_out_dir(out_dir: str) -> None:
    """--out-dir must be (or become) a folder: not a file, nor under one."""
    path = os.path.abspath(out_dir)
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        what = "is a file" if path == os.path.abspath(out_dir) else f"is under {path}, which is a file"
        raise ConfigError(f"--out-dir {out_dir} {what}, not a folder")
    if not os.access(path, os.W_OK):
        raise ConfigError(f"--out-dir {out_dir}: {path} is not writable")


def rewind_to_checkpoint(args) -> None:
    """--resume: choose the newest checkpoint that verifies (a corrupt newer one is skipped with a warning naming
    the file), drop what came after it (checkpoints and metrics rows, which the resumed run redoes exactly once)
    and check there is room for the next checkpoint, all before any worker starts."""
    remove_partial(args.out_dir)
    path = latest_checkpoint(args.out_dir, warn=True)
    if path is None:
        raise ConfigError(f"--resume: no usable checkpoint in {args.out_dir}/checkpoints (one is saved every "
                          "--checkpoint-every steps, on Ctrl-C, and at the end when the last step is on that grid)")
    step = int(path.rsplit("_", 1)[1])
    remove_newer(args.out_dir, step)
    redone = rewind_metrics(args.out_dir, step)
    print(f"[tandem] resuming from {path}" + (f"; the {redone} metrics rows after step {step} are redone"
                                               if redone else ""), file=sys.stderr, flush=True)
    ensure_free_space(os.path.dirname(path), folder_bytes(path) + MARGIN_BYTES, "the next checkpoint")


def check_workflows(tasks: list[dict]) -> None:
    """A task naming a workflow that does not exist is a one-line error naming its file:line."""
    for task in tasks:
        if workflow_name(task) not in WORKFLOWS:
            raise ConfigError(f"{task.get(WHERE, task.get('id'))}: unknown workflow {task['workflow']!r} "
                              f"(one of {', '.join(WORKFLOWS)})")


def check_episode_prompts(args, tasks: list[dict]) -> None:
    """An environment task whose first prompt (the environment's reset, tools and chat template applied) leaves
    no room for a turn in --episode-token-budget is rejected with file:line, before any compute."""
    from common.explorer.multi_turn import MultiTurn
    from common.explorer.rollouts import Context

    if not (taskset_has_envs(args.taskset) or any("env" in t for t in tasks)):
        return
    ctx = Context.from_args(load_tokenizer(args.model, args.chat_template), args)
    try:
        ctx.renderer
    except ValueError as e:
        raise ConfigError(f"--model {args.model}" + (f" --chat-template {args.chat_template}"
                                                     if args.chat_template else "") + f": {e}") from None
    tasks = [t for t in tasks if WHERE in t and "env" in t]
    for task in tasks:
        e = MultiTurn(task, 0, 1, ctx).group.responses[0]
        if e.end_reason is not None:
            raise ConfigError(f"{task[WHERE]}: the episode cannot start: {e.error or e.end_reason} (a first "
                              f"prompt needs fewer than --episode-token-budget {args.episode_token_budget} tokens "
                              f"minus one turn)")
        e._end("done")


def check_prompt_lengths(args, tasks: list[dict]) -> None:
    """A prompt that leaves no room for --max-new-tokens in the model's context is rejected with file:line
    (rejected, not truncated: a cut question is a different task)."""
    check_episode_prompts(args, tasks)
    tasks = [t for t in tasks if WHERE in t and "env" not in t]  # from files (the built-in arith prompts are short)
    if not tasks:
        return
    if args.model == "tiny":
        context = 1024
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(resolve_model(args.model))
        context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not context:
        return
    tokenizer = load_tokenizer(args.model)
    for task in tasks:
        n = len(chat_prompt_ids(tokenizer, task))
        if n + args.max_new_tokens > context:
            raise ConfigError(f"{task.get(WHERE, task['id'])}: prompt is {n} tokens; with --max-new-tokens "
                              f"{args.max_new_tokens} it does not fit the model's context of {context} tokens")


def threads_per_worker(args, num_workers: int) -> int:
    """torch threads per worker when workers run at the same time: the cores split evenly (at least one)."""
    return args.num_threads or max(1, (os.cpu_count() or 1) // num_workers)


def finish_run(args, title: str) -> None:
    """timeline.json/png and reward.png from what the workers wrote; a one-paragraph summary on stdout."""
    write_timeline(args.out_dir, title=title)
    plot_reward_curve(args.out_dir, title=f"{title} ({os.path.basename(os.path.normpath(args.out_dir))})")
    rows = read_metrics(args.out_dir)
    summary_path = os.path.join(args.out_dir, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    if rows:
        rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]  # partial rollouts: early steps may train none
        reward = f"{rewards[0]:.3f} -> {rewards[-1]:.3f}" if rewards else "none (no batch finished)"
        held_out = (f"held-out accuracy {summary.get('eval_before')} -> {summary.get('eval_after')}"
                    if args.eval_every else "no evaluation (--eval-every 0)")
        print(f"[tandem] {len(rows)} steps in {rows[-1]['time/elapsed']:.0f}s; reward {reward}; {held_out}; "
              f"outputs in {args.out_dir}")
