"""ALGO LOGIC: the optimizer (AdamW) and the policy's learning-rate schedule (--lr-scheduler, --warmup-steps),
stepped once per trainer step.

The schedules are transformers' own (`get_scheduler`, as TRL's trainers use them): linear warm-up from 0 to --lr
over --warmup-steps trainer steps, then constant, linear decay to 0 at --steps, or half a cosine to 0 at --steps.
The scheduler is a torch LambdaLR: its state goes into trainer_state.pt and a resumed run continues the schedule.
"""

from __future__ import annotations

import torch

def build_optimizer(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW, fused: one kernel per parameter group instead of a handful of passes over every parameter (the step
    of a 135M model on a CPU costs a quarter of the unfused one); the same update."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)


# --lr-scheduler -> transformers.get_scheduler's name (each includes the warm-up; 0 warm-up steps = none)
SCHEDULERS = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def build_lr_scheduler(optimizer: torch.optim.Optimizer, name: str, warmup_steps: int, total_steps: int):
    """The LambdaLR for `name`; call `.step()` after every trainer step (also a step that trains nothing)."""
    from transformers import get_scheduler

    return get_scheduler(SCHEDULERS[name], optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)
