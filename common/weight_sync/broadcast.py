"""--sync-method broadcast: trainer rank 0 -> explorer(s) over torch.distributed (nccl on CUDA, gloo on CPU).

Parameters are packed into flat buckets of `--sync-bucket-mb` per dtype so one sync is a handful of collectives
rather than one per tensor. The same code runs on both sides: the sender packs from its parameters, receivers
unpack into theirs (`RolloutEngine.weight_buffers()`), so shapes and order must match: both are the HF
named_parameters order. A version number travels with the weights.

vLLM explorers (`--engine vllm`) receive in their engine's worker instead (`weights_group`: trainer0 and every
explorer's vLLM worker, a group of its own beside tandem's world): each bucket goes straight to the worker's device
and is copied into the parameters vLLM computes with, with no copy through the explorer's process or /dev/shm;
the explorer only tells its worker to join. The same protocol (header, layout check, buckets) runs on that group:
NCCL between GPUs, gloo on the CPU, where the suite tests it.

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
def broadcast_weights(named_tensors: list[tuple[str, torch.Tensor]], version: int, src: int | None = None,
                      group=None, device: str | torch.device = "cpu", bucket_mb: int = 256, *,
                      group_src: int | None = None, on_bucket=None) -> tuple[int, float]:
    """Broadcast `version` and every tensor from global rank `src` (or `group_src`, the sender's rank in `group`:
    a `weights_group` outside torch.distributed's world) to all ranks of `group`.

    Returns (version, time the header arrived): before that a receiver was waiting for the sender, after it the
    weights were moving.

    Collective: every rank of the group calls it with tensors of the same names, shapes, dtypes and order. The
    header carries a hash of the sender's (name, shape, dtype) list and every rank says whether its own differs
    (one small all-reduce) before any bucket moves: a difference is an error on every rank, the receiver's naming
    the first differing tensor, where buckets of different sizes would hang or fill tensors with the wrong bytes.
    `device` is where the flat buffers live (cuda for nccl, cpu for gloo). A receiver's `on_bucket` unpacks each
    bucket itself: it gets [(name, view into the received bucket)] (its `named_tensors` then need only shapes and
    dtypes: meta tensors do).
    """
    if group_src is None:
        group_src = src if group is None else dist.get_group_rank(group, src)
    sender = (dist.get_rank() if group is None else group.rank()) == group_src
    layout = tensor_layout(named_tensors)
    head = torch.tensor([version, layout_hash(layout)], dtype=torch.long, device=device)
    dist.broadcast(head, group=group, group_src=group_src)
    header_time = time.time()
    differs = torch.tensor([int(head[1].item() != layout_hash(layout))], dtype=torch.long, device=device)
    dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=group)
    if differs.item():
        sent = _broadcast_layout(layout if sender else None, group, group_src, device)
        if sent == layout:  # the sender, or a receiver that agrees with it
            raise RuntimeError("weight sync: an explorer's (name, shape, dtype) list differs from trainer0's (that "
                               "explorer's error names the first tensor)")
        raise RuntimeError(f"weight sync: {first_difference(layout, sent)}")
    names = iter([n for n, _ in named_tensors])
    for bucket in tensor_buckets([t.detach() for _, t in named_tensors], bucket_mb << 20):
        flat = (pack([full_tensor(t).detach() for t in bucket], device) if sender  # sharded: gathered bucket by bucket
                else torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=device))
        dist.broadcast(flat, group=group, group_src=group_src)
        if sender:
            continue
        if on_bucket is None:
            unpack(flat, bucket)
        else:
            pieces = flat.split([t.numel() for t in bucket])
            on_bucket([(next(names), piece.view(t.shape)) for piece, t in zip(pieces, bucket)])
    return int(head[0].item()), header_time


def _broadcast_layout(layout: list | None, group, group_src: int, device) -> list:
    """The sender's `tensor_layout` on every rank (only after the header said they differ)."""
    data = torch.frombuffer(bytearray(json.dumps(layout).encode()), dtype=torch.uint8).to(device) \
        if layout is not None else None
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.long, device=device)
    dist.broadcast(size, group=group, group_src=group_src)
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, group=group, group_src=group_src)
    return json.loads(bytes(data.cpu().tolist()))


