"""Weight sync, trainer rank 0 -> explorers: one object per method (common/weight_sync/base.py `WeightSync`),
chosen once by `--sync-method` from `METHODS`. A new method is one file plus one line here."""

from __future__ import annotations

from common.runtime.worker import ENGINE_READY
from common.weight_sync.base import (Buffers, Folder, Slot, WeightSource, WeightSync,  # noqa: F401
                                     full_tensor, weights_hash)  # (the shared helpers and weight sources)
from common.weight_sync.broadcast import BroadcastSync
from common.weight_sync.checkpoint import CheckpointSync
from common.weight_sync.colocated import ColocatedSync, colocated

METHODS: dict[str, type[WeightSync]] = {
    "broadcast": BroadcastSync,    # torch.distributed broadcast of flat buckets (nccl / gloo)
    "checkpoint": CheckpointSync,  # safetensors files in <out_dir>/sync that explorers poll
    "colocated": ColocatedSync,    # one shared buffer on trainer0's device (/dev/shm or CUDA IPC)
}


def resolve_method(ctx, args) -> str:
    """--sync-method auto: colocated where every explorer shares trainer0's node and device, else broadcast. Every
    rank reaches the same answer (common/weight_sync/colocated.py `colocated`)."""
    if args.sync_method == "auto":
        args.sync_method = "colocated" if colocated(ctx)[0] else "broadcast"
    return args.sync_method


def make_weight_sync(args, ctx, timeline, engine=None) -> WeightSync:
    """The run's weight-sync method, for a trainer (engine None) or an explorer (the engine it loads into, which is
    up: a trainer sharing its GPU may load now, common/run.py engines_first)."""
    if engine is not None:
        ctx.store.set(f"{ENGINE_READY}/{ctx.rank}", "1")
    return METHODS[resolve_method(ctx, args)](ctx, args, timeline, engine)


def check_weight_sync(ctx, args) -> None:
    """The method's start-up checks (every rank, before any model loads)."""
    METHODS[resolve_method(ctx, args)].check(ctx, args)
