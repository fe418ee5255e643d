"""Data-parallel trainers (`--trainer-devices cuda:1,cuda:2` or `cpu,cpu`), the way DDP does it, in two calls.

Trainer rank 0 takes each rollout batch from the queue and `share_batch` hands it to the other trainers, so every
rank sees the same batch, computes the same advantages and walks the same minibatch order. Within a minibatch each
rank runs forward/backward on its own slice only (common/trainer/forward.py `micro_batches`), with the loss
normalised by the whole minibatch, so `all_reduce_gradients` (a sum) yields exactly the gradient one trainer would
have computed. Every rank then takes the same optimizer step and the replicas stay identical; rank 0 holds the full
weights for the weight sync.
Unlike DDP, the reduction runs after the backward pass (no overlap) in a few flat buckets: simple to read, and the
communication is small next to the backward pass at the model sizes one node trains here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from common.buckets import pack, tensor_buckets, unpack
import torch.distributed as dist


@dataclass
class DataParallel:
    rank: int = 0                  # index among the trainers
    size: int = 1                  # number of trainers
    group: Any = None              # the trainers' process group
    device: torch.device = torch.device("cpu")  # where the collectives run (the GPU under NCCL)
    src: int = 0                   # global rank of trainer 0
    sharded: bool = False          # --trainer-shard fsdp: FSDP2 reduces the gradients itself (common/trainer/fsdp.py)

    @classmethod
    def from_context(cls, ctx) -> "DataParallel":
        device = ctx.device if ctx.device.type == "cuda" else torch.device("cpu")  # the trainers' GPUs are distinct
        return cls(ctx.index, len(ctx.trainer_ranks), ctx.trainer_group, device, ctx.trainer_ranks[0])

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def share_batch(self, batch):
        """Rank 0's object reaches every trainer (pickled; rollout batches are CPU data)."""
        if not self.enabled:
            return batch
        box = [batch]
        dist.broadcast_object_list(box, src=self.src, group=self.group, device=self.device)
        return box[0]

    def sum_scalar(self, value):
        """`value` (a float or a 0-d tensor) summed over the trainers (for metrics such as the minibatch loss)."""
        if not self.enabled:
            return value
        t = torch.as_tensor(value, dtype=torch.float64).reshape(1).to(self.device)
        dist.all_reduce(t, group=self.group)
        return t.item()

    @torch.no_grad()
    def all_reduce_gradients(self, params: list[torch.nn.Parameter], bucket_mb: int = 256) -> None:
        """Sum every parameter's gradient over the trainers (a missing gradient counts as zero)."""
        if not self.enabled or self.sharded:
            return
        params = [p for p in params if p.requires_grad]  # LoRA: the frozen base has no gradient to reduce
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in tensor_buckets([p.grad for p in params], bucket_mb << 20):
            flat = pack(bucket, self.device)
            dist.all_reduce(flat, group=self.group)
            unpack(flat, bucket)
