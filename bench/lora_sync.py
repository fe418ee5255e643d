"""What a LoRA weight sync carries and what the explorer applies of it, on a real model (issue 52's measurement):
B entries moved by +-1e-4 and +-1e-3 (about ten AdamW steps at lr 1e-5), rank 8 on every linear layer, bf16 base.
For each size: the share of the update merging onto the bf16 grid loses; the relative error of the update the HF
engine and vLLM on this machine apply from the adapters (read back from what they compute with); bytes and
milliseconds of one adapter sync into each engine (copy into its buffers + load).

    python bench/lora_sync.py                     # default model (SmolLM2-135M-Instruct), HF engine and vLLM
    python bench/lora_sync.py --no-vllm --dtype float32
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from common import lora  # noqa: E402
from common.model import DTYPES, load_model, load_tokenizer, resolve_model  # noqa: E402
from common.weight_sync.base import Buffers  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def move_b(model, size: float) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in lora.adapter_tensors(model):
            if name.endswith("lora_B.weight"):
                t.copy_(size * (torch.randint(0, 2, t.shape, generator=g) * 2 - 1).float())


def deltas(named, scale):
    return {a_name.removesuffix(".lora_A.weight"): lora.adapter_delta(a, b, scale)
            for (a_name, a), (_, b) in zip(named[::2], named[1::2])}


def error(applied, wanted) -> float:
    return (sum((applied[k] - w).square().sum() for k, w in wanted.items())
            / sum(w.square().sum() for w in wanted.values())).sqrt().item()


def sync(engine, named, version) -> float:
    start = time.time()
    for (_, t), (_, src) in zip(engine.weight_buffers(), named):
        t.copy_(src)
    engine.load_weights(Buffers(), version)
    return time.time() - start


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--no-vllm", action="store_true")
    opts = p.parse_args()
    from common.explorer.engine import HFEngine, SamplingConfig

    spec, dtype = lora.LoraSpec(opts.rank, opts.alpha, TARGETS), DTYPES[opts.dtype]
    trainer = lora.add_lora(load_model(opts.model, dtype=dtype), spec)
    named = lora.adapter_tensors(trainer)
    adapter_mb = sum(t.numel() * t.element_size() for _, t in named) / 1e6
    merged_mb = sum(t.numel() * t.element_size() for _, t in lora.merged_named_weights(trainer)) / 1e6
    engines = {"HF": HFEngine(load_model(opts.model, dtype=dtype), load_tokenizer(opts.model), lora=spec)}
    if not opts.no_vllm:
        from common.explorer.engine_vllm import VLLMEngine

        engines["vLLM"] = VLLMEngine(resolve_model(opts.model), dtype=opts.dtype, kv_cache_gb=0.5,
                                     max_model_len=1024, lora=spec, lora_versions=2)
    print(f"{opts.model} {opts.dtype}, rank {spec.rank} alpha {spec.alpha:g} on {len(named) // 2} layers: "
          f"{adapter_mb:.1f} MB a sync (merged weights: {merged_mb:.0f} MB)")
    print(f"{'B moved by':>10} {'merge loses':>12} " + " ".join(f"{n + ' error':>11} {n + ' ms':>8}" for n in engines))
    try:
        for version, size in enumerate((1e-4, 1e-3)):
            move_b(trainer, size)
            wanted = deltas(lora.adapter_tensors(trainer), spec.scale)
            cells = []
            for name, engine in engines.items():
                seconds = sync(engine, lora.adapter_tensors(trainer), version)
                if name == "HF":
                    applied = deltas(engine.weight_buffers(), spec.scale)
                else:  # read back from vLLM's LoRA buffers once a request has activated the adapter
                    engine.generate([[1, 2, 3]], SamplingConfig(temperature=0, max_new_tokens=1))
                    path = os.path.join(tempfile.mkdtemp(), "deltas.safetensors")
                    engine.llm.collective_rpc("tandem_lora_deltas", args=(version + 1, path))
                    from safetensors.torch import load_file

                    applied = load_file(path)
                cells.append(f"{100 * error(applied, wanted):>10.2f}% {1e3 * seconds:>8.1f}")
            print(f"{size:>10g} {100 * lora.merge_lost_share(trainer):>11.1f}% " + " ".join(cells), flush=True)
    finally:
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    main()
