"""Weight broadcast over a real gloo world: after the sync every receiver is bit-identical to the sender."""

import json
import os

import pytest
import torch

from common.runtime.launcher import run_function
from common.weight_sync import weights_hash
from common.weight_sync.broadcast import broadcast_weights


def ranks(ctx, out_dir, bucket_mb):
    torch.manual_seed(ctx.rank)  # every rank starts with different weights
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 7))
    named = list(model.named_parameters())
    before = weights_hash(named)
    version, _ = broadcast_weights(named, version=5 if ctx.rank == 0 else -1, src=0, bucket_mb=int(bucket_mb))
    with open(os.path.join(out_dir, f"{ctx.rank}.json"), "w") as f:
        json.dump([ctx.rank, version, before, weights_hash(named)], f)


@pytest.mark.parametrize("bucket_mb", [0, 256])  # 0: one bucket per tensor; 256: everything in one bucket
def test_broadcast_makes_receivers_bit_identical(bucket_mb, tmp_path):
    run_function("test_weight_sync:ranks", 1, 2, str(tmp_path), str(bucket_mb))
    got = [json.load(open(tmp_path / f"{rank}.json")) for rank in range(3)]
    sender_hash = got[0][3]
    assert got[0][2] == sender_hash
    for rank, version, before, after in got[1:]:
        assert version == 5
        assert before != sender_hash and after == sender_hash
