"""How an entry script becomes a run: `launch` starts the ranks (or is one), prepares the run once, runs the
schedule's worker function and wraps up. Set-up (out_dir, resume; the checks that need the model or the tasks are
common/preflight.py) and wrap-up (timeline, plots, summary) are shared by every schedule."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time

from torch.distributed.elastic.multiprocessing.api import SignalException

from common.cli import LAUNCHED_ARGS
from common.compat import python
from common.explorer.engine import resolve_engine, resolve_judge_engine, vllm_available
from common.explorer.eval_metrics import format_interval
from common.knobs import ConfigError
from common.lora import describe as describe_lora, resolve_sync as resolve_lora_sync
from common.memory import served_judge
from common.preflight import check_machine, check_tasks
from common.runtime.cores import apply as apply_cores, describe as describe_cores, plan_cores
from common.runtime import cpu_tuning
from common.runtime.launcher import launch_local, start_forkserver, stop_forkserver
from common.placement import print_plan
from common.runtime.worker import ENGINE_READY, WorkerContext, join_world, plan_world, run_worker, under_elastic
from common.trainer.checkpoints import (MARGIN_BYTES, ensure_free_space, folder_bytes, newest_valid, remove_newer,
                                       remove_partial)
from common.runtime.metrics import (plot_reward_curve, read_json, read_metrics, reward_curve_points, rewind_metrics,
                                    write_timeline)
from common.model import resolve_model
from common.tasks import tasksets_of
from common.weight_sync import check_weight_sync


TORCH_MIN = (2, 11)
"""The oldest torch tandem supports (requirements.txt pins the newest tested, 2.13.0). tests/test_torch_api.py checks
that the code names no torch API or keyword this release lacks."""


def check_torch() -> None:
    import torch

    found = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if found < TORCH_MIN:
        raise ConfigError(f"torch {torch.__version__}: tandem needs torch >= {TORCH_MIN[0]}.{TORCH_MIN[1]} "
                          "(pip install -r requirements.txt)")


def prepare_run(args, schedule: str) -> None:
    """Resolve the model (converting the default once, before any worker starts), check and create out_dir."""
    if not args.out_dir:
        args.out_dir = os.path.join("runs", f"{schedule}-{time.strftime('%Y%m%d-%H%M%S')}")
    check_out_dir(args.out_dir)
    model_path = resolve_model(args.model)
    # the workers get hf or vllm, never auto
    args.engine, why = resolve_engine(args.engine, model_path, args.explorer_device_list)
    print(f"[tandem] {schedule}: rollout engine {args.engine} ({why})", flush=True)
    if served_judge(args):  # the judge tandem serves: the explorers' rule on its own device
        args.judge_engine, why = resolve_judge_engine(args)
        print(f"[tandem] judge: --judge-model {args.judge_model} served on {args.judge_device} by {args.judge_engine} "
              f"({why})", flush=True)
    if args.lora_rank:  # adapters or merged weights to the explorers, decided once for every worker
        args.lora_sync, why = resolve_lora_sync(args, model_path)
        print(f"[tandem] {describe_lora(args, args.lora_sync, why)}", flush=True)
    if getattr(args, "critic_model", None):
        resolve_model(args.critic_model, "--critic-model")
    train, held_out = tasksets_of(args)  # bad rows fail here
    check_tasks(args, model_path, (train.tasks or []) + held_out)  # common/preflight.py
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


def run_entry(main) -> None:
    """An entry script's `main()`. In the launcher (`python train_X.py`), the process then ends as Python would end
    it (exit code, a one-line error on stderr, atexit handlers run), with the CPU tuning (common/runtime/cpu_tuning.py)
    without tearing down its modules: torch's and transformers' teardown costs ~1 s of CPU on every run and every
    one-line error. A rank (under torch elastic) returns, as the agent expects of its function and binary
    entrypoints."""
    if under_elastic():
        return main()
    code = exit_code(main)
    if not cpu_tuning.enabled():
        raise SystemExit(code)
    python.run_exit_handlers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_code(main) -> int:
    """Run the launcher's `main()` and return the exit code Python would give it: 0, or 1 with the message of a
    `SystemExit("error: ...")` printed on stderr; the forkserver, if it started one, is stopped. Any other exception
    is raised."""
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code
        if not isinstance(code, (int, type(None))):  # a message: printed, exit code 1
            print(code, file=sys.stderr)
            code = 1
    finally:
        stop_forkserver()
    return code or 0


def launch(args, schedule: str, worker, title: str) -> None:
    """`python train_X.py`: check and prepare the run here (one-line errors before any process starts), then run
    this same script once per rank through torch elastic. Under torchrun (or as one of those ranks): join the world,
    take the prepared configuration from rank 0, run `worker(ctx, args)`, and on rank 0 write the wrap-up once every
    rank is done."""
    check_torch()
    if args.plan:  # the placement and the memory plan, nothing else (rank 0's under torchrun)
        if not under_elastic() or os.environ["RANK"] == "0":
            print_plan(args, os.path.basename(sys.argv[0]))
        return
    check_machine(args)  # before anything imports vLLM or touches CUDA, in every process
    tuned = cpu_tuning.decide(args.cpu_tuning, args.trainer_device_list + args.explorer_device_list)
    plan = plan_world(args.trainer_device_list, args.explorer_device_list)
    if getattr(args, "placement", None) and (not under_elastic() or os.environ["RANK"] == "0"):
        print(f"[tandem] placement: {args.placement}", flush=True)
    if not under_elastic():
        check_paths(args)  # a mistyped path is one line now, not after the forkserver's seconds of imports
        if args.engine == "auto":  # vLLM imported here, where it imports, so the forked workers have it too
            vllm_available()  # (it starts no thread); which engine runs is decided in prepare_run
        if tuned:
            start_forkserver(args.trainer_device_list + args.explorer_device_list)  # before any thread starts
        prepare_run(args, schedule)
        os.environ[LAUNCHED_ARGS] = json.dumps(dataclasses.asdict(args))  # the workers take it as is
        try:
            launch_local([os.path.abspath(sys.argv[0]), *sys.argv[1:]], [w.name for w in plan])
        except SignalException as e:  # Ctrl-C / SIGTERM: the agent passed it on; trainers checkpointed
            raise SystemExit(f"\n[tandem] stopped by {e.sigval.name}: trainers saved a checkpoint") from None
        return

    def rank_main():
        if int(os.environ["WORLD_SIZE"]) == len(plan):  # else join_world says so in one line
            shares = node_cores(args, schedule, plan)  # before this rank starts any thread or process
            name = plan[int(os.environ["RANK"])].name
            apply_cores(shares[name], shares, name)
            if int(os.environ["LOCAL_RANK"]) == 0:
                print(f"[tandem] cores: {describe_cores(shares)}", flush=True)
        ctx = join_world(plan, args.timeout_s, args.peer_timeout_s, cpu_collectives=args.fsdp_cpu_offload)
        share_prepared_args(ctx, args, schedule)
        check_weight_sync(ctx, args)
        engines_first(ctx, args)
        worker(ctx, args)
        ctx.close(args.timeout_s)
        if ctx.rank == 0:
            finish_run(args, title)

    run_worker(rank_main)


def engines_first(ctx: WorkerContext, args) -> None:
    """A trainer on the same GPU as a vLLM explorer loads its model once that explorer's engine is up (the explorer
    says so when it connects its weight sync: common/weight_sync make_weight_sync). vLLM measures the GPU's free
    memory and profiles its own peak while it starts, and assumes no other process allocates meanwhile
    (vllm/v1/worker/gpu_worker.py: determine_available_memory, its "Error in memory profiling" assertion); a trainer
    loading at the same time shrinks vLLM's KV cache or fails that check."""
    if ctx.role != "trainer" or args.engine != "vllm" or ctx.places[ctx.rank].id == "cpu":
        return
    for r in ctx.explorer_ranks:
        if ctx.places[r].same(ctx.places[ctx.rank]):
            ctx.wait_key(f"{ENGINE_READY}/{r}", args.timeout_s, f"{ctx.names[r]}'s vLLM engine on this GPU (it starts "
                         "before the trainer loads)")


