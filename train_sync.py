"""Synchronous RL fine-tuning, schedule (a) of DESIGN.md: the trainer always trains on data from the current policy.

    E: rollout ─▶ wait ──────────────────▶ rollout ─▶ wait …
    T:         wait ─▶ train ─▶ sync                 wait ─▶ train …

Each step the explorer rolls out a batch with the current weights and scores it; the trainer takes exactly that
batch, does --ppo-epochs x minibatch updates and sends the new weights; the explorer resumes only once it holds them.

Launch (one rank per worker: the trainer(s), then the explorer; `python` starts them through torch elastic):
    python train_sync.py                                      # the README's learning benchmark
    python train_sync.py --model tiny --steps 3 --out-dir runs/smoke
    python train_sync.py --config configs/sync_default.yaml --lr 1e-6
    torchrun --nproc-per-node 2 train_sync.py --explorer-devices cuda --trainer-devices cuda   # = python ...
    torchrun --nnodes 2 --node-rank 0/1 --nproc-per-node 1 --master-addr HOST train_sync.py   # one per node
    python train_sync.py --out-dir runs/x --resume            # continue from the newest checkpoint
"""

from __future__ import annotations

from dataclasses import dataclass

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
from common.trainer.trainer import TrainerRun
from common.weight_sync import make_weight_sync


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
    explorer.connect(make_weight_sync(args, ctx, timeline, explorer.engine))
    explorer.pull(step=0)  # the trainer's weights (fresh or resumed) before anything is generated
    explorer.skip_to(explorer.version)  # one version per step: the version says how many steps are done
    for step in range(explorer.version + 1, args.steps + 1):
        if explorer.eval_due(step):
            control.send("eval", explorer.evaluate(step))
        experiences, metrics = explorer.rollout(step)
        explorer.hand_over(queue, RolloutBatch(step, experiences, metrics))
        explorer.pull(step)  # SYNC: no generation until the new weights are here
    control.send("final", explorer.final_evaluation(args.steps + 1))
    explorer.close()


def trainer_main(ctx: WorkerContext, args: Args, queue: ExperienceQueue, control: ControlChannel):
    with TrainerRun(ctx, args, control) as run:
        weights = make_weight_sync(args, ctx, run.timeline)
        weights.push(run.trainer.named_weights(), run.trainer.version, step=run.step)  # the initial weights
        while run.step < args.steps:
            step = run.step + 1
            batch = run.get(queue)
            run.log(batch, run.train(batch, step))
            weights.push(run.trainer.named_weights(), run.trainer.version, step)
        run.finish()  # waits for the final evaluation on the control channel


def worker(ctx: WorkerContext, args: Args):
    mailbox = Mailbox(ctx, capacity=1)  # the trainer takes exactly the batch the explorer just made
    queue, control = ExperienceQueue(mailbox, stop_requested), ControlChannel(mailbox)
    (trainer_main if ctx.role == "trainer" else explorer_main)(ctx, args, queue, control)
    mailbox.close(args.timeout_s)


def main():
    launch(parse_args(Args), "sync", worker, title="train_sync.py: schedule (a), synchronous")


if __name__ == "__main__":
    run_entry(main)
