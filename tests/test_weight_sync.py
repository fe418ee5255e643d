"""Weight broadcast over a real gloo world: after the sync every receiver is bit-identical to the sender."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.weight_sync import weights_hash
from common.weight_sync.broadcast import broadcast_weights


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, bucket_mb, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)  # every rank starts with different weights
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 7))
    named = list(model.named_parameters())
    before = weights_hash(named)
    version, _ = broadcast_weights(named, version=5 if rank == 0 else -1, src=0, bucket_mb=bucket_mb)
    results.put((rank, version, before, weights_hash(named)))
    dist.destroy_process_group()


@pytest.mark.parametrize("bucket_mb", [0, 256])  # 0: one bucket per tensor; 256: everything in one bucket
def test_broadcast_makes_receivers_bit_identical(bucket_mb):
    ctx = mp.get_context("spawn")
    results, world, port = ctx.Queue(), 3, _port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, bucket_mb, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    sender_hash = got[0][3]
    assert got[0][2] == sender_hash
    for rank, version, before, after in got[1:]:
        assert version == 5
        assert before != sender_hash and after == sender_hash
