"""Many tensors as a few flat buffers: one collective each (the weight broadcast, common/weight_sync/broadcast.py, and
the data-parallel gradient all-reduce, common/trainer/parallel.py), or one shared buffer with a byte layout (the
vLLM engine's receive buffers, the colocated weight hand-off)."""

from __future__ import annotations

import math
import os
import shutil

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


def flat_layout(shapes, align: int = 64) -> tuple[list, int]:
    """Where tensors of `shapes` ((name, shape, dtype) rows) lie back to back in one flat byte buffer: rows
    (name, shape, dtype name, byte offset), each start `align`-byte aligned, and the total size in bytes. Plain
    data, so it crosses process boundaries (vLLM's worker, the colocated weight hand-off)."""
    layout, offset = [], 0
    for name, shape, dtype in shapes:
        layout.append((name, list(shape), str(dtype).removeprefix("torch."), offset))
        offset += -(-math.prod(shape) * dtype.itemsize // align) * align
    return layout, offset


def flat_views(flat: torch.Tensor, layout: list) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a `flat_layout` as views into `flat` (a uint8 buffer, on whatever device it is)."""
    views = []
    for name, shape, dtype_name, offset in layout:
        dtype = getattr(torch, dtype_name)
        views.append((name, flat[offset: offset + math.prod(shape) * dtype.itemsize].view(dtype).view(tuple(shape))))
    return views


SHM_HINT = "docker run --shm-size; Kubernetes: an emptyDir with medium: Memory mounted at /dev/shm"


def shared_memory_dir() -> str:
    """Where weights shared between processes are laid out: /dev/shm (memory), else $TMPDIR."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")


def map_shared_file(path: str, size: int, create: bool = False) -> torch.Tensor:
    """A file (in /dev/shm: shared memory) as a flat uint8 CPU tensor every process that maps it sees and writes;
    `create` makes it first, its pages reserved (a full /dev/shm is this one-line error, not a SIGBUS later)."""
    if create:
        with open(path, "wb") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, max(size, 1))
            except OSError as e:
                free = shutil.disk_usage(os.path.dirname(path)).free
                raise RuntimeError(f"no room for {size / 2**20:.0f} MB of weights in {os.path.dirname(path)} "
                                   f"({free / 2**20:.0f} MB free: {e.strerror}); enlarge it ({SHM_HINT})") \
                    from None
    return torch.from_file(path, shared=True, size=max(size, 1), dtype=torch.uint8)[:size]


def remove_shared_file(path: str) -> None:
    """Remove a `map_shared_file` file's name (processes that mapped it keep their mapping), whoever comes first:
    another side, or a worker's group guard, may have removed it already."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
