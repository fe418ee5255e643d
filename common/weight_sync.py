"""Trainer rank 0 -> explorer(s) weight sync over torch.distributed (nccl on CUDA, gloo on CPU).

Parameters are packed into flat buckets of `bucket_mb` per dtype so one sync is a handful of collectives rather
than one per tensor. The same code runs on both sides: the sender packs from its parameters, receivers unpack into
theirs (`RolloutEngine.weight_buffers()`), so shapes and order must match: both are the HF named_parameters order.
A version number travels with the weights.

Sharded trainers (`--trainer-shard fsdp`) hand over DTensor shards: trainer 0 gathers each whole tensor
(`full_tensor`, a collective over the trainers) as it packs a bucket, so it never holds more than about a bucket of
gathered weights on its device; the other trainers join those gathers in the same order
(`WeightSender.push` -> `join_gathers`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time

import torch
import torch.distributed as dist

from common.buckets import pack, tensor_buckets, unpack


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor shard is all-gathered (every rank of its mesh must call this in the same order);
    a plain tensor is returned as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def has_dtensors(named_tensors) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for _, t in named_tensors)


def join_gathers(named_tensors, passes: int = 1) -> None:
    """A trainer other than 0 takes part in trainer 0's `passes` gathers of sharded weights (results dropped)."""
    from torch.distributed.tensor import DTensor

    for _ in range(passes):
        for _, t in named_tensors:
            if isinstance(t, DTensor):
                t.full_tensor()


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
    for bucket in tensor_buckets(tensors, bucket_mb << 20):
        sender = dist.get_rank() == src
        flat = (pack([full_tensor(t).detach() for t in bucket], device) if sender  # sharded: gathered bucket by bucket
                else torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=device))
        dist.broadcast(flat, src=src, group=group)
        if not sender:
            unpack(flat, bucket)
    return int(head[0].item()), header_time


