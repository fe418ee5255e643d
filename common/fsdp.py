"""Trainer-side memory levers applied to a freshly loaded model: activation checkpointing, LoRA (peft) and FSDP2
sharding over the data-parallel trainers. `prepare_model` is the one call the trainer and the critic make.
"""

from __future__ import annotations

import torch


def enable_gradient_checkpointing(model) -> None:
    """Recompute every decoder layer in the backward (HF's per-layer torch.utils.checkpoint, non-reentrant: works
    under FSDP2 and with inputs that need no grad)."""
    hf_model = model if hasattr(model, "gradient_checkpointing_enable") else model.body  # the critic: its LM body
    hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def prepare_model(model, args, dp=None, trainable: bool = True):
    """The model as the trainer uses it: checkpointed when --gradient-checkpointing (trainable models only)."""
    if trainable and args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model
