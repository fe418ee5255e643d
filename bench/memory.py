"""Peak memory per trainer and step time across the memory levers, plus an estimate table for big models.

    python bench/memory.py                         # default model (SmolLM2-135M), 2 CPU trainers over gloo
    python bench/memory.py --model tiny --steps 2  # quick smoke run

Each setting runs 2 data-parallel trainer processes (common.runtime.launcher, gloo) on the same fixed batch of synthetic
experiences whose response lengths spread 10x, for --steps train steps (the first is a warm-up). Every trainer
reports its peak resident memory during the training steps (VmHWM, reset after the model was built, freed heap
handed back first) above what it held before the model was built (imports, tokenizer), the peak while building
it (every trainer loads the whole model before sharding it), what it holds between steps (weights, gradients,
optimizer state: no activations) and the time of its last step. Settings: replica (full copies, all-reduce), fsdp (FSDP2), fsdp+ckpt (activation
checkpointing), fsdp+ckpt+packing (--max-tokens-per-micro-batch), replica+lora (rank 16). CPU figures: the
accounting is the same on a GPU, the absolute numbers and step times are not (see README "Big models").

Then prints `estimate_table()`: per-GPU memory of a trainer on 80 GB GPUs by common/memory.py's accounting (what
the pre-flight check of every run uses). `--estimate-check 1024,2048,4096` instead compares that accounting with
measured CPU peaks (bench/train_step.py at each packed micro-batch size).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SETTINGS = {
    "replica": [],
    "fsdp": ["--trainer-shard", "fsdp"],
    "fsdp+ckpt": ["--trainer-shard", "fsdp", "--gradient-checkpointing"],
    "fsdp+ckpt+packing": ["--trainer-shard", "fsdp", "--gradient-checkpointing", "--max-tokens-per-micro-batch", "PACK"],
    "replica+lora": ["--lora-rank", "16", "--lora-alpha", "32"],
    "replica+packing": ["--max-tokens-per-micro-batch", "PACK"],
}


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    """Hand freed heap back to the OS, then restart the peak-RSS count (Linux: clear_refs 5 resets VmHWM)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def experiences(n: int, prompt_len: int, shortest: int, vocab: int, seed: int = 0):
    """n samples, response lengths spread evenly from `shortest` to 10x `shortest` tokens, 2 per group."""
    import random

    from common.experience import Experience

    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = shortest + (9 * shortest * i) // max(n - 1, 1)
        out.append(Experience([rng.randrange(vocab) for _ in range(prompt_len)], [rng.randrange(vocab) for _ in range(r)],
                              [-1.0] * r, [1] * r, float(i % 2), i // 2, f"t{i}", 0))
    return out


def worker(ctx, argv, steps, prompt_len, shortest, result_dir, setting, threads):
    import torch

    argv, steps, prompt_len, shortest = json.loads(argv), int(steps), int(prompt_len), int(shortest)
    torch.set_num_threads(int(threads))
    from common.cli import parse_args
    from common.trainer.parallel import DataParallel
    from common.trainer.trainer import Trainer
    from train_sync import Args

    args = parse_args(Args, argv)
    # what every setting loads anyway (code, not data), so the figures below are the model's and the step's own
    import peft  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from common.model import load_tokenizer

    load_tokenizer(args.model)
    before = _rss_mb("VmRSS")
    trainer = Trainer(args, ctx.device, DataParallel.from_context(ctx))
    batch = experiences(args.rollout_batch_size, prompt_len, shortest, trainer.model.config.vocab_size)
    load_peak = _rss_mb("VmHWM") - before
    _reset_peak()  # from here on: the training steps' own peak (loading the full model is a separate, first peak)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        metrics = trainer.train_step(batch)
        times.append(time.perf_counter() - start)
    tokens = sum(len(e.response_ids) for e in batch)
    peak = _rss_mb("VmHWM") - before
    import gc

    gc.collect()
    _reset_peak()
    held = _rss_mb("VmRSS") - before  # between steps: weights, gradients, optimizer state (no activations)
    with open(os.path.join(result_dir, f"{setting}-{ctx.name}.json"), "w") as f:
        json.dump({"peak_mb": peak, "load_peak_mb": load_peak, "held_mb": held, "step_s": times[-1], "tokens": tokens,
                   "grad_norm": metrics["grad_norm"], "threads": torch.get_num_threads()}, f)


def measure(setting, flags, opts, result_dir):
    from common.runtime.launcher import run_function

    argv = ["--model", opts.model, "--tasks-per-step", str(opts.samples // 2), "--samples-per-task", "2",
            "--minibatch-size", str(opts.samples), "--micro-batch-size", str(opts.micro_batch_size),
            "--no-drop-zero-signal-groups", "--trainer-devices", "cpu,cpu", "--max-new-tokens", str(10 * opts.shortest + 1),
            *[str(opts.pack_tokens) if f == "PACK" else f for f in flags]]
    run_function("memory:worker", 2, 0, json.dumps(argv), str(opts.steps), str(opts.prompt_len), str(opts.shortest),
                 result_dir, setting, str(opts.threads), timeout_s=1800)
    return [json.load(open(os.path.join(result_dir, f"{setting}-trainer{i}.json"))) for i in range(2)]


# ----------------------------------------------------------------------------- estimates for big models
MODELS = {  # public configs (transformers config class, fields)
    "Qwen2.5-1.5B": ("Qwen2Config", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                         tie_word_embeddings=True)),
    "Qwen2.5-7B": ("Qwen2Config", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                       tie_word_embeddings=False)),
    "Llama-3.1-8B": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                         tie_word_embeddings=False)),
}


