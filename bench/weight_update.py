"""Weight hand-off benchmarks, each side by side in one run.

--handoff: trainer rank 0 -> one explorer in two real processes, per weight-sync method (common/weight_sync/):
broadcast (today's path for ranks that share a device: gloo through the CPU) vs colocated (one shared buffer:
/dev/shm on CPU, CUDA IPC on a GPU). Random weights of the model's shapes; each hand-off is timed from the
trainer's push to the explorer holding the weights. `handoff_gbps(model, device)` is the same as a function (make
gpu-check calls it on a GPU).

    python bench/weight_update.py --handoff                          # default model (SmolLM2-135M, fp32: 513 MB), cpu
    python bench/weight_update.py --handoff --model qwen2.5-1.5b --dtype bfloat16 --device cuda

Without --handoff: one weight update into the running vLLM engine: the direct copy into the parameters vLLM
computes with (common/explorer/vllm_worker.py `_worker_copy_plan`, the default) vs vLLM's `reload_weights` (the
reference path), and a plain memcpy of the same bytes as the floor.

    python bench/weight_update.py                  # default model (SmolLM2-135M, fp32: 513 MB)
    python bench/weight_update.py --dtype bfloat16 # the bf16 wire/engine format (a trainer training in bf16)
    python bench/weight_update.py --model tiny-vllm --repeats 2   # smoke run

Each update writes new weights into weight_buffers() (what a weight-sync method leaves there), loads them, and
checks the checksum the vLLM worker reads back from the weights it computes with against the HF model's. Prints the
best of --repeats per path (timed alternately, so both see the same machine load); --json writes the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Shapes of models not at hand here (random weights of these shapes are all a hand-off needs).
CONFIGS = {
    "qwen2.5-1.5b": {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": True,
                     "attention_bias": True},
}


def model_shapes(model) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a Llama / Qwen2-style decoder's parameters: `model` is a name of CONFIGS, `default`, an HF
    folder, or a config dict."""
    if isinstance(model, str) and model in CONFIGS:
        model = CONFIGS[model]
    elif isinstance(model, str):
        from common.model import resolve_model

        model = json.load(open(os.path.join(resolve_model(model), "config.json")))
    h, inter, vocab = model["hidden_size"], model["intermediate_size"], model["vocab_size"]
    heads = model["num_attention_heads"]
    kv = model.get("num_key_value_heads", heads) * model.get("head_dim", h // heads)
    q = heads * model.get("head_dim", h // heads)
    shapes = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(model["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                   (p + "self_attn.v_proj.weight", (kv, h))]
        if model.get("attention_bias"):
            shapes += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                       (p + "self_attn.v_proj.bias", (kv,))]
        shapes += [(p + "self_attn.o_proj.weight", (h, q)), (p + "mlp.gate_proj.weight", (inter, h)),
                   (p + "mlp.up_proj.weight", (inter, h)), (p + "mlp.down_proj.weight", (h, inter)),
                   (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    shapes.append(("model.norm.weight", (h,)))
    if not model.get("tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (vocab, h)))
    return shapes


class _Receiver:
    """An explorer's engine as a weight-sync method sees it: its weight buffers (on its device) and a load."""

    def __init__(self, named):
        from common.weight_sync.base import Buffers

        self.named = named
        self.accepts = (Buffers,)  # (common/explorer/engine.py RolloutEngine) the buffers are copied into

    def weight_buffers(self):
        return self.named

    def load_weights(self, source, version=None):
        pass


def _handoff_rank(rank, port, out_dir, shapes, device, dtype, methods, repeats, timeout_s, results):
    from datetime import timedelta
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from common.runtime.worker import WorkerContext, place_of
    from common.runtime.metrics import Timeline
    from common.weight_sync import METHODS

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    base = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", base), rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout_s))
    role = "trainer" if rank == 0 else "explorer"
    ctx = WorkerContext(name=f"{role}0", role=role, index=0, rank=rank, world_size=2, device=device, backend="gloo",
                        trainer_ranks=[0], explorer_ranks=[1], names=["trainer0", "explorer0"],
                        places=[place_of(device)] * 2, sync_group=dist.new_group([0, 1]), store=dist.PrefixStore("run", base))
    args = SimpleNamespace(timeout_s=timeout_s, verify_sync=False, sync_bucket_mb=256, out_dir=out_dir)
    gen = torch.Generator(device=device).manual_seed(rank)
    named = [(n, torch.randn(shape, generator=gen, device=device).to(dtype)) for n, shape in shapes]
    timeline = Timeline(out_dir, ctx.name)
    times = {}
    for method in methods:
        sync = METHODS[method](ctx, args, timeline, None if rank == 0 else _Receiver(named))
        times[method] = []
        for version in range(repeats + 1):  # version 0: warm-up (allocations, the explorer opening the slot)
            dist.barrier(group=ctx.sync_group)
            if rank == 0:
                start = time.time()
                ctx.store.set(f"start/{method}/{version}", repr(start))
                sync.push(named, version, version)
            else:
                got = sync.pull(version)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                end = time.time()
                if got != version:
                    raise RuntimeError(f"{method}: explorer took v{got}, trainer sent v{version}")
                if version:
                    times[method].append(end - float(ctx.store.get(f"start/{method}/{version}")))
        sync.wait()
        # The explorer holds the trainer's weights bit for bit: integer sums of the raw bits, per tensor.
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]
        digest = json.dumps([int(t.view(bits).to(torch.int64).sum()) for _, t in named])
        if rank == 0:
            ctx.store.set(f"digest/{method}", digest)
        else:
            times[f"{method}_exact"] = digest == ctx.store.get(f"digest/{method}").decode()
        dist.barrier(group=ctx.sync_group)
    if rank == 1:
        results.put(times)
    dist.barrier(group=ctx.sync_group)
    dist.destroy_process_group()


def handoff_gbps(model="default", device: str = "cpu", dtype: str = "float32",
                 methods=("broadcast", "colocated"), repeats: int = 3, timeout_s: float = 300) -> dict:
    """Weight hand-off from a trainer process to an explorer process on `device` (both on it: colocated), per
    weight-sync method. Returns {"weights_gb", "device", "dtype", method: {"gbps", "best_s", "all_s",
    "bit_identical"}}; GB/s is the weights' bytes over the best hand-off time (push start to the explorer holding
    them); bit_identical: the explorer's weights equal the trainer's afterwards."""
    import socket
    import tempfile

    import torch
    import torch.multiprocessing as mp

    if device == "cuda":
        device = "cuda:0"  # both processes on one explicit GPU
    torch_dtype = getattr(torch, dtype)
    shapes = model_shapes(model)
    size = sum(math.prod(s) for _, s in shapes) * torch_dtype.itemsize
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="bench-handoff-") as out_dir:
        procs = [ctx.Process(target=_handoff_rank, args=(r, port, out_dir, shapes, device, torch_dtype, list(methods),
                                                          repeats, timeout_s, results)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            deadline, times = time.time() + timeout_s * (len(methods) + 1), None
            while times is None:
                try:
                    times = results.get(timeout=1)
                except queue.Empty:
                    failed = [p.exitcode for p in procs if p.exitcode]
                    if failed or time.time() > deadline:
                        raise RuntimeError(f"hand-off benchmark: a rank failed (exit codes {failed}) or ran past "
                                           f"{timeout_s * (len(methods) + 1):.0f}s") from None
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"hand-off benchmark: a rank failed (exit codes {[p.exitcode for p in procs]})")
    out = {"weights_gb": round(size / 1e9, 3), "device": device, "dtype": dtype}
    for method in methods:
        ts = times[method]
        out[method] = {"gbps": round(size / 1e9 / min(ts), 2), "best_s": round(min(ts), 4),
                       "all_s": [round(t, 4) for t in ts], "bit_identical": times[f"{method}_exact"]}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="default | tiny-vllm | qwen2.5-1.5b (--handoff) | an HF "
                                                           "folder")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--handoff", action="store_true", help="trainer -> explorer per weight-sync method")
    parser.add_argument("--device", default="cpu", help="--handoff: cpu | cuda (trainer and explorer share it)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if args.handoff:
        results = handoff_gbps(args.model, args.device, args.dtype, repeats=args.repeats)
        ratio = results["colocated"]["best_s"] and results["broadcast"]["best_s"] / results["colocated"]["best_s"]
        results["speedup_colocated_vs_broadcast"] = round(ratio, 1)
        print(f"[bench] hand-off of {results['weights_gb']} GB ({args.model}, {args.dtype}) on {args.device}, best "
              f"of {args.repeats}: broadcast {results['broadcast']['best_s']} s ({results['broadcast']['gbps']} "
              f"GB/s), colocated {results['colocated']['best_s']} s ({results['colocated']['gbps']} GB/s): "
              f"x{results['speedup_colocated_vs_broadcast']}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return results

    import torch
    from transformers import AutoModelForCausalLM

    from common.explorer.engine_vllm import VLLMEngine
    from common.model import save_servable_tiny
    from common.model import resolve_model
    from common.weight_sync import Buffers, weights_hash

    path = save_servable_tiny(tempfile.mkdtemp(prefix="bench-wu-")) if args.model == "tiny-vllm" \
        else resolve_model(args.model)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    engine = VLLMEngine(path, dtype=args.dtype, kv_cache_gb=0.5)
    buffers = engine.weight_buffers()
    named = dict(hf.named_parameters())
    size_mb = sum(t.numel() * t.element_size() for _, t in buffers) / 2**20
    print(f"[bench] {args.model} {args.dtype}: {size_mb:.1f} MB of weights, torch threads {torch.get_num_threads()}",
          flush=True)
    flat = torch.empty(sum(t.numel() for _, t in buffers), dtype=dtype)
    times = {"memcpy": [], "copy": [], "reload": []}
    checks = {"copy": [], "reload": []}
    for r in range(args.repeats):
        for how in ("copy", "reload"):
            with torch.no_grad():
                for p in hf.parameters():
                    p.mul_(1.0001)
                for name, t in buffers:
                    t.copy_(named[name])
                start = time.perf_counter()
                torch.cat([t.reshape(-1) for _, t in buffers], out=flat)  # the same bytes, one plain copy
                times["memcpy"].append(time.perf_counter() - start)
            engine.fast_sync = how == "copy"
            engine.load_weights(Buffers())
            times[how].append(engine.last_update_s)
            checks[how].append(engine.weights_checksum() == weights_hash(hf.named_parameters()))
    engine.close()
    best = {k: round(min(v), 3) for k, v in times.items()}
    results = {"model": args.model, "dtype": args.dtype, "weights_mb": round(size_mb, 1), "best_s": best,
               "all_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
               "checksum_equal": {k: all(v) for k, v in checks.items()},
               "speedup_copy_vs_reload": round(best["reload"] / best["copy"], 2)}
    print(f"[bench] one update, best of {args.repeats}: memcpy {best['memcpy']} s, direct copy {best['copy']} s, "
          f"reload_weights {best['reload']} s (copy is x{results['speedup_copy_vs_reload']} faster; "
          f"checksums equal: {results['checksum_equal']})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":  # vLLM spawns its engine core: keep the work under this guard
    main()
