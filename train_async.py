"""Fully asynchronous RL fine-tuning, schedules (c) and (d) of DESIGN.md: explorers and trainer never wait for
each other.

    E0: rollout ─ rollout ─ rollout ─ sync ─ rollout ─ rollout …    (N explorers with --num-explorers N)
    B:  bounded queue of rollout batches (a full queue blocks explorers: backpressure, not memory growth)
    T:  train ─ train ─ train ─▶ weights in flight ─ train ─ train …

Explorers generate continuously into the queue; the trainer trains whenever a batch is ready; every
--sync-interval trainer steps the weights go out (one broadcast reaches every explorer, or a checkpoint they poll)
and each explorer takes them between generation batches. Samples more than --max-staleness versions behind the
trainer are dropped and counted; --off-policy-correction weights the rest.

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

from common.config import CommonArgs, ConfigError, parse_args
from common.runtime.channel import Mailbox, StoreFlag
from common.runtime.control import ControlChannel
from common.experience import ExperienceQueue, RolloutBatch
from common.explorer.explorer import Explorer
from common.runtime.launcher import WorkerContext, stop_requested
from common.runtime.metrics import Timeline
from common.run import launch
from common.trainer.trainer import TrainerRun
from common.weight_sync import make_weight_sync


@dataclass
class Args(CommonArgs):
    num_explorers: int = 1
    """Explorers feeding the one queue; --explorer-devices lists one device each (a single cpu is repeated)."""
    sync_interval: int = 1
    """Send the weights every N trainer steps."""
    queue_size: int = 0
    """Rollout batches the queue holds before explorers block (0: one per explorer; more adds staleness)."""
    mid_generation_updates: bool = True
    """--engine vllm: take new weights between decode steps of a running generation round (the round's running
    requests then continue with the new weights, their KV cache recomputed; each token keeps the version that
    sampled it, in Experience.segment_versions) instead of only between rounds. With hf: between rounds only."""
    score_behind: bool = False
    """Score each generation round in the reward pool while the next round generates (the batch reaches the queue
    one round later; its samples keep the version that generated them). Pays when verifiers are slow (code)."""

    RANGES: ClassVar[dict[str, tuple]] = {"num_explorers": (1, True, None, False, ""),  # with CommonArgs.RANGES
                                          "sync_interval": (1, True, None, False, "")}

    def validate(self):
        super().validate()
        if self.explorer_devices == "cpu" and self.num_explorers > 1:
            self.explorer_devices = ",".join(["cpu"] * self.num_explorers)
        if len(self.explorer_device_list) != self.num_explorers:
            raise ConfigError(f"--explorer-devices lists {len(self.explorer_device_list)} devices for "
                              f"--num-explorers {self.num_explorers}")
        self.queue_size = self.queue_size or self.num_explorers


def explorer_main(ctx: WorkerContext, args: Args, queue: ExperienceQueue, control: ControlChannel, stop):
    timeline = Timeline(args.out_dir, ctx.name)
    explorer = Explorer(args, ctx.device, timeline, index=ctx.index)
    weights = make_weight_sync(args, ctx, timeline, explorer.engine)
    explorer.version = weights.pull(step=0)
    explorer.skip_to(explorer.version)
    evaluates = ctx.index == 0  # one explorer measures held-out accuracy for the run
    next_eval = explorer.version
    batch = 0
    if args.mid_generation_updates and args.engine == "vllm":  # vLLM steps call this between decode steps
        explorer.between_steps = lambda: weights.poll(batch)
    while not stop.is_set():
        if weights.poll(batch):  # newer weights between rounds (and mid-round, see above)
            explorer.version = weights.version
        if evaluates and args.eval_every and explorer.version >= next_eval:
            control.send("eval", explorer.evaluate(batch), ctx.index)
            next_eval = (explorer.version // args.eval_every + 1) * args.eval_every
        batch += 1
        experiences, metrics = explorer.rollout(batch)
        with timeline.phase("wait", put=f"{ctx.index}-{batch}"):  # blocks only while the queue is full
            item = RolloutBatch(batch, experiences, metrics, ctx.index)
            _put_unless_stopped(queue, item, stop, args.timeout_s, lambda b=batch: weights.poll(b))
        explorer.version = weights.version
    explorer.version = weights.take_final(batch)  # every send still owed, up to the trainer's final weights
    if evaluates:
        control.send("final", explorer.final_evaluation(batch + 1), ctx.index)
    explorer.close()


def _put_unless_stopped(queue: ExperienceQueue, item, stop, timeout_s: float, take_weights):
    """Put with backpressure; give the batch up once the trainer has finished (it will never be trained).

    While the queue is full the trainer may be waiting for this explorer to join a weight broadcast (it is one
    collective for all explorers), so a pending one is taken here; the batch keeps the version it was made with.
    """
    for _ in range(int(timeout_s / 0.5)):
        if stop.is_set():
            return
        try:
            return queue.put(item, timeout=0.5)
        except TimeoutError:
            take_weights()
    raise TimeoutError(f"explorer: experience queue stayed full for {timeout_s:.0f}s (trainer stalled?)")


def trainer_main(ctx: WorkerContext, args: Args, queue: ExperienceQueue, control: ControlChannel, stop):
    with TrainerRun(ctx, args, control) as run:
        weights = make_weight_sync(args, ctx, run.timeline)
        weights.push(run.trainer.named_weights(), run.trainer.version, step=run.step)
        while run.step < args.steps:
            batch = run.get(queue)  # samples older than --max-staleness are dropped there (counted)
            if not batch.experiences:
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
    main()