def estimate_table(tokens: int = 16384, gpu_gib: float = 80) -> str:
    """Per-GPU memory of one bf16 trainer by common/memory.py's accounting (what the run's pre-flight check uses),
    one packed micro-batch of `tokens` tokens, for a few placements."""
    import transformers

    from common.cli import parse_args
    from common.memory import GIB, ModelShape, trainer_estimate
    from train_sync import Args

    cols = [("replica", 1, "none", False), ("replica+ckpt", 1, "none", True), ("fsdp x4+ckpt", 4, "fsdp", True),
            ("fsdp x8+ckpt", 8, "fsdp", True)]
    rows = [f"Per-GPU peak of one trainer (GiB; common/memory.py: bf16 parameters, gradients and AdamW moments, "
            f"{tokens} tokens per packed micro-batch), {gpu_gib:.0f} GB GPUs:",
            f"{'model':14s} " + " ".join(f"{c[0]:>13s}" for c in cols)]
    for name, (cls, fields) in MODELS.items():
        shape = ModelShape.from_config(getattr(transformers, cls)(**fields))
        cells = []
        for _, n, shard, ckpt in cols:
            args = parse_args(Args, ["--model", "tiny", "--dtype", "bfloat16", "--trainer-shard", shard,
                                     "--trainer-devices", ",".join(["cpu"] * n)])
            cells.append(trainer_estimate(shape, args, "cuda", tokens, tokens, ckpt).peak / GIB)
        rows.append(f"{name:14s} " + " ".join(f"{c:12.0f}{'!' if c > gpu_gib else ' '}" for c in cells))
    rows.append(f"! = over {gpu_gib:.0f} GB. An explorer GPU (vLLM) holds the bf16 weights (2 B/param) + KV cache.")
    return "\n".join(rows)


def estimate_check(token_counts: list[int], steps: int) -> list[dict]:
    """The estimate against what a CPU trainer measures: bench/train_step.py (default model, fp32, packed) at each
    micro-batch size in a fresh process, its peak resident memory next to common/memory.py's figure. The process
    runs with glibc's own mmap threshold, as a run does: freed blocks stay in its heap and count (the estimate's
    CPU_SLACK)."""
    import subprocess

    out = []
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    for tokens in token_counts:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, os.path.join(ROOT, "bench", "train_step.py"), "--tokens", str(tokens),
                            "--steps", str(steps), "--json", f.name], check=True, timeout=3600,
                           stdout=subprocess.DEVNULL, env=env)
            r = json.load(open(f.name))
        out.append(r)
        print(f"{tokens:6d} tokens/micro-batch: measured peak {r['peak_memory_gib']:.2f} GiB, estimate "
              f"{r['estimate_gib']:.2f} GiB ({r['estimate_gib'] / r['peak_memory_gib']:.2f}x)", flush=True)
    return out


