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


def mismatched_ranks(ctx, out_dir):
    """explorer1 (rank 2) holds its second layer's bias in float64: a layout trainer0 does not send."""
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 7))
    if ctx.rank == 2:
        model[1].bias.data = model[1].bias.data.double()
    try:
        broadcast_weights(list(model.named_parameters()), version=1, src=0, bucket_mb=256)
        error = None
    except RuntimeError as e:
        error = str(e)
    with open(os.path.join(out_dir, f"{ctx.rank}.json"), "w") as f:
        json.dump(error, f)


def test_a_layout_that_differs_is_an_error_naming_the_tensor_not_a_hang(tmp_path):
    """Buckets of different byte counts would hang the broadcast (or fill tensors with the wrong bytes): the
    (name, shape, dtype) hash in the header stops every rank before any bucket moves."""
    run_function("test_weight_sync:mismatched_ranks", 1, 2, str(tmp_path), timeout_s=60)
    errors = [json.load(open(tmp_path / f"{rank}.json")) for rank in range(3)]
    assert errors[2] == "weight sync: tensor 3: trainer0 sends 1.bias [7] float32, this rank expects 1.bias [7] float64"
    assert errors[0] == errors[1] and "explorer's (name, shape, dtype) list differs" in errors[0]
