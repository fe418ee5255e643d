"""Trainer rank 0 -> explorer(s) weight sync over torch.distributed (nccl on CUDA, gloo on CPU).

Parameters are packed into flat buckets of `bucket_mb` per dtype so one sync is a handful of collectives rather
than one per tensor. The same code runs on both sides: the sender packs from its parameters, receivers unpack into
theirs (`RolloutEngine.weight_buffers()`), so shapes and order must match: both are the HF named_parameters order.
A version number travels with the weights.
"""

from __future__ import annotations

import hashlib
import time

import torch
import torch.distributed as dist


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int):
    bucket, size = [], 0
    for t in tensors:
        if bucket and (size + t.numel() * t.element_size() > bucket_bytes or t.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel() * t.element_size()
    if bucket:
        yield bucket


@torch.no_grad()
def broadcast_weights(named_tensors: list[tuple[str, torch.Tensor]], version: int, src: int, group=None,
                      device: str | torch.device = "cpu", bucket_mb: int = 256) -> tuple[int, float]:
    """Broadcast `version` and every tensor from global rank `src` to all ranks of `group`.

    Returns (version, time the header arrived): before that a receiver was waiting for the sender, after it the
    weights were moving.

    Collective: every rank of the group calls it with tensors of the same shapes and order. `device` is where the
    flat buffers live (cuda for nccl, cpu for gloo).
    """
    head = torch.tensor([version, len(named_tensors)], dtype=torch.long, device=device)
    dist.broadcast(head, src=src, group=group)
    header_time = time.time()
    if head[1].item() != len(named_tensors):
        raise RuntimeError(f"weight sync: sender has {head[1].item()} tensors, this rank {len(named_tensors)}")
    tensors = [t.detach() for _, t in named_tensors]
    for bucket in _buckets(tensors, bucket_mb << 20):
        flat = torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=device)
        if dist.get_rank() == src:
            torch.cat([t.reshape(-1).to(device) for t in bucket], out=flat)
        dist.broadcast(flat, src=src, group=group)
        if dist.get_rank() != src:
            offset = 0
            for t in bucket:
                t.copy_(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()
    return int(head[0].item()), header_time


def weights_hash(named_tensors) -> str:
    """sha256 over names and raw bytes: equal iff the weights are bit-identical."""
    h = hashlib.sha256()
    for name, t in named_tensors:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