def packing_throughput(model_name: str, repeats: int = 3, micro_batch_size: int = 4, pack_tokens: int = 512,
                       prompt_len: int = 16, shortest: int = 12) -> tuple[float, float]:
    """Trained tokens/s of the policy's forward+backward over one batch of 8 sequences whose responses spread 10x,
    padded micro-batches vs packed ones, in one process, alternating (best of `repeats` each), so a shared
    machine's load drifts over both alike."""
    import torch

    from common.experience import collate
    from common.model import load_model
    from common.trainer.forward import cut, sequence_logprobs, use_packed_attention

    model = load_model(model_name)
    model.config.use_cache = False
    use_packed_attention(model)
    batch = collate(experiences(8, prompt_len, shortest, model.config.vocab_size), 0)
    tokens = batch.response_mask.sum().item()
    best = {False: float("inf"), True: float("inf")}
    for _ in range(repeats):
        for packed in (False, True):
            start = time.perf_counter()
            lengths = batch.attention_mask.sum(-1)
            for idx in cut(torch.arange(len(batch)), lengths, micro_batch_size, pack_tokens if packed else 0):
                lp = sequence_logprobs(model, batch.input_ids[idx], batch.attention_mask[idx], 1.0,
                                       batch.response_mask[idx], packed=packed)
                lp.sum().backward()
            best[packed] = min(best[packed], time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    return tokens / best[False], tokens / best[True]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8, help="sequences per step (one minibatch)")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--shortest", type=int, default=12, help="shortest response; the longest is 10x")
    parser.add_argument("--pack-tokens", type=int, default=512, help="--max-tokens-per-micro-batch of the packing run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per trainer")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--estimates-only", action="store_true")
    parser.add_argument("--estimate-check", default=None, metavar="TOKENS,...",
                        help="only the estimate against measured CPU peaks at these packed micro-batch sizes")
    parser.add_argument("--packing-only", action="store_true", help="only the padded vs packed tokens/s figure")
    opts = parser.parse_args()
    # Tensors above 128 KB get their own mmap and go back to the OS when freed, so a trainer's resident memory
    # follows what it allocates (glibc otherwise keeps freed blocks of up to 32 MB in its heap, and the peak RSS
    # would count fragmentation). Inherited by the spawned trainers.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    if opts.estimate_check:
        estimate_check([int(t) for t in opts.estimate_check.split(",")], opts.steps)
        return
    if opts.packing_only:
        padded, packed = packing_throughput(opts.model, micro_batch_size=opts.micro_batch_size,
                                            pack_tokens=opts.pack_tokens, prompt_len=opts.prompt_len,
                                            shortest=opts.shortest)
        print(f"forward+backward, responses spread 10x: padded {padded:.1f} tokens/s, packed {packed:.1f} "
              f"tokens/s ({packed / padded:.2f}x)")
        return
    if not opts.estimates_only:
        from common.model import resolve_model

        resolve_model(opts.model)  # convert the default model once, before workers start
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            for setting in opts.settings.split(","):
                results[setting] = measure(setting, SETTINGS[setting], opts, tmp)
                r = results[setting]
                print(f"{setting:18s} peak/trainer {max(x['peak_mb'] for x in r):7.0f} MB  "
                      f"step {max(x['step_s'] for x in r):6.2f} s", flush=True)
        base = results.get("replica")
        print(f"\n{'setting':18s} {'peak MB':>8s} {'x replica':>9s} {'step s':>7s} {'x replica':>9s} {'tokens/s':>9s}"
              f" {'held MB':>8s} {'x replica':>9s} {'load peak MB':>12s}")
        for setting, r in results.items():
            peak, step = max(x["peak_mb"] for x in r), max(x["step_s"] for x in r)
            ratio = (lambda a, b: f"{a / b:9.2f}") if base else (lambda a, b: f"{'':9s}")
            print(f"{setting:18s} {peak:8.0f} {ratio(peak, max(x['peak_mb'] for x in base)) if base else '':>9s} "
                  f"{step:7.2f} {ratio(step, max(x['step_s'] for x in base)) if base else '':>9s} "
                  f"{r[0]['tokens'] / step:9.1f} {max(x['held_mb'] for x in r):8.0f} "
                  f"{ratio(max(x['held_mb'] for x in r), max(x['held_mb'] for x in base)) if base else '':>9s} "
                  f"{max(x['load_peak_mb'] for x in r):12.0f}")
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump({"options": vars(opts), "results": results}, f, indent=2)
    print()
    print(estimate_table())


if __name__ == "__main__":
    main()
