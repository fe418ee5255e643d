"""Synchronous RL fine-tuning, schedule (a) of DESIGN.md: the trainer always trains on data from the current policy.

    E: rollout ─▶ wait ──────────────────▶ rollout ─▶ wait …
    T:         wait ─▶ train ─▶ sync                 wait ─▶ train …

Each step the explorer rolls out a batch with the current weights and scores it; the trainer takes exactly that
batch, does --ppo-epochs x minibatch updates and sends the new weights; the explorer resumes only once it holds them.

Launch (CPU, embedded SmolLM2-135M-Instruct; `python` and `torchrun --nproc-per-node 1` behave the same):
    python train_sync.py                                      # the README's learning benchmark
    python train_sync.py --model tiny --steps 3 --out-dir runs/smoke
    python train_sync.py --config configs/sync_default.yaml --lr 1e-6
    torchrun --nproc-per-node 1 train_sync.py --explorer-devices cuda:0 --trainer-devices cuda:1
    python train_sync.py --out-dir runs/x --resume            # continue from the newest checkpoint
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.multiprocessing as mp

from common.config import CommonArgs, ConfigError, parse_args
from common.runtime.control import ControlChannel
from common.experience import ExperienceQueue, RolloutBatch
from common.explorer.explorer import Explorer
from common.runtime.launcher import WorkerContext, WorkerSpec, launch
from common.runtime.metrics import Timeline
from common.run import finish_run, prepare_run, threads_per_worker
from common.trainer.trainer import TrainerRun
from common.weight_sync import WeightReceiver, WeightSender


@dataclass
class Args(CommonArgs):
    """Synchronous schedule: every field is shared with the other schedules (see common/config.py)."""

    def validate(self):
        super().validate()
        if len(self.explorer_device_list) != 1:
            raise ConfigError("--explorer-devices: the synchronous schedule runs exactly one explorer")


def explorer_main(ctx: WorkerContext, args: Args, queue: ExperienceQueue, control: ControlChannel):
    timeline = Timeline(args.out_dir, ctx.name)
    explorer = Explorer(args, ctx.device, timeline, index=ctx.index)
    weights = WeightReceiver(ctx, args, explorer.engine, timeline)
    explorer.version = weights.pull(step=0)  # the trainer's weights (fresh or resumed) before anything is generated
    explorer.skip_to(explorer.version)  # one version per step: the version says how many steps are done
    for step in range(explorer.version + 1, args.steps + 1):
        if explorer.eval_due(step):
            control.send("eval", explorer.evaluate(step))
        experiences, metrics = explorer.rollout(step)
        with timeline.phase("wait", put=f"0-{step}"):
            queue.put(RolloutBatch(step, experiences, metrics), args.timeout_s)
        explorer.version = weights.pull(step, args.sync_method)  # SYNC: no generation until the new weights are here
    control.send("final", explorer.final_evaluation(args.steps + 1))
    explorer.close()


def trainer_main(ctx: WorkerContext, args: Args, queue: ExperienceQueue, control: ControlChannel):
    with TrainerRun(ctx, args, control) as run:
        weights = WeightSender(ctx, args, run.timeline)
        weights.push(run.trainer.named_weights(), run.trainer.version, step=run.step)  # initial: always broadcast
        while run.step < args.steps:
            step = run.step + 1
            batch = run.get(queue)
            metrics = run.train(batch, step)
            weights.push(run.trainer.named_weights(), run.trainer.version, step, args.sync_method)
            run.log(batch, metrics)
        run.finish()  # waits for the final evaluation on the control channel


def main():
    args = parse_args(Args)
    prepare_run(args, schedule="sync")
    ctx = mp.get_context("spawn")
    shared = (args, ExperienceQueue(ctx, maxsize=1), ControlChannel(ctx))
    specs = [WorkerSpec(f"trainer{i}", "trainer", d, trainer_main, shared)
             for i, d in enumerate(args.trainer_device_list)]
    specs += [WorkerSpec("explorer0", "explorer", args.explorer_device_list[0], explorer_main, shared)]
    # Explorer and trainer take turns here, so each may use every core (data-parallel trainers share them).
    launch(specs, num_threads=threads_per_worker(args, len(args.trainer_device_list)), timeout_s=args.timeout_s)
    finish_run(args, title="train_sync.py: schedule (a), synchronous")


if __name__ == "__main__":
    main()
