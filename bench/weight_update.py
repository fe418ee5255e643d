"""One weight update into the running vLLM engine, side by side in one run: the direct copy into the parameters
vLLM computes with (common/explorer/vllm_worker.py `_worker_copy_plan`, the default) vs vLLM's `reload_weights` (the
previous path), and a plain memcpy of the same bytes as the floor.

    python bench/weight_update.py                  # default model (SmolLM2-135M, fp32: 513 MB)
    python bench/weight_update.py --dtype bfloat16 # the bf16 wire/engine format (a trainer training in bf16)
    python bench/weight_update.py --model tiny-vllm --repeats 2   # smoke run

Each update writes new weights into weight_buffers() (what broadcast_weights leaves there), commits them, and checks
the checksum the vLLM worker reads back from the weights it computes with against the HF model's. Prints the best
of --repeats per path (timed alternately, so both see the same machine load); --json writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="default | tiny-vllm | an HF folder")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from common.explorer.engine_vllm import VLLMEngine
    from common.model import save_servable_tiny
    from common.model import resolve_model
    from common.weight_sync import weights_hash

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
            engine.commit_weights(buffers)
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