def weights_group(host: str, port: int, rank: int, size: int, backend: str, timeout_s: float):
    """A process group outside torch.distributed's world (a vLLM worker already has a world of its own): trainer0
    (rank 0, which hosts its store at host:port) and the vLLM workers of every explorer, made by vLLM's own
    stateless group helpers; nccl between GPUs, gloo on the CPU. The broadcast above runs on it with
    `group_src=0`. Its store is made here, not by torch's rendezvous, which under torchrun connects to the agent's
    store instead of hosting one."""
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore
    from vllm.distributed.utils import init_gloo_process_group
    from vllm.platforms import current_platform

    timeout = timedelta(seconds=timeout_s)
    store = PrefixStore("tandem-weights", TCPStore(host, port, size, is_master=rank == 0, timeout=timeout))
    if backend == "gloo":
        return init_gloo_process_group(store, rank, size, timeout)
    return current_platform.stateless_init_device_torch_dist_pg(backend=backend, prefix_store=store, group_rank=rank,
                                                                group_size=size, timeout=timeout)


class BroadcastSync(WeightSync):
    name = "broadcast"

    def __init__(self, ctx, args, timeline, engine=None):
        super().__init__(ctx, args, timeline, engine)
        self.announced = StoreValue(ctx.store, "weight_sync/announced", -1)  # an in-flight version to join
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._workers = None  # trainer0, --engine vllm: the weights group with the explorers' vLLM workers

    @property
    def into_workers(self) -> bool:
        """Weights go straight into the vLLM workers' parameters (LoRA adapters go through the engine, which
        makes a vLLM adapter of each version: common/explorer/engine_vllm.py `_load_adapter`)."""
        return self.args.engine == "vllm" and not (self.args.lora_rank and self.args.lora_sync != "merged")

    def _broadcast(self, named_tensors, version):
        if self.into_workers:  # trainer0: straight into the vLLM workers (an explorer: `_receive`)
            return broadcast_weights(named_tensors, version, group=self._worker_group(), group_src=0,
                                     device=self.ctx.comm_device, bucket_mb=self.args.sync_bucket_mb)
        return broadcast_weights(named_tensors, version, self.ctx.sync_src, self.ctx.sync_group, self.ctx.comm_device,
                                 self.args.sync_bucket_mb)

    def _worker_group(self):
        """trainer0: the weights group with every explorer's vLLM worker (made at the first send: it waits for
        them all to join, common/explorer/engine_vllm.py `join_weights_group`). vLLM workers live in the engine
        core's process, outside tandem's world: the weights go straight into them, with no copy through the
        explorer's process and no /dev/shm (NCCL GPU to GPU where the world's sync runs on NCCL, else gloo)."""
        if self._workers is None:
            from vllm.utils.network_utils import get_ip, get_open_port

            backend = "nccl" if self.ctx.comm_device.type == "cuda" else "gloo"
            address = {"host": get_ip(), "port": get_open_port(), "backend": backend}
            self.ctx.store.set("weight_sync/workers", json.dumps(address))
            self._workers = weights_group(address["host"], address["port"], 0, 1 + len(self.ctx.explorer_ranks),
                                          backend, self.args.timeout_s)
        return self._workers

    def _receive(self) -> tuple[int, float]:
        """An explorer: join trainer0's next broadcast, into the engine's buffers (then loaded) or, with vLLM,
        straight into its worker (which joins the weights group first)."""
        if not self.into_workers:
            version, arrived = self._broadcast(self.engine.weight_buffers(), 0)
            self.engine.load_weights(Buffers(), version)
            return version, arrived
        if not self.engine.joined:
            address = json.loads(self.ctx.wait_key("weight_sync/workers", self.args.timeout_s,
                                                   "trainer0's weights group address"))
            self.engine.join_weights_group(address["host"], address["port"], 1 + self.ctx.index,
                                           1 + len(self.ctx.explorer_ranks), address["backend"], self.args.timeout_s)
        return self.engine.receive_broadcast(self.args.sync_bucket_mb)

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
        self.version, arrived = self._receive()
        self.timeline.record("wait", start, arrived, step=step)
        self.timeline.record("sync", arrived, time.time(), step=step, version=self.version, **self._checked())
        return self.version

    def poll(self, step):
        if self.announced.value <= self.version:
            return False
        self.pull(step)
        return True
