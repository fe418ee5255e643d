"""On-policy distillation's teacher (--algo distill --teacher MODEL): a frozen model on the trainer's device (or
--teacher-device) whose per-token log-probs on the student's own samples become the student's advantages
(common/trainer/losses.py distilled). It shares the student's tokenizer (common/checks.py refuses another) and is
counted by the memory planner (common/memory.py); it is never trained, synced or checkpointed.
"""

from __future__ import annotations

import torch

from common.model import DTYPES, load_model
from common.trainer.forward import batch_logprobs
from common.trainer.fsdp import prepare_model


def load_teacher(args, device: torch.device, dp=None):
    """The --teacher model, frozen and prepared as the reference model is (sharded under --trainer-shard fsdp), or
    None without --teacher. On --teacher-device it is whole there (one trainer: common/checks.py)."""
    if not args.teacher:
        return None
    own = torch.device(args.teacher_device) if args.teacher_device else None
    model = load_model(args.teacher, own or device, DTYPES[args.dtype], seed=args.seed).eval()
    model.requires_grad_(False)
    model.config.use_cache = False
    return prepare_model(model, args, dp, trainable=False, shard_it=own is None)


def teacher_logprobs(teacher, batch, args) -> torch.Tensor:
    """The teacher's log-probs of a batch's trained tokens, on the batch's device: computed where the teacher is."""
    where = next(teacher.parameters()).device
    if where == batch.response_mask.device:
        return batch_logprobs(teacher, batch, args)
    return batch_logprobs(teacher, batch.to(where), args).to(batch.response_mask.device)
