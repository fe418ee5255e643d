"""Fully asynchronous RL fine-tuning, schedules (c) and (d) of DESIGN.md: explorers and trainer never wait for
each other, and an explorer never waits for its slowest group.

    E0: groups stream: --inflight-groups generate at once, a new one starts the moment one ends … (N with --num-explorers N)
    B:  bounded queue of batches of --tasks-per-step scored groups (a full queue blocks explorers: backpressure)
    T:  train ─ train ─ train ─▶ weights in flight ─ train ─ train …

Each explorer keeps --inflight-groups groups generating (vLLM: one running batch that new groups and episodes'
next turns join; HF: one generate call over every request ready, call after call). A group that ends is scored in
the reward pool at once; the first --tasks-per-step groups scored go to the queue as one batch, so a long answer or
a slow tool delays its own group only. Every --sync-interval trainer steps the weights go out (one sync reaches
every explorer: a shared buffer, a broadcast or a checkpoint) and each explorer takes them between two engine
steps: requests running then go on with the new weights, each token keeps the version that sampled it. Samples
more than --max-staleness versions behind the trainer are dropped and counted; --off-policy-correction weights the
rest.

Launch (one rank per worker: trainers first, then explorers; `python` starts them through torch elastic):
    python train_async.py
    python train_async.py --num-explorers 2 --max-staleness 2 --off-policy-correction decoupled
    python train_async.py --model tiny --steps 4 --sync-method checkpoint --out-dir runs/smoke
    torchrun --nproc-per-node 3 train_async.py --num-explorers 2 --explorer-devices cuda,cuda --trainer-devices cuda
    torchrun --nnodes 2 --node-rank 0/1 --nproc-per-node 4 --master-addr HOST --max-restarts 3 train_async.py \
        --trainer-devices cuda,cuda,cuda,cuda --num-explorers 4 --explorer-devices cuda,cuda,cuda,cuda
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from common.cli import parse_args
from common.config import CommonArgs
from common.knobs import ConfigError, Range
from common.runtime.channel import Mailbox, StoreFlag
from common.runtime.control import ControlChannel
from common.experience import ExperienceQueue
from common.explorer.explorer import Explorer
from common.explorer.streaming import Stream
from common.runtime.worker import WorkerContext, stop_requested
from common.runtime.metrics import Timeline
from common.tasks.stream import StreamPositions
from common.run import launch, run_entry
from common.trainer.trainer import TrainerRun
from common.weight_sync import make_weight_sync


@dataclass
class Args(CommonArgs):
    num_explorers: int = 1
    """Explorers feeding the one queue; --explorer-devices lists one device each (a single cpu is repeated)."""
    sync_interval: int = 1
    """Send the weights every N trainer steps."""
    queue_size: int = 0
    """Batches the queue holds before explorers block (0: one per explorer; more adds staleness)."""
    inflight_groups: int = 0
    """Groups each explorer holds at once, generating or scored and not yet in the queue. 0: 2 x --tasks-per-step
    where explorers and trainers have devices of their own (while the slowest groups of one batch finish, the next
    batch's groups already fill the engine); --tasks-per-step where an explorer shares a device with a trainer (the
    CPU, or one GPU): generating further ahead takes compute from the trainer for samples that would wait in the
    queue and grow stale. Raise it when episodes wait on slow tools, so enough others decode meanwhile."""
    mid_generation_updates: bool = True
    """Take new weights between any two engine steps (vLLM: running requests then continue with the new weights,
    their KV cache recomputed; each token keeps the version that sampled it, in Experience.segment_versions)
    instead of only when a batch has been put in the queue. Unless given, off where an explorer shares a device
    with a trainer: there the update (on the CPU a re-pack of vLLM's weights) and the recomputed KV cache take
    compute from both sides, and tokens sampled before it train only with --partial-loss all (docs/BENCHMARKS.md
    "Schedules as a user runs them": 146 s on, 120 s off on 2 cores)."""

    RANGES: ClassVar[dict[str, Range]] = {"num_explorers": Range(ge=1), "sync_interval": Range(ge=1)}  # + CommonArgs'
    SCHEDULE: ClassVar[str] = "async"

    def validate(self):
        super().validate()
        if self.explorer_devices == "cpu" and self.num_explorers > 1:
            self.explorer_devices = ",".join(["cpu"] * self.num_explorers)
        if len(self.explorer_device_list) != self.num_explorers:
            raise ConfigError(f"--explorer-devices lists {len(self.explorer_device_list)} devices for "
                              f"--num-explorers {self.num_explorers}")
        self.queue_size = self.queue_size or self.num_explorers
        shared = bool(set(self.explorer_device_list) & set(self.trainer_device_list))
        self.inflight_groups = self.inflight_groups or (1 if shared else 2) * self.tasks_per_step
        if shared and "mid_generation_updates" not in self.given_fields:
            self.mid_generation_updates = False


def explorer_main(ctx: WorkerContext, args: Args, queue: ExperienceQueue, control: ControlChannel, stop):
    explorer = Explorer(args, ctx.device, Timeline(args.out_dir, ctx.name), index=ctx.index)
    explorer.connect(make_weight_sync(args, ctx, explorer.timeline, explorer.engine))
    explorer.pull(step=0)
    positions = StreamPositions.published(args, ctx.store, ctx.index, explorer.version)  # what the trainer trained
    stream = Stream(explorer.parts, explorer.weights, positions, ctx.store, control if ctx.index == 0 else None)
    while not stop.is_set():
        stream.evaluate_when_due()  # its requests join the groups' running batch
        stream.start_groups()  # up to --inflight-groups generating, none too stale to train (StreamPositions)
        stream.step()  # one engine step; waits (<= 1 s) only while every episode waits on its environment
        batch = stream.take_batch()  # --tasks-per-step groups, once that many are scored
        if batch is None:  # weights between two engine steps, or when idle (a batch being scored goes out first)
            if args.mid_generation_updates or stream.idle():
                stream.poll()
            continue
        stream.hand_over(queue, batch, stop)  # blocks only while the queue is full
        stream.poll()
    stream.stop()  # groups still in flight are given up, an evaluation in flight ends
    explorer.take_final(stream.sent)  # every send still owed, up to the trainer's final weights
    if ctx.index == 0:
        control.send("final", explorer.final_evaluation(stream.sent + 1), ctx.index)
    explorer.close()


def trainer_main(ctx: WorkerContext, args: Args, queue: ExperienceQueue, control: ControlChannel, stop):
    with TrainerRun(ctx, args, control) as run:  # publishes the trained stream positions for the explorers
        weights = make_weight_sync(args, ctx, run.timeline)
        weights.push(run.trainer.named_weights(), run.trainer.version, step=run.step)
        while run.step < args.steps:
            batch = run.get(queue)  # samples older than --max-staleness are dropped there (counted)
            if not batch.experiences:  # dropped whole: the explorers make one batch more
                continue
            run.log(batch, run.train(batch, run.step + 1))
            if run.step % args.sync_interval == 0:  # in flight: the trainer goes on while explorers pick it up
                weights.push(run.trainer.named_weights(), run.trainer.version, run.step, wait=False)
        # Shutdown: explorers stop generating and take every send up to the final version.
        weights.finish(run.trainer.named_weights(), run.trainer.version, run.step, stop)
        run.finish()  # waits for explorer 0's final evaluation on the control channel


def worker(ctx: WorkerContext, args: Args):
    mailbox = Mailbox(ctx, capacity=args.queue_size)
    queue, control = ExperienceQueue(mailbox, stop_requested), ControlChannel(mailbox)
    stop = StoreFlag(ctx.store, "stop")  # the end of training, in the run's store
    main = trainer_main if ctx.role == "trainer" else explorer_main
    main(ctx, args, queue, control, stop)
    mailbox.close(args.timeout_s)


def main():
    args = parse_args(Args)
    launch(args, "async" if args.num_explorers == 1 else f"async{args.num_explorers}", worker,
           title=f"train_async.py: schedule ({'c' if args.num_explorers == 1 else 'd'}), {args.num_explorers} "
                 "explorer(s), asynchronous")


if __name__ == "__main__":
    run_entry(main)
