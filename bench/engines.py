"""HF `generate` vs vLLM rollout engine, side by side in one run, plus the cost of a weight update into vLLM.

    python bench/engines.py                      # default model, 8 prompts x n=4, 128 new tokens
    python bench/engines.py --model tiny-vllm --max-new-tokens 32   # quick smoke run
    python bench/engines.py --model FOLDER --device cuda --dtype bfloat16 --engines hf \
        --hf-caches dynamic,static,cb --prompts 32 --n 4 --max-new-tokens 256   # the HF paths on a GPU

The HF engine's paths (--hf-caches): dynamic (HF generate, KV cache grown each step), static (tandem's decode loop
over one pre-allocated cache; on CUDA each step one CUDA graph: its warm-up seconds are the compile and captures),
and cb (transformers' own continuous batching, `generate_batch` with paged attention: tokens/s only, for comparison;
tandem does not use it). For each HF path after its timed calls: the weights are changed in place (as weight sync
does), then the time to the first token of the whole batch, and the largest |behaviour - recomputed| log-prob over
16 new tokens (a compiled step that kept reading old weights would show here).

Prints generated tokens/s of each engine at batch prompts x n (best of --repeats timed calls after one warm-up
call), and for vLLM the time of one weight update through weight_buffers() and load_weights(Buffers()) (the
explorer's broadcast path, excluding the broadcast itself) and load_weights(Folder(...)) (checkpoint sync), each checked
by the checksum read back from the vLLM worker. --json writes the figures to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = [
    "What is 17 + 25? Answer with a number.",
    "Tom has 3 apples and buys 4 more. How many apples does he have?",
    "Write a short sentence about the sea.",
    "What is 9 times 8?",
    "Name three colours.",
    "A train travels 60 km in one hour. How far does it go in 3 hours?",
    "What is the capital of France?",
    "Explain in one sentence what a prime number is.",
]


def timed_generate(engine, prompts, sampling, repeats, before=None):
    engine.generate(prompts[:2], type(sampling)(sampling.temperature, sampling.top_p, 8, 1))  # warm-up
    best = None
    for _ in range(repeats):
        if before:
            before()
        start = time.perf_counter()
        out = engine.generate(prompts, sampling)
        sync(getattr(engine, "device", "cpu"))
        seconds = time.perf_counter() - start
        tokens = sum(len(g.response_ids) for gs in out for g in gs)
        if best is None or tokens / seconds > best["tokens_per_s"]:
            best = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
                    "mean_len": round(tokens / sum(len(gs) for gs in out), 1)}
    return best


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def after_update(engine, tokenizer, prompts, sampling) -> dict:
    """Change the weights in place (1 % noise), then: seconds to the first token of the whole batch, and the
    largest |behaviour - recomputed| log-prob of 16 new tokens per row."""
    import torch

    from common.experience import Experience, collate
    from common.trainer.forward import sequence_logprobs

    with torch.no_grad():
        for _, p in engine.weight_buffers():
            p.add_(0.01 * p.float().std().item() * torch.randn_like(p))
    sync(engine.device)
    start = time.perf_counter()
    engine.generate(prompts, type(sampling)(sampling.temperature, sampling.top_p, 1, sampling.n))
    sync(engine.device)
    first_token_s = time.perf_counter() - start
    gens = [g for gs in engine.generate(prompts, type(sampling)(sampling.temperature, sampling.top_p, 16,
                                                                   sampling.n)) for g in gs]
    batch = collate([Experience(g.prompt_ids, g.response_ids, g.logprobs, [1] * len(g.response_ids), 0.0, 0, "t", 0)
                     for g in gens], tokenizer.pad_token_id)
    with torch.no_grad():
        recomputed = sequence_logprobs(engine.model, batch.input_ids.to(engine.device),
                                       batch.attention_mask.to(engine.device), sampling.temperature).float().cpu()
    mask = batch.response_mask.bool()
    return {"first_token_after_update_s": round(first_token_s, 3),
            "logprob_mismatch_max": float((recomputed[mask] - batch.old_logprobs[mask]).abs().max())}


def continuous_batching(model, tokenizer, prompts, sampling, repeats) -> dict:
    """transformers' continuous batching (`generate_batch`, paged attention), the same rows and lengths."""
    from transformers import GenerationConfig

    rows = [p for p in prompts for _ in range(sampling.n)]
    config = GenerationConfig(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0,
                              max_new_tokens=sampling.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    try:
        start = time.perf_counter()
        model.generate_batch(rows[:8], generation_config=config)
        warm_up_s = time.perf_counter() - start
        best = None
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate_batch(rows, generation_config=config)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.generated_tokens) for o in out.values())
            if best is None or tokens / seconds > best["tokens_per_s"]:
                best = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)}
        return {**best, "warm_up_s": round(warm_up_s, 1)}
    except Exception as e:  # a benchmark row: transformers' API moves between releases; say what broke
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="default | tiny-vllm | an HF folder")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--arith", action="store_true",
                        help="the prompts of a train_sync.py run: the first --prompts arith tasks (seed 0, level 1)")
    parser.add_argument("--fresh-prefix", action="store_true",
                        help="vLLM: empty the prefix cache before every timed call, as every weight update does")
    parser.add_argument("--json", default="")
    parser.add_argument("--block-size", type=int, default=0, help="vLLM KV block size in tokens (0: VLLMEngine's default, 32 on CPU)")
    parser.add_argument("--device", default="cpu", help="the HF engine's device (vLLM: cpu only here)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hf-caches", default="auto", help="comma-separated: dynamic, static, cb (auto: the "
                        "engine's default for --device)")
    args = parser.parse_args()

    import torch

    from common.explorer.engine import HFEngine, SamplingConfig, StaticCacheSize, use_static_cache
    from common.model import DTYPES, chat_prompt_ids, resolve_model

    tmp = tempfile.mkdtemp(prefix="bench-engines-")
    if args.model == "tiny-vllm":
        from common.model import save_servable_tiny

        path = save_servable_tiny(tmp)
    else:
        path = resolve_model(args.model)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if args.arith:
        from common.tasks.procedural import arithmetic_split

        prompts = [chat_prompt_ids(tokenizer, t) for t in arithmetic_split(0, 1, 48)[0].next_batch(args.prompts)]
    else:
        prompts = [chat_prompt_ids(tokenizer, {"prompt": PROMPTS[i % len(PROMPTS)]}) for i in range(args.prompts)]
    sampling = SamplingConfig(args.temperature, args.top_p, args.max_new_tokens, args.n)
    results = {"model": args.model, "batch": args.prompts * args.n, "max_new_tokens": args.max_new_tokens,
               "temperature": args.temperature, "top_p": args.top_p, "cpu_threads": torch.get_num_threads()}
    print(f"[bench] {args.model}: {args.prompts} prompts x n={args.n}, {args.max_new_tokens} new tokens, "
          f"T={args.temperature} top_p={args.top_p}, torch threads {torch.get_num_threads()}", flush=True)

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.dtype]).to(args.device).eval()
    if "hf" in args.engines:
        caches = args.hf_caches.split(",")
        if caches == ["auto"]:
            caches = ["static" if use_static_cache("auto", torch.device(args.device).type, False) else "dynamic"]
        for cache in caches:
            key = "hf" if len(caches) == 1 else f"hf_{cache}"
            print(f"[bench] {key}: warming up ...", flush=True)
            if cache == "cb":
                results[key] = continuous_batching(hf, tokenizer, prompts, sampling, args.repeats)
            else:
                size = StaticCacheSize.plan(len(prompts) * args.n, max(map(len, prompts)) + args.max_new_tokens)
                engine = HFEngine(hf, tokenizer, static_cache=size if cache == "static" else None)
                warm_up_s = engine.warm_up(prompts[0])
                results[key] = {**timed_generate(engine, prompts, sampling, args.repeats),
                                "warm_up_s": round(warm_up_s, 1), **after_update(engine, tokenizer, prompts, sampling)}
            print(f"[bench] {key}: {results[key]}", flush=True)

    if "vllm" in args.engines:
        from common.explorer.engine_vllm import VLLMEngine
        from common.weight_sync import Buffers, Folder, weights_hash
        from common.weight_sync.checkpoint import write_sync_checkpoint

        start = time.perf_counter()
        engine = VLLMEngine(path, tokenizer=tokenizer, dtype=args.dtype, kv_cache_gb=1.0,
                            **({"block_size": args.block_size} if args.block_size else {}))
        startup = time.perf_counter() - start
        results["vllm"] = timed_generate(engine, prompts, sampling, args.repeats,
                                         engine.llm.reset_prefix_cache if args.fresh_prefix else None)
        results["vllm"]["startup_s"] = round(startup, 1)
        print(f"[bench] vllm : {results['vllm']}", flush=True)

        # One weight update: new weights in the buffers (what broadcast_weights leaves there), then load them.
        with torch.no_grad():
            for p in hf.parameters():
                p.mul_(1.0001)
        named = dict(hf.named_parameters())
        buffers = engine.weight_buffers()
        start = time.perf_counter()
        for name, t in buffers:
            t.copy_(named[name])
        fill = time.perf_counter() - start
        engine.load_weights(Buffers())
        ok = engine.weights_checksum() == weights_hash(hf.named_parameters())
        size_mb = sum(t.numel() * t.element_size() for _, t in buffers) / 2**20
        results["vllm_update"] = {"weights_mb": round(size_mb, 1), "fill_buffers_s": round(fill, 3),
                                  "commit_s": round(engine.last_update_s, 3),
                                  "worker_reload_s": round(engine.last_reload_s, 3), "checksum_equal": ok}
        with torch.no_grad():
            for p in hf.parameters():
                p.mul_(1.0001)
        ckpt = write_sync_checkpoint(os.path.join(tmp, "sync"), list(hf.named_parameters()), 1)
        engine.load_weights(Folder(ckpt))
        ok = engine.weights_checksum() == weights_hash(hf.named_parameters())
        results["vllm_checkpoint_load"] = {"load_s": round(engine.last_update_s, 3), "checksum_equal": ok}
        print(f"[bench] vllm weight update (buffers -> vLLM): {results['vllm_update']}", flush=True)
        print(f"[bench] vllm checkpoint load: {results['vllm_checkpoint_load']}", flush=True)
        engine.close()

    if "hf" in results and "vllm" in results:
        results["speedup"] = round(results["vllm"]["tokens_per_s"] / results["hf"]["tokens_per_s"], 2)
        print(f"[bench] generated tokens/s  hf {results['hf']['tokens_per_s']}  vllm {results['vllm']['tokens_per_s']}"
              f"  (x{results['speedup']})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":  # vLLM spawns its engine core: keep the work under this guard
    main()
