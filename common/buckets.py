"""Many tensors as a few flat buffers, one collective each: what the weight broadcast
(common/weight_sync/broadcast.py) and the data-parallel gradient all-reduce (common/trainer/parallel.py) send."""

from __future__ import annotations

import torch


def tensor_buckets(tensors: list[torch.Tensor], bucket_bytes: int):
    """Consecutive runs of same-dtype tensors of at most `bucket_bytes` together (one flat collective each)."""
    bucket, size = [], 0
    for t in tensors:
        if bucket and (size + t.numel() * t.element_size() > bucket_bytes or t.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel() * t.element_size()
    if bucket:
        yield bucket


def pack(bucket: list[torch.Tensor], device) -> torch.Tensor:
    """One bucket's tensors as one flat buffer on `device` (for one collective)."""
    return torch.cat([t.reshape(-1).to(device) for t in bucket])


def unpack(flat: torch.Tensor, bucket: list[torch.Tensor]) -> None:
    """Copy a flat buffer back into the bucket's tensors, in order (the inverse of `pack`)."""
    offset = 0
    for t in bucket:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()
