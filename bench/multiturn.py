"""Multi-turn vs single-turn rollouts at equal total generated tokens, side by side in one run.

    python bench/multiturn.py                                  # default model, 16 samples x 4 turns x 32 tokens, HF
    python bench/multiturn.py --engine vllm                    # the same with vLLM (prefix cache across turns)
    python bench/multiturn.py --model tiny --turn-tokens 64    # quick run
    python bench/multiturn.py --engine vllm --tool-latency-s 1 # every environment step takes 1 s more (a tool)

Single-turn: 16 prompts, one response of turns x turn-tokens new tokens each. Multi-turn: 16 episodes of `turns`
turns of turn-tokens each in an environment that never ends an episode early (it answers every turn with a short
user message), all episodes advanced together (common/explorer/rollouts.py Rollouts: HF, one engine call per turn; vLLM, one
engine loop in which an episode's next turn starts as soon as its last one has finished). Reports
sampled tokens / second of each (observation tokens are not counted as generated), best of --repeats alternating
runs, and the ratio multi / single. A model that emits its stop token early makes the two generate different
totals; the tiny random model almost never does, so --model tiny measures the machinery at exactly equal tokens.

--tool-latency-s S: every environment step sleeps S seconds (a slow tool call). The multi-turn run is then done
twice: "inline" (--env-workers 0: the step runs between decode steps, as an explorer without a worker pool does)
and "pool" (the default: steps run in worker threads while the engine decodes the other episodes), so the ratio
pool / single is the latency hidden and inline / single the latency paid.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.envs import ENVS, Env, StepResult  # noqa: E402


TOOL_LATENCY_S = 0.0


class Chatter(Env):
    """Never done: every turn gets a short reply, so an episode lasts exactly --max-turns turns."""

    def reset(self, task):
        return [{"role": "user", "content": task["prompt"]}]

    def step(self, action):
        time.sleep(TOOL_LATENCY_S)
        return StepResult([{"role": "user", "content": "Go on."}], 0.0, False, {})


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    p.add_argument("--block-size", type=int, default=0, help="vLLM KV block size in tokens (0: VLLMEngine's default, 32 on CPU)")
    p.add_argument("--tool-latency-s", type=float, default=0.0, help="seconds every environment step sleeps (a tool)")
    args = p.parse_args()
    global TOOL_LATENCY_S
    TOOL_LATENCY_S = args.tool_latency_s
    import torch

    from common.explorer.engine import HFEngine, SamplingConfig
    from common.model import load_model, load_tokenizer
    from common.explorer.rollouts import run_episodes
    from common.explorer.workflow import Context

    if args.threads:
        torch.set_num_threads(args.threads)
    ENVS["bench_chatter"] = "__main__:Chatter"
    tok = load_tokenizer(args.model)
    if args.engine == "hf":
        engine = HFEngine(load_model(args.model), tok)
    else:  # vLLM keeps each episode's KV blocks in its prefix cache between turns
        import tempfile

        from common.explorer.engine_vllm import VLLMEngine
        from common.model import save_servable_tiny
        from common.model import resolve_model

        path = save_servable_tiny(tempfile.mkdtemp()) if args.model == "tiny" else resolve_model(args.model)
        engine = VLLMEngine(path, tokenizer=tok, dtype="float32", kv_cache_gb=1.0,
                            **({"block_size": args.block_size} if args.block_size else {}))
    prompts = [f"Tell me a long story about the number {i}." for i in range(args.samples)]
    total = args.turns * args.turn_tokens
    single_ctx = Context(tok, max_new_tokens=total)
    multi_ctx = Context(tok, max_new_tokens=args.turn_tokens, max_turns=args.turns, episode_token_budget=4 * total + 512)
    episodes = [{"id": str(i), "env": "bench_chatter", "prompt": q} for i, q in enumerate(prompts)]
    runs = {"single": ([{"id": str(i), "prompt": q} for i, q in enumerate(prompts)], single_ctx),
            "multi": (episodes, multi_ctx)}
    import dataclasses

    if args.tool_latency_s and "env_workers" not in {f.name for f in dataclasses.fields(Context)}:
        runs = {"single": runs["single"], "inline": (episodes, multi_ctx)}  # a checkout without the worker pool
    elif args.tool_latency_s:
        runs = {"single": runs["single"], "inline": (episodes, dataclasses.replace(multi_ctx, env_workers=0)),
                "pool": (episodes, multi_ctx)}
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=total, n=1)
    run_episodes(engine, single_ctx, runs["single"][0][:2], SamplingConfig(1.0, 1.0, 8, 1))  # warm-up
    best, paired = {}, []
    for r in range(args.repeats):
        for name, (tasks, ctx) in runs.items():
            torch.manual_seed(r)
            t0 = time.perf_counter()
            groups, counts = run_episodes(engine, ctx, tasks, sampling)
            seconds = time.perf_counter() - t0
            rate = counts["tokens"] / seconds
            print(f"  {name:6s} repeat {r}: {counts['tokens']} sampled tokens in {seconds:.1f}s = {rate:.1f} tok/s "
                  f"({counts['engine_calls']} engine calls)", flush=True)
            if name not in best or rate > best[name][0]:
                best[name] = (rate, counts["tokens"], seconds)
            paired.append(rate)
    print(f"model {args.model}, engine {args.engine}, {args.samples} samples, {args.turns} turns x "
          f"{args.turn_tokens} tokens, torch threads {torch.get_num_threads()}")
    for name, (rate, tokens, seconds) in best.items():
        print(f"{name}-turn: {rate:.1f} generated tokens/s ({tokens} tokens, {seconds:.1f}s)")
    k = len(runs)
    for name in list(runs)[1:]:
        i = list(runs).index(name)
        ratios = sorted(m / s for s, m in zip(paired[::k], paired[i::k]))  # each repeat ran single first
        print(f"ratio {name}/single: {best[name][0] / best['single'][0]:.2f} (best of each); per repeat "
              f"{', '.join(f'{x:.2f}' for x in ratios)} (median {ratios[len(ratios) // 2]:.2f})")

if __name__ == "__main__":
    main()
