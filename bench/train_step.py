"""The trainer's step alone (synthetic experiences, no rollout): tokens/s and MFU against the device's own measured
matmul rate.

    python bench/train_step.py                                  # default model (SmolLM2-135M), fp32, CPU
    python bench/train_step.py --model tiny --tokens 256 --steps 2
    python bench/train_step.py --model cfg:Qwen/Qwen2.5-1.5B --device cuda --dtype bfloat16 --tokens 16384

From code (bench/gpu_check.py): `measure(config, "cuda", torch.bfloat16, 16384)` with a transformers config (random
weights of that shape) or a --model name.

One step is `Trainer.train_step` as every schedule runs it (filters, collate, advantages, forward + backward of
every micro-batch, gradient clipping, AdamW) over one minibatch of `micro_batches` packed micro-batches of about
`tokens` tokens each: rows of a `prompt_len`-token prompt and a response of `response_len / 4 .. response_len`
tokens, two per group with rewards 0 and 1 (every row has a non-zero advantage). The first step warms up; the
figure is the median of the others.

MFU = model FLOPs / step time / the matmul rate measured on the same device and dtype in the same process (fp32
on CPU, bf16 on a GPU: `matmul_rate`). Model FLOPs = 6 x (non-embedding parameters x every token forwarded + the
LM head's vocab x hidden x every trained token, the only positions the head runs on), the usual 6·N·D; attention's
own score FLOPs and the recomputation of gradient checkpointing are not counted (they are overhead, as in PaLM's
MFU). On a CPU the same ratio is also taken per CPU-second of this process (`mfu_cpu_time`: step CPU time against
the matmul's FLOPs per CPU-second), which the other jobs of a shared machine do not dilute.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, n: int | None = None,
                seconds: float = 1.0, per_cpu_second: bool = False) -> float:
    """FLOP/s of square n x n matmuls on `device` in `dtype` (best of a few timed rounds): the peak the train step
    is compared with. n: 8192 on a GPU, 1024 on a CPU (large enough to reach the BLAS kernel's rate).
    `per_cpu_second` (CPU): FLOPs per second of this process's CPU time, which other jobs on a shared machine
    do not dilute."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    torch.mm(a, b, out=out)
    _sync(device)
    clock = time.perf_counter if device.type == "cuda" or not per_cpu_second else time.process_time
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == 0.0:
        reps = 20 if device.type == "cuda" else 2
        start = clock()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        _sync(device)
        best = max(best, 2 * n**3 * reps / (clock() - start))
    return best


def model_flops(config, tokens: int, trained_tokens: int) -> float:
    """6 x (non-embedding parameters x tokens + LM head vocab x hidden x trained tokens), from the config alone."""
    from common.memory import ModelShape

    shape = ModelShape.from_config(config)
    return 6.0 * (shape.body_params * tokens + shape.vocab * shape.hidden * trained_tokens)


def synthetic_experiences(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    """`rows` experiences, 2 per group (rewards 1 and 0), responses of response_len/4 .. response_len tokens."""
    from common.experience import Experience

    rng = random.Random(seed)
    out = []
    for i in range(rows):
        r = rng.randint(max(1, response_len // 4), response_len)
        out.append(Experience([rng.randrange(vocab) for _ in range(prompt_len)], [rng.randrange(vocab) for _ in range(r)],
                              [-1.0] * r, [1] * r, float(i % 2 == 0), i // 2, f"t{i // 2}", 0))
    return out


def rows_for(tokens: int, micro_batches: int, prompt_len: int, response_len: int) -> int:
    """Rows whose expected total length fills `micro_batches` micro-batches of `tokens` tokens (even: 2 per group)."""
    mean_row = prompt_len + (response_len // 4 + response_len) / 2
    return max(2, 2 * round(tokens * micro_batches / mean_row / 2))


def random_model_folder(config, dtype: torch.dtype, folder: str) -> str:
    """A model folder of `config`'s shape with random weights (and the tiny byte-level tokenizer: the step never
    decodes), so the trainer loads it as a user's model."""
    from transformers import AutoModelForCausalLM

    from common.model import build_tiny_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    return folder


NO_KERNEL = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::as_strided", "aten::as_strided_",
             "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::resize_", "aten::set_", "aten::lift_fresh",
             "aten::detach", "aten::detach_", "aten::alias", "aten::resolve_conj", "aten::resolve_neg",
             "aten::result_type", "aten::to", "aten::contiguous", "aten::is_nonzero", "aten::item",
             "aten::_local_scalar_dense", "aten::record_stream", "aten::transpose", "aten::t", "aten::permute",
             "aten::slice", "aten::select", "aten::narrow", "aten::unsqueeze", "aten::squeeze", "aten::expand",
             "aten::expand_as", "aten::split", "aten::split_with_sizes", "aten::unbind", "aten::chunk",
             "aten::view_as", "aten::unflatten", "aten::flatten", "aten::_reshape_alias"}
"""Operators that launch no kernel of their own (allocation, views and other metadata; `to`, `contiguous` and
`flatten` where they copy nothing, else the copy is counted), left out of the CPU's kernel count."""


def profile_step(trainer, batch, device: torch.device, rows: int = 15) -> dict:
    """One more step under torch.profiler: the operators that took the most of the device's own time (CUDA
    kernels' on a GPU, CPU time on a CPU), and how many kernels ran: on a GPU the CUDA kernels and how busy they
    kept it over the step's wall time (profiled: the profiler's own overhead lowers it); on a CPU the operators
    outside NO_KERNEL that call none outside it, about what a GPU launches as kernels (CPU-only kernels
    included, such as the zero-filling of the CPU's attention backward)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    gpu = device.type == "cuda"
    _sync(device)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if gpu else [])]) as prof:
        trainer.train_step(batch)
        _sync(device)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    own = (lambda e: e.self_device_time_total) if gpu else (lambda e: e.self_cpu_time_total)  # noqa: E731
    top = sorted(events, key=own, reverse=True)[:rows]
    out = {"wall_s": wall, "top": [[e.key, own(e) / 1e3, e.count] for e in top]}  # name, ms, calls
    if gpu:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        out.update(kernels=sum(e.count for e in kernels),
                   device_busy_frac=sum(e.self_device_time_total for e in kernels) / 1e6 / wall)
    else:
        work = lambda e: e.name.startswith("aten::") and e.name not in NO_KERNEL  # noqa: E731
        out["kernels"] = sum(1 for e in prof.events() if work(e) and not any(map(work, e.cpu_children)))
    return out


def _peak_memory_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif os.path.exists("/proc/self/clear_refs"):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: restart the VmHWM count


def _peak_memory_gib(device: torch.device) -> float:
    """The step's peak: what torch's CUDA allocator reserved, or the process's peak resident memory (VmHWM)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def _estimate_gib(args, config, device: torch.device, batch) -> float:
    """common/memory.py's peak for this trainer (its largest micro-batch), comparable with `_peak_memory_gib`: on
    a GPU without the CUDA context, which torch's allocator does not count."""
    from common.memory import CUDA_CONTEXT_BYTES, ModelShape, trainer_estimate
    from common.trainer.forward import cut

    lengths = torch.tensor([len(e.prompt_ids) + len(e.response_ids) for e in batch])
    trained = torch.tensor([len(e.response_ids) for e in batch])
    parts = cut(torch.arange(len(batch)), lengths, args.micro_batch_size, args.max_tokens_per_micro_batch)
    tokens = max(int(lengths[p].sum()) if args.max_tokens_per_micro_batch else len(p) * int(lengths.max())
                 for p in parts)
    est = trainer_estimate(ModelShape.from_config(config), args, device.type, tokens,
                           max(int(trained[p].sum()) for p in parts), args.gradient_checkpointing)
    return (est.peak - (CUDA_CONTEXT_BYTES if device.type == "cuda" else 0)) / 2**30


def measure(config, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, tokens: int = 2048,
            steps: int = 3, micro_batches: int = 1, prompt_len: int = 64, response_len: int = 512,
            packed: bool = True, gradient_checkpointing: bool = False, extra_args: tuple[str, ...] = (),
            peak_flops: float | None = None, profile: bool = False, packed_attention: str = "auto") -> dict:
    """Time `steps` train steps (the first a warm-up) of the trainer on synthetic experiences and return tokens/s,
    the model FLOP rate, the measured matmul rate and MFU.

    config: a transformers config (random weights of its shape) or a --model name ('default', 'tiny', a folder).
    tokens: tokens per micro-batch (--max-tokens-per-micro-batch when packed; else the rows of one micro-batch
    hold about that many real tokens, padded to the longest). peak_flops: the rate MFU is taken against (default:
    `matmul_rate` on the device in `dtype`, measured here). profile: after the timed steps, one more under
    torch.profiler (`profile`: `profile_step`). packed_attention: "split" gives the trainer's model causal sdpa per
    sequence, also where flash attention's varlen kernel runs (common/trainer/forward.py `use_packed_attention`)."""
    from common.cli import parse_args
    from common.trainer.forward import use_packed_attention
    from common.trainer.trainer import Trainer
    from train_sync import Args

    device = torch.device(device)
    dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    rows = rows_for(tokens, micro_batches, prompt_len, response_len)
    with tempfile.TemporaryDirectory() as tmp:
        if isinstance(config, str):
            model_name = config
        else:
            print(f"[bench] writing a {type(config).__name__} of random weights ({dtype_name})", file=sys.stderr,
                  flush=True)
            model_name = random_model_folder(config, dtype, os.path.join(tmp, "model"))
        argv = ["--model", model_name, "--dtype", dtype_name, "--trainer-devices", str(device),
                "--tasks-per-step", str(rows // 2), "--samples-per-task", "2", "--max-new-tokens", str(response_len),
                "--no-drop-zero-signal-groups", "--out-dir", os.path.join(tmp, "run"),
                *(["--max-tokens-per-micro-batch", str(tokens)] if packed else
                  ["--micro-batch-size", str(max(1, rows // micro_batches))]),
                *(["--gradient-checkpointing"] if gradient_checkpointing else []), *extra_args]
        args = parse_args(Args, argv)
        print(f"[bench] building the trainer: {model_name} on {device} in {dtype_name}, {rows} rows, "
              f"{'packed' if packed else 'padded'} micro-batches of ~{tokens} tokens", file=sys.stderr, flush=True)
        trainer = Trainer(args, device)
    if packed_attention == "split":
        use_packed_attention(trainer.model, split=True)
    model_config = trainer.model.config
    batch = synthetic_experiences(rows, prompt_len, response_len, model_config.vocab_size)
    all_tokens = sum(len(e.prompt_ids) + len(e.response_ids) for e in batch)
    trained = sum(len(e.response_ids) for e in batch)
    times, cpu_times = [], []
    for step in range(steps):
        if step == 1:
            _peak_memory_reset(device)
        _sync(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        metrics = trainer.train_step(batch)
        _sync(device)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        print(f"[bench] step {step + 1}/{steps}{' (warm-up)' if step == 0 else ''}: {times[-1]:.2f} s",
              file=sys.stderr, flush=True)
    peak_gib = _peak_memory_gib(device)
    allocated = {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30} \
        if device.type == "cuda" else {}
    estimate_gib = _estimate_gib(args, model_config, device, batch)
    extra = {"profile": profile_step(trainer, batch, device)} if profile else {}
    del trainer
    step_s = statistics.median(times[1:]) if len(times) > 1 else times[0]
    cpu_s = statistics.median(cpu_times[1:]) if len(cpu_times) > 1 else cpu_times[0]
    flops = model_flops(model_config, all_tokens, trained)
    if peak_flops is None:
        print(f"[bench] measuring the {dtype_name} matmul rate on {device} (about 1 s)", file=sys.stderr, flush=True)
    peak = peak_flops or matmul_rate(device, dtype)
    cpu = {}
    if device.type == "cpu":  # the same figures per CPU-second: what a loaded machine's other jobs do not change
        cpu_peak = matmul_rate(device, dtype, per_cpu_second=True)
        cpu = {"step_cpu_s": cpu_s, "cpu_step_times": cpu_times, "matmul_tflops_per_cpu_s": cpu_peak / 1e12,
               "mfu_cpu_time": flops / cpu_s / cpu_peak}
    return {"device": str(device), "dtype": dtype_name, "threads": torch.get_num_threads(), "rows": rows,
            "tokens": all_tokens, "trained_tokens": trained, "micro_batch_tokens": tokens, "packed": packed,
            "gradient_checkpointing": gradient_checkpointing, "packed_attention": packed_attention,
            "step_s": step_s, "step_times": times,
            "tokens_per_s": all_tokens / step_s, "trained_tokens_per_s": trained / step_s,
            "model_tflops": flops / step_s / 1e12, "matmul_tflops": peak / 1e12, "mfu": flops / step_s / peak,
            "peak_memory_gib": peak_gib, **allocated, "estimate_gib": estimate_gib, "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"], **cpu, **extra}


SHAPES = {  # public configs, for machines without the hub: shape:<name>
    "qwen2.5-1.5b": ("Qwen2Config", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                         max_position_embeddings=32768, tie_word_embeddings=True)),
    "qwen2.5-7b": ("Qwen2Config", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                       max_position_embeddings=32768, tie_word_embeddings=False)),
    "qwen2.5-0.5b": ("Qwen2Config", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                         max_position_embeddings=32768, tie_word_embeddings=True)),
    # Qwen2.5-1.5B's layers and heads at a width a CPU runs in seconds: the kernels per step (--profile) of the 1.5B
    "qwen2.5-1.5b-narrow": ("Qwen2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=28,
                                                num_attention_heads=12, num_key_value_heads=2, head_dim=16,
                                                vocab_size=1024, max_position_embeddings=32768,
                                                tie_word_embeddings=True)),
}


def resolve_config(name: str):
    """'shape:<SHAPES key>' or 'cfg:<hub id or folder>' -> that config (random weights); else a --model name."""
    import transformers

    if name.startswith("shape:"):
        cls, fields = SHAPES[name[6:]]
        return getattr(transformers, cls)(**fields)
    if name.startswith("cfg:"):
        return transformers.AutoConfig.from_pretrained(name[4:])
    return name


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="--model name, or shape:<name> (SHAPES) or cfg:<hub id|folder> "
                        "for random weights of that shape")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: fp32 on CPU, bf16 on GPU)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=512, help="longest response; the shortest is 1/4 of it")
    parser.add_argument("--steps", type=int, default=3, help="train steps; the first is a warm-up")
    parser.add_argument("--padded", action="store_true", help="padded micro-batches instead of packing")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--profile", action="store_true", help="then profile one more step (kernels, the top "
                        "operators by the device's own time)")
    parser.add_argument("--packed-attention", default="auto", choices=["auto", "split"], help="auto: flash "
                        "attention's varlen kernel on a GPU (bf16/fp16), else sdpa per sequence; split: always per "
                        "sequence (to compare)")
    parser.add_argument("--json", default=None, help="also write the result here")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[
        opts.dtype or ("bfloat16" if opts.device.startswith("cuda") else "float32")]
    if opts.model == "default":
        from common.model import resolve_model

        resolve_model("default")  # converted once, outside the timing
    r = measure(resolve_config(opts.model), opts.device, dtype, opts.tokens, opts.steps, opts.micro_batches,
                opts.prompt_len, opts.response_len, not opts.padded, opts.gradient_checkpointing,
                profile=opts.profile, packed_attention=opts.packed_attention)
    print(f"train step ({r['device']} {r['dtype']}, {r['threads']} threads, {r['rows']} rows, {r['tokens']} tokens, "
          f"{r['trained_tokens']} trained, {'packed' if r['packed'] else 'padded'} micro-batches of {r['micro_batch_tokens']}"
          f"{', checkpointing' if r['gradient_checkpointing'] else ''}, {r['packed_attention']} attention): "
          f"step {r['step_s']:.3f} s, "
          f"{r['tokens_per_s']:.0f} tokens/s, {r['model_tflops']:.3f} model TFLOP/s against a measured matmul rate of "
          f"{r['matmul_tflops']:.3f} TFLOP/s: MFU {100 * r['mfu']:.1f} %, peak memory {r['peak_memory_gib']:.2f} GiB"
          f"{' reserved, %.2f allocated' % r['peak_allocated_gib'] if 'peak_allocated_gib' in r else ''} "
          f"(common/memory.py's estimate {r['estimate_gib']:.2f} GiB)")
    if "mfu_cpu_time" in r:
        print(f"  per CPU-second of this process: step {r['step_cpu_s']:.2f} CPU-s, matmul "
              f"{r['matmul_tflops_per_cpu_s']:.3f} TFLOP per CPU-s: MFU {100 * r['mfu_cpu_time']:.1f} %")
    if "profile" in r:
        p = r["profile"]
        busy = f", the GPU busy {100 * p['device_busy_frac']:.0f} % of it" if "device_busy_frac" in p else ""
        print(f"  a profiled step: {p['wall_s']:.3f} s, {p['kernels']} kernels{busy}; the top operators by own time:")
        for name, ms, calls in p["top"]:
            print(f"    {ms:10.1f} ms {calls:7d}x  {name}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
