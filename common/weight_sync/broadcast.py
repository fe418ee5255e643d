"""--sync-method broadcast: trainer rank 0 -> explorer(s) over torch.distributed (nccl on CUDA, gloo on CPU).

Parameters are packed into flat buckets of `--sync-bucket-mb` per dtype so one sync is a handful of collectives
rather than one per tensor. The same code runs on both sides: the sender packs from its parameters, receivers
unpack into theirs (`RolloutEngine.weight_buffers()`), so shapes and order must match: both are the HF
named_parameters order. A version number travels with the weights.

In flight (`push(wait=False)`, the asynchronous schedule): the weights are snapshotted, the store announces that a
version is waiting, and a thread runs the broadcast while the trainer trains on; explorers join it from `poll`,
between generation batches (vLLM: between decode steps).

Sharded trainers (`--trainer-shard fsdp`) hand over DTensor shards: trainer 0 gathers each whole tensor
(`full_tensor`, a collective over the trainers) as it packs a bucket, so it never holds more than about a bucket of
gathered weights on its device; the other trainers join those gathers in the same order (`WeightSync.push`).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time

import torch
import torch.distributed as dist

from common.buckets import pack, tensor_buckets, unpack
from common.runtime.channel import StoreValue
from common.weight_sync.base import Buffers, WeightSync, full_tensor, has_dtensors


def tensor_layout(named_tensors) -> list[list]:
    """[name, shape, dtype] of every tensor, in order: what sender and receivers must agree on (a DTensor: its
    global shape)."""
    return [[n, list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in named_tensors]


def layout_hash(layout: list) -> int:
    """64 bits of the sha256 of a `tensor_layout`, as a signed int64 for the broadcast header."""
    return int.from_bytes(hashlib.sha256(json.dumps(layout).encode()).digest()[:8], "little", signed=True)


def first_difference(mine: list, sent: list) -> str:
    """The first tensor where this rank's `tensor_layout` and the sender's differ, in words."""
    for i, (a, b) in enumerate(zip(mine, sent)):
        if a != b:
            return f"tensor {i}: trainer0 sends {b[0]} {b[1]} {b[2]}, this rank expects {a[0]} {a[1]} {a[2]}"
    return f"trainer0 sends {len(sent)} tensors, this rank expects {len(mine)}"


@torch.no_grad()
def broadcast_weights(named_tensors: list[tuple[str, torch.Tensor]], version: int, src: int, group=None,
                      device: str | torch.device = "cpu", bucket_mb: int = 256) -> tuple[int, float]:
    """Broadcast `version` and every tensor from global rank `src` to all ranks of `group`.

    Returns (version, time the header arrived): before that a receiver was waiting for the sender, after it the
    weights were moving.

    Collective: every rank of the group calls it with tensors of the same names, shapes, dtypes and order. The
    header carries a hash of the sender's (name, shape, dtype) list and every rank says whether its own differs
    (one small all-reduce) before any bucket moves: a difference is an error on every rank, the receiver's naming
    the first differing tensor, where buckets of different sizes would hang or fill tensors with the wrong bytes.
    `device` is where the flat buffers live (cuda for nccl, cpu for gloo).
    """
    layout = tensor_layout(named_tensors)
    head = torch.tensor([version, layout_hash(layout)], dtype=torch.long, device=device)
    dist.broadcast(head, src=src, group=group)
    header_time = time.time()
    sender = dist.get_rank() == src
    differs = torch.tensor([int(head[1].item() != layout_hash(layout))], dtype=torch.long, device=device)
    dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=group)
    if differs.item():
        sent = [layout if sender else None]
        dist.broadcast_object_list(sent, src=src, group=group, device=device)
        if sent[0] == layout:  # the sender, or a receiver that agrees with it
            raise RuntimeError("weight sync: an explorer's (name, shape, dtype) list differs from trainer0's (that "
                               "explorer's error names the first tensor)")
        raise RuntimeError(f"weight sync: {first_difference(layout, sent[0])}")
    tensors = [t.detach() for _, t in named_tensors]
    for bucket in tensor_buckets(tensors, bucket_mb << 20):
        flat = (pack([full_tensor(t).detach() for t in bucket], device) if sender  # sharded: gathered bucket by bucket
                else torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=device))
        dist.broadcast(flat, src=src, group=group)
        if not sender:
            unpack(flat, bucket)
    return int(head[0].item()), header_time


class BroadcastSync(WeightSync):
    name = "broadcast"

    def __init__(self, ctx, args, timeline, engine=None):
        super().__init__(ctx, args, timeline, engine)
        self.announced = StoreValue(ctx.store, "weight_sync/announced", -1)  # an in-flight version to join
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _broadcast(self, named_tensors, version):
        return broadcast_weights(named_tensors, version, self.ctx.sync_src, self.ctx.sync_group, self.ctx.comm_device,
                                 self.args.sync_bucket_mb)

    def _send(self, named_tensors, version, step, wait, check):
        if wait:
            with self.timeline.phase("sync", step=step, version=version, **check):
                self._broadcast(named_tensors, version)
            return
        start = time.time()
        # sharded: the gathered snapshot goes to host memory (the device keeps only the shards)
        snapshot = [(n, full_tensor(t).detach().to("cpu" if has_dtensors(named_tensors) else t.device, copy=True))
                    for n, t in named_tensors]
        self.timeline.record("sync", start, time.time(), step=step, version=version, snapshot=True, **check)
        self.announced.value = version
        self._thread = threading.Thread(target=self._run_in_flight, args=(snapshot, version, step), daemon=True)
        self._thread.start()

    def _run_in_flight(self, snapshot, version, step):
        try:
            with self.timeline.phase("sync-in-flight", step=step, version=version):
                self._broadcast(snapshot, version)
        except BaseException as e:  # handed to the trainer's thread by wait()
            self._error = e

    def wait(self):
        if self._thread is not None:
            start = time.time()
            self._thread.join(timeout=self.args.timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"trainer0: weight broadcast not joined by every explorer within "
                                   f"{self.args.timeout_s:.0f}s")
            if time.time() - start > 0.01:
                self.timeline.record("wait", start, time.time(), reason="previous broadcast")
            self._thread = None
        if self._error is not None:
            raise RuntimeError("in-flight weight broadcast failed") from self._error

    def pull(self, step):
        """Join the trainer's next broadcast (a collective: it waits for the trainer)."""
        start = time.time()
        buffers = self.engine.weight_buffers()
        self.version, arrived = self._broadcast(buffers, 0)
        self.engine.load_weights(Buffers(), self.version)
        self.timeline.record("wait", start, arrived, step=step)
        self.timeline.record("sync", arrived, time.time(), step=step, version=self.version, **self._checked())
        return self.version

    def poll(self, step):
        if self.announced.value <= self.version:
            return False
        self.pull(step)
        return True
