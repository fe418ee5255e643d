"""Weight sync, trainer rank 0 -> explorers: one object per method (common/weight_sync/base.py `WeightSync`),
chosen once by `--sync-method` from `METHODS`. A new method is one file plus one line here."""

from __future__ import annotations

from common.weight_sync.base import WeightSync, full_tensor, weights_hash  # noqa: F401  (the shared helpers)
from common.weight_sync.broadcast import BroadcastSync
from common.weight_sync.checkpoint import CheckpointSync

METHODS: dict[str, type[WeightSync]] = {
    "broadcast": BroadcastSync,    # torch.distributed broadcast of flat buckets (nccl / gloo)
    "checkpoint": CheckpointSync,  # safetensors files in <out_dir>/sync that explorers poll
}


def make_weight_sync(args, ctx, timeline, engine=None) -> WeightSync:
    """The run's weight-sync method, for a trainer (engine None) or an explorer (the engine it loads into)."""
    return METHODS[args.sync_method](ctx, args, timeline, engine)


def check_weight_sync(ctx, args) -> None:
    """The method's start-up checks (every rank, before any model loads)."""
    METHODS[args.sync_method].check(ctx, args)
