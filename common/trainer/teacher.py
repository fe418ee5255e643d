"""On-policy distillation's teacher (--algo distill --teacher MODEL): a frozen model on the trainer's device whose
per-token log-probs on the student's own samples become the student's advantages (common/trainer/losses.py
distilled). It shares the student's tokenizer (common/checks.py refuses another) and is counted by the memory
planner (common/memory.py); it is never trained, synced or checkpointed.
"""

from __future__ import annotations

import torch

from common.model import DTYPES, load_model
from common.trainer.fsdp import prepare_model


def load_teacher(args, device: torch.device, dp=None):
    """The --teacher model, frozen and prepared as the reference model is (sharded under --trainer-shard fsdp), or
    None without --teacher."""
    if not args.teacher:
        return None
    model = load_model(args.teacher, device, DTYPES[args.dtype], seed=args.seed).eval()
    model.requires_grad_(False)
    model.config.use_cache = False
    return prepare_model(model, args, dp, trainable=False)
