"""One-step off-policy RL fine-tuning, schedule (b) of DESIGN.md: the explorer generates batch k+1 while the
trainer trains on batch k; after each train step the new weights go to the explorer, which waits only for them.

    E: rollout 1 ─▶ rollout 2 ─▶ sync ─▶ rollout 3 ─▶ sync …
    T:  wait    ─▶ train 1  ─▶ sync ─▶ train 2   ─▶ sync …      every trained batch is exactly one version old

Launch (same flags and ranks as train_sync.py):
    python train_offpolicy.py
    python train_offpolicy.py --model tiny --steps 3 --out-dir runs/smoke --off-policy-correction tis
    torchrun --nproc-per-node 2 train_offpolicy.py --explorer-devices cuda --trainer-devices cuda
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from common.cli import parse_args
from common.config import CommonArgs
from common.knobs import ConfigError
from common.runtime.channel import Mailbox
from common.runtime.control import ControlChannel
from common.experience import ExperienceQueue, RolloutBatch
from common.explorer.explorer import Explorer
from common.runtime.worker import WorkerContext, stop_requested
from common.runtime.metrics import Timeline
from common.run import launch, run_entry
from common.weight_sync import make_weight_sync
from train_sync import trainer_main  # the trainer side is the synchronous one: get, train, send weights


@dataclass
class Args(CommonArgs):
    """One-step off-policy schedule: every field is shared with the other schedules (see common/config.py)."""

    SCHEDULE: ClassVar[str] = "offpolicy"

    def validate(self):
        super().validate()
        if len(self.explorer_device_list) != 1:
            raise ConfigError("--explorer-devices: the one-step off-policy schedule runs exactly one explorer")


def explorer_main(ctx: WorkerContext, args: Args, queue: ExperienceQueue, control: ControlChannel):
    explorer = Explorer(args, ctx.device, Timeline(args.out_dir, ctx.name), index=ctx.index)  # on the trainer's
    explorer.connect(make_weight_sync(args, ctx, explorer.timeline, explorer.engine))  # cores too until batch 1
    explorer.pull(step=0)
    explorer.skip_to(explorer.version)
    for step in range(explorer.version + 1, args.steps + 1):
        if explorer.eval_due(step):
            control.send("eval", explorer.evaluate(step))
        experiences, metrics = explorer.rollout(step)  # overlaps the trainer's step on batch step-1
        if step > explorer.first_step:
            # SYNC: the weights trained on batch step-1, taken before batch step is handed over: the trainer cannot
            # train batch step (and replace them) before that, so batch step+1 is exactly one version behind.
            explorer.pull(step)
        explorer.hand_over(queue, RolloutBatch(step, experiences, metrics))  # the trainer's cores go back to it
    explorer.pull(args.steps)  # the weights trained on the last batch
    control.send("final", explorer.final_evaluation(args.steps + 1))
    explorer.close()


def worker(ctx: WorkerContext, args: Args):
    mailbox = Mailbox(ctx, capacity=1)  # one batch ahead at most (the explorer puts batch k once k-1 is trained)
    queue, control = ExperienceQueue(mailbox, stop_requested), ControlChannel(mailbox)
    (trainer_main if ctx.role == "trainer" else explorer_main)(ctx, args, queue, control)
    mailbox.close(args.timeout_s)


def main():
    launch(parse_args(Args), "offpolicy", worker, title="train_offpolicy.py: schedule (b), one-step off-policy")


if __name__ == "__main__":
    run_entry(main)