def weights_hash(named_tensors) -> str:
    """sha256 over names and raw bytes: equal iff the weights are bit-identical."""
    h = hashlib.sha256()
    for name, t in named_tensors:
        h.update(name.encode())
        h.update(full_tensor(t).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- checkpoint sync (files on disk)
def write_sync_checkpoint(sync_dir: str, named_tensors, version: int, keep: int = 3) -> str:
    """safetensors + version, atomically: written to a temp folder, renamed, then LATEST is replaced by rename.

    A reader that sees LATEST = v finds v complete; a writer killed mid-save leaves only a temp folder behind.
    """
    from safetensors.torch import save_file

    os.makedirs(sync_dir, exist_ok=True)
    final = os.path.join(sync_dir, f"v{version}")
    tmp = os.path.join(sync_dir, f".tmp-v{version}-{os.getpid()}")
    os.makedirs(tmp, exist_ok=True)
    # sharded: gathered one tensor at a time into host memory (the file is written whole)
    save_file({name: full_tensor(t).detach().cpu().contiguous() for name, t in named_tensors},
              os.path.join(tmp, "model.safetensors"))
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    with open(os.path.join(sync_dir, ".LATEST.tmp"), "w") as f:
        f.write(str(version))
    os.replace(os.path.join(sync_dir, ".LATEST.tmp"), os.path.join(sync_dir, "LATEST"))
    for old in sorted((int(d[1:]) for d in os.listdir(sync_dir) if d.startswith("v") and d[1:].isdigit()))[:-keep]:
        shutil.rmtree(os.path.join(sync_dir, f"v{old}"), ignore_errors=True)
    return final


def latest_sync_version(sync_dir: str) -> int:
    try:
        with open(os.path.join(sync_dir, "LATEST")) as f:
            return int(f.read().strip())
    except FileNotFoundError:
        return -1


@torch.no_grad()
def load_sync_checkpoint(sync_dir: str, version: int, buffers) -> None:
    from safetensors.torch import load_file

    weights = load_file(os.path.join(sync_dir, f"v{version}", "model.safetensors"))
    for name, t in buffers:
        t.copy_(weights[name])


# ----------------------------------------------------------------------------- one API for every schedule
class WeightSender:
    """Trainer rank 0's side. `push` sends a version by broadcast or checkpoint, blocking or in flight.

    In flight (async schedules): the weights are snapshotted, `announced` tells explorers a version is waiting,
    and a thread runs the broadcast while the trainer trains on. Explorers join it between generation batches.
    """

    def __init__(self, ctx, args, timeline, announced=None):
        self.ctx, self.args, self.timeline, self.announced = ctx, args, timeline, announced
        self.sync_dir = os.path.join(args.out_dir, "sync")
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def push(self, named_tensors, version: int, step: int, method: str = "broadcast", in_flight: bool = False):
        if self.ctx.index != 0:  # data-parallel trainers other than rank 0 are not in the sync group
            if has_dtensors(named_tensors):  # ... but trainer 0 gathers from their shards: hash, then send/snapshot
                join_gathers(named_tensors, 1 + bool(self.args.verify_sync))
            return
        self.wait()  # collectives must not interleave: the previous in-flight broadcast finishes first
        check = {"hash": weights_hash(named_tensors)} if self.args.verify_sync else {}
        if method == "checkpoint":
            with self.timeline.phase("sync-checkpoint", step=step, version=version, **check):
                write_sync_checkpoint(self.sync_dir, named_tensors, version)
            return
        if not in_flight:
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

    def _broadcast(self, named_tensors, version):
        broadcast_weights(named_tensors, version, self.ctx.sync_src, self.ctx.sync_group, self.ctx.comm_device,
                          self.args.sync_bucket_mb)

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
                raise TimeoutError(f"weight broadcast not joined by every explorer within {self.args.timeout_s:.0f}s")
            if time.time() - start > 0.01:
                self.timeline.record("wait", start, time.time(), reason="previous broadcast")
            self._thread = None
        if self._error is not None:
            raise RuntimeError("in-flight weight broadcast failed") from self._error


class WeightReceiver:
    """An explorer's side: `pull()` blocks for the next broadcast; `poll()` takes a pending version if there is one."""

    def __init__(self, ctx, args, engine, timeline, announced=None):
        self.ctx, self.args, self.engine, self.timeline, self.announced = ctx, args, engine, timeline, announced
        self.sync_dir = os.path.join(args.out_dir, "sync")
        self.version = -1

    def pull(self, step: int, method: str = "broadcast") -> int:
        """Block until the trainer's next version is here: join its broadcast, or wait for its checkpoint."""
        if method == "checkpoint":
            start, wanted = time.time(), self.version + 1
            while latest_sync_version(self.sync_dir) < wanted:
                if time.time() - start > self.args.timeout_s:
                    raise TimeoutError(f"explorer: no sync checkpoint v{wanted} in {self.sync_dir} after "
                                       f"{self.args.timeout_s:.0f}s (trainer stalled?)")
                time.sleep(0.02)
            self.timeline.record("wait", start, time.time(), step=step)
            self.poll(step, method)
            return self.version
        start = time.time()
        buffers = self.engine.weight_buffers()
        self.version, arrived = broadcast_weights(buffers, 0, self.ctx.sync_src, self.ctx.sync_group,
                                                  self.ctx.comm_device, self.args.sync_bucket_mb)
        self.engine.commit_weights(buffers, self.version)
        self.timeline.record("wait", start, arrived, step=step)
        # read back from the engine (vLLM: from its worker), so a load that went wrong shows as a mismatch
        check = {"hash": self.engine.weights_checksum()} if self.args.verify_sync else {}
        self.timeline.record("sync", arrived, time.time(), step=step, version=self.version, **check)
        return self.version

    def poll(self, step: int, method: str = "broadcast") -> bool:
        """Between generation batches: take newer weights if the trainer has announced or written some."""
        if method == "checkpoint":
            latest = latest_sync_version(self.sync_dir)
            if latest <= self.version:
                return False
            start = time.time()
            self.engine.load_sync_checkpoint(self.sync_dir, latest)
            self.version = latest
            check = {"hash": self.engine.weights_checksum()} if self.args.verify_sync else {}
            self.timeline.record("sync-checkpoint", start, time.time(), step=step, version=latest, **check)
            return True
        if self.announced.value <= self.version:
            return False
        self.pull(step)
        return True