def share_prepared_args(ctx: WorkerContext, args, schedule: str) -> None:
    """Rank 0 prepares the run once (or takes what `python train_X.py` prepared) and publishes the result (the
    resolved engine, the out_dir, --resume after a restart); every rank continues with exactly those values."""
    if ctx.rank == 0:
        try:
            if LAUNCHED_ARGS in os.environ:
                prepared = json.loads(os.environ[LAUNCHED_ARGS])
            else:
                if ctx.restart:  # torchrun restarted the group: continue from the newest checkpoint, if any
                    args.resume = bool(args.out_dir and newest_valid(args.out_dir, warn=False))
                    args.overwrite = True
                prepare_run(args, schedule)
                prepared = dataclasses.asdict(args)
        except SystemExit as e:
            ctx.store.set("args", json.dumps({"error": str(e.code)}))
            raise
        ctx.store.set("args", json.dumps(prepared))
    else:
        prepared = json.loads(ctx.wait_key("args", args.timeout_s, "prepared configuration from rank 0"))
        if "error" in prepared:
            raise SystemExit(1)  # rank 0 reports it
    for name, value in prepared.items():
        setattr(args, name, value)
    os.makedirs(args.out_dir, exist_ok=True)  # a node without the trainer's filesystem keeps its files here


def check_paths(args) -> None:
    """The checks of prepare_run that need no heavy import: --out-dir, and --model / --critic-model given as
    folders (the built-in names and hub ids are resolved later, in prepare_run)."""
    if args.out_dir:
        check_out_dir(args.out_dir)
    for flag, name in (("--model", args.model), ("--critic-model", getattr(args, "critic_model", None))):
        if name and name != "default":
            resolve_model(name, flag)


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
    path = newest_valid(args.out_dir)
    if path is None:
        raise ConfigError(f"--resume: no usable checkpoint in {args.out_dir}/checkpoints (one is saved every "
                          "--checkpoint-every steps, on Ctrl-C, and at the end when the last step is on that grid)")
    step = int(path.rsplit("_", 1)[1])
    remove_newer(args.out_dir, step)
    redone = rewind_metrics(args.out_dir, step)
    print(f"[tandem] resuming from {path}" + (f"; the {redone} metrics rows after step {step} are redone"
                                               if redone else ""), file=sys.stderr, flush=True)
    ensure_free_space(os.path.dirname(path), folder_bytes(path) + MARGIN_BYTES, "the next checkpoint")


