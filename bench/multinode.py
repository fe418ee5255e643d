"""Multi-node costs on this machine, side by side in one invocation:

1. The experience buffer's transport: rollout batches (lists of Experience, as the explorers send them) through
   the run's mailbox (gloo point-to-point + the agent's store, common/runtime/channel.py) vs through a
   multiprocessing queue (shared memory + pipe, the single-node alternative): MB/s and batches/s of each.
2. The same asynchronous run (1 trainer + 2 explorers, tiny model) launched as one node (`python train_async.py`)
   and as two localhost nodes (two torchrun agents: trainer + explorer0 on node 0, explorer1 on node 1):
   wall-clock ratio.

    python bench/multinode.py                  # both
    python bench/multinode.py --buffer-only
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def make_batch(samples: int, tokens: int):
    from common.experience import Experience, RolloutBatch

    exps = [Experience(prompt_ids=list(range(200)), response_ids=list(range(tokens)), logprobs=[-0.5] * tokens,
                       loss_mask=[1] * tokens, reward=1.0, group_id=i // 8, task_id=f"t{i}", policy_version=3)
            for i in range(samples)]
    return RolloutBatch(1, exps, {"rollout/tokens": samples * tokens})


def mailbox_ranks(ctx, batches, samples, tokens, out):
    from common.runtime.channel import Mailbox

    batches, samples, tokens = int(batches), int(samples), int(tokens)
    mailbox = Mailbox(ctx, capacity=2)
    if ctx.role == "explorer":
        batch = make_batch(samples, tokens)
        for _ in range(batches):
            mailbox.put_batch(batch, 60, ctx.name)
    else:
        got = [mailbox.get_batch(60)]  # the first one starts the clock (rank start-up is not the transport)
        start = time.perf_counter()
        got += [mailbox.get_batch(60) for _ in range(batches - 1)]
        with open(out, "w") as f:
            json.dump({"seconds": time.perf_counter() - start, "batches": batches - 1}, f)
    mailbox.close(60)


def _mp_sender(q, batches, samples, tokens):
    batch = make_batch(samples, tokens)
    for _ in range(batches):
        q.put(batch)


def mp_queue(batches, samples, tokens) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue(maxsize=2)
    p = ctx.Process(target=_mp_sender, args=(q, batches, samples, tokens))
    p.start()
    q.get(timeout=120)
    start = time.perf_counter()
    for _ in range(batches - 1):
        q.get(timeout=120)
    seconds = time.perf_counter() - start
    p.join()
    return {"seconds": seconds, "batches": batches - 1}


def buffer(opts) -> None:
    import pickle

    from common.runtime.launcher import run_function

    size_mb = len(pickle.dumps(make_batch(opts.samples, opts.tokens))) / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "mailbox.json")
        run_function("multinode:mailbox_ranks", 1, 1, str(opts.batches), str(opts.samples), str(opts.tokens), out)
        gloo = json.load(open(out))
    queue = mp_queue(opts.batches, opts.samples, opts.tokens)
    print(f"buffer: {opts.samples} samples x {opts.tokens} tokens per batch = {size_mb:.2f} MB pickled")
    for name, r in (("mailbox (gloo p2p + store)", gloo), ("multiprocessing queue", queue)):
        rate = r["batches"] / r["seconds"]
        print(f"  {name:28s} {rate:8.1f} batches/s  {rate * size_mb:8.1f} MB/s")
    print(f"  mailbox / queue throughput: {(gloo['batches'] / gloo['seconds']) / (queue['batches'] / queue['seconds']):.2f}x")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def runs(opts) -> None:
    flags = ["--model", "tiny", "--taskset", "parity", "--tasks-per-step", "8", "--samples-per-task", "4",
             "--max-new-tokens", "32", "--eval-every", "0", "--engine", "hf", "--num-threads", "1",
             "--num-explorers", "2", "--steps", str(opts.steps), "--checkpoint-every", "0"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    script = os.path.join(ROOT, "train_async.py")
    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(opts.trials):
            start = time.time()
            subprocess.run([sys.executable, script, *flags, "--out-dir", f"{tmp}/one{trial}"], env=env, check=True,
                           capture_output=True)
            times.setdefault("one node", []).append(time.time() - start)
            port, start = _port(), time.time()
            agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--master-addr", "127.0.0.1",
                     "--master-port", str(port)]
            nodes = [subprocess.Popen([*agent, "--node-rank", str(r), "--nproc-per-node", str(2 - r), script, *flags,
                                       "--out-dir", f"{tmp}/two{trial}"], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL) for r in (0, 1)]
            assert all(p.wait(timeout=1200) == 0 for p in nodes)
            times.setdefault("two nodes", []).append(time.time() - start)
    one, two = min(times["one node"]), min(times["two nodes"])
    print(f"async run, {opts.steps} steps, 1 trainer + 2 explorers (best of {opts.trials}): one node {one:.1f}s, "
          f"two localhost nodes {two:.1f}s: {two / one:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--samples", type=int, default=64, help="experiences per rollout batch")
    parser.add_argument("--tokens", type=int, default=1024, help="response tokens per experience")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--buffer-only", action="store_true")
    opts = parser.parse_args()
    buffer(opts)
    if not opts.buffer_only:
        runs(opts)
