"""Synchronous RL fine-tuning, schedule (a) of DESIGN.md: the trainer always trains on data from the current policy.

    E: rollout ─▶ wait ──────────────────▶ rollout ─▶ wait …
    T:         wait ─▶ train ─▶ sync                 wait ─▶ train …

Each step the explorer rolls out a batch with the current weights and scores it; the trainer takes exactly that
batch, does --ppo-epochs x minibatch updates and broadcasts the new weights; the explorer resumes only once it
holds them.

Launch (CPU, embedded SmolLM2-135M-Instruct; `python` and `torchrun --nproc-per-node 1` behave the same):
    python train_sync.py
    python train_sync.py --model tiny --steps 3 --out-dir runs/smoke
    python train_sync.py --config configs/sync_default.yaml --lr 1e-6
    torchrun --nproc-per-node 1 train_sync.py --explorer-devices cuda:0 --trainer-devices cuda:1
    python train_sync.py --out-dir runs/x --resume            # continue from the newest checkpoint
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch.multiprocessing as mp

from common.config import CommonArgs, ConfigError, parse_args
from common.experience import ExperienceQueue, RolloutBatch
from common.explorer import Explorer
from common.launcher import WorkerContext, WorkerSpec, launch
from common.metrics import MetricsLogger, Timeline
from common.run import finish_run, prepare_run
from common.trainer import Trainer
from common.weight_sync import broadcast_weights, weights_hash


@dataclass
class Args(CommonArgs):
    """Synchronous schedule: every field is shared with the other schedules (see common/config.py)."""

    def validate(self):
        super().validate()
        if len(self.explorer_device_list) != 1:
            raise ConfigError("--explorer-devices: the synchronous schedule runs exactly one explorer")


def explorer_main(ctx: WorkerContext, args: Args, queue: ExperienceQueue):
    timeline = Timeline(args.out_dir, ctx.name)
    explorer = Explorer(args, ctx.device, timeline, index=ctx.index)

    def receive_weights(step):
        start = time.time()
        explorer.version, arrived = broadcast_weights(explorer.engine.weight_buffers(), 0, ctx.sync_src,
                                                      ctx.sync_group, ctx.comm_device, args.sync_bucket_mb)
        explorer.engine.commit_weights(explorer.engine.weight_buffers())
        timeline.record("wait", start, arrived, step=step)
        check = {"hash": weights_hash(explorer.engine.weight_buffers())} if args.verify_sync else {}
        timeline.record("sync", arrived, time.time(), step=step, version=explorer.version, **check)

    receive_weights(step=0)  # the trainer's weights (fresh or resumed) before anything is generated
    first_step = explorer.version + 1  # one version per step: the version says how many steps are done
    explorer.skip_to(explorer.version)
    for step in range(first_step, args.steps + 1):
        metrics = {}
        if step == first_step or (args.eval_every and (step - 1) % args.eval_every == 0):
            metrics.update(explorer.evaluate(step))
        experiences, rollout_metrics = explorer.rollout(step)
        with timeline.phase("wait", put=step):
            queue.put(RolloutBatch(step, experiences, {**metrics, **rollout_metrics}), args.timeout_s)
        receive_weights(step)  # SYNC: nothing is generated until the new weights are here
    queue.put(RolloutBatch(args.steps, [], explorer.evaluate(args.steps + 1), final=True), args.timeout_s)
    explorer.close()


def trainer_main(ctx: WorkerContext, args: Args, queue: ExperienceQueue):
    timeline = Timeline(args.out_dir, ctx.name)
    trainer = Trainer(args, ctx.device)
    state = trainer.resume(args.out_dir) if args.resume else {}
    summary = {"eval_before": state.get("eval_before"), "elapsed_before": state.get("elapsed", 0.0)}
    logger = MetricsLogger(args.out_dir, vars(args), args.steps, trainer.step, args.track, args.wandb_project)
    start_time = time.time() - summary["elapsed_before"]

    def send_weights(step):
        check = {"hash": weights_hash(trainer.named_weights())} if args.verify_sync else {}
        with timeline.phase("sync", step=step, version=trainer.version, **check):
            broadcast_weights(trainer.named_weights(), trainer.version, ctx.sync_src, ctx.sync_group,
                              ctx.comm_device, args.sync_bucket_mb)

    send_weights(step=trainer.step)
    try:
        while trainer.step < args.steps:
            step = trainer.step + 1
            with timeline.phase("wait", get=step):
                batch = queue.get(args.timeout_s)
            with timeline.phase("train", step=step):
                metrics = trainer.train_step(batch.experiences)
            send_weights(step)
            if summary["eval_before"] is None and "eval/accuracy" in batch.metrics:
                summary["eval_before"] = batch.metrics["eval/accuracy"]
            times = {f"time/{k}": v for k, v in timeline.take_totals().items()}
            logger.log({"step": step, **metrics, **batch.metrics, **times, "time/elapsed": time.time() - start_time,
                        "samples": step * args.rollout_batch_size})
            if args.checkpoint_every and step % args.checkpoint_every == 0 and step < args.steps:
                with timeline.phase("checkpoint", step=step):
                    trainer.save_checkpoint(args.out_dir, extra_state={**summary, "elapsed": time.time() - start_time})
        final = queue.get(args.timeout_s)
        with timeline.phase("checkpoint", step=trainer.step):
            trainer.save_checkpoint(args.out_dir, extra_state={**summary, "elapsed": time.time() - start_time})
            trainer.save_checkpoint(args.out_dir, name="final")
    except KeyboardInterrupt:
        trainer.save_checkpoint(args.out_dir, extra_state={**summary, "elapsed": time.time() - start_time})
        raise
    finally:
        logger.close()
    summary.update(eval_after=final.metrics["eval/accuracy"], elapsed=time.time() - start_time, steps=trainer.step)
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)


def main():
    args = parse_args(Args)
    prepare_run(args, schedule="sync")
    queue = ExperienceQueue(mp.get_context("spawn"), maxsize=1)
    specs = [WorkerSpec(f"trainer{i}", "trainer", d, trainer_main, (args, queue))
             for i, d in enumerate(args.trainer_device_list)]
    specs += [WorkerSpec("explorer0", "explorer", args.explorer_device_list[0], explorer_main, (args, queue))]
    # Explorer and trainer take turns here, so each may use every core.
    launch(specs, num_threads=args.num_threads or os.cpu_count(), timeout_s=args.timeout_s)
    finish_run(args, title="train_sync.py: schedule (a), synchronous")


if __name__ == "__main__":
    main()