def node_cores(args, schedule: str, plan) -> dict:
    """The cores of every worker on this rank's node (common/runtime/cores.py): torch elastic numbers the ranks of
    a node contiguously."""
    first = int(os.environ["RANK"]) - int(os.environ["LOCAL_RANK"])
    node = plan[first:first + int(os.environ.get("LOCAL_WORLD_SIZE", len(plan)))]
    return plan_cores([(w.name, w.role, w.device) for w in node], schedule != "sync", sorted(os.sched_getaffinity(0)),
                      args.num_threads, args.bind_cores, lend=cpu_tuning.enabled())


def finish_run(args, title: str) -> None:
    """timeline.json/png and reward.png (--plots) from what the workers wrote; a one-paragraph summary on stdout."""
    write_timeline(args.out_dir, title=title, plot=args.plots)
    if args.plots:
        plot_reward_curve(args.out_dir, title=f"{title} ({os.path.basename(os.path.normpath(args.out_dir))})")
    rows = read_metrics(args.out_dir)
    summary = read_json(os.path.join(args.out_dir, "summary.json"), {})
    if rows:
        rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]  # partial rollouts: early steps may train none
        reward = f"{rewards[0]:.3f} -> {rewards[-1]:.3f}" if rewards else "none (no batch finished)"
        held_out = (f"held-out {'accuracy' if args.eval_samples == 1 else f'mean@{args.eval_samples}'} "
                    f"{with_interval(summary, 'eval_before')} -> {with_interval(summary, 'eval_after')}"
                    if args.eval_every else "no evaluation (--eval-every 0)")
        means = [mean for _, mean in reward_curve_points(args.out_dir, "eval/reward_mean")[1]]
        if len(means) > 1:  # what a judged or otherwise graded taskset's accuracy (reward 1) does not show
            held_out += f", reward {means[0]:.3f} -> {means[-1]:.3f}"
        print(f"[tandem] {len(rows)} steps in {rows[-1]['time/elapsed']:.0f}s; reward {reward}; {held_out}; "
              f"outputs in {args.out_dir}")


def with_interval(summary: dict, key: str) -> str:
    """summary[key] with its 95% interval (summary[key + "_interval"]) where it has one: '0.250 [0.146, 0.375]'."""
    value, interval = summary.get(key), summary.get(f"{key}_interval")
    return format_interval(value, *interval) if value is not None and interval else str(value)


def run_of(model: str) -> tuple[str, dict | None]:
    """(what to load, the run's config.json or None): a run's folder gives its final/, its final/ or
    checkpoints/step_N/ themselves; anything else is a model as a run's --model takes it."""
    def config_of(folder: str) -> dict | None:
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            return None
        try:
            config = json.load(open(path))
        except ValueError as e:
            raise ConfigError(f"--model {model}: {path} is not readable JSON ({e})") from None
        return config if isinstance(config, dict) and "schedule" in config else None  # a run's, not a model's

    if not os.path.isdir(model):
        return model, None
    run = config_of(model)
    if run is not None:
        final = os.path.join(model, "final")
        if not os.path.isdir(final):
            raise ConfigError(f"--model {model}: the run has no final/ (not finished): pass one of its "
                              f"checkpoints/step_N/")
        return final, run
    parent = os.path.dirname(os.path.normpath(model))
    return model, config_of(parent) or config_of(os.path.dirname(parent))  # final/ or checkpoints/step_N/
