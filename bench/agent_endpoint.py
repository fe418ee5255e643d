"""The OpenAI-compatible endpoint under load: agent episodes against the in-process multi-turn workflow, one engine.

    python bench/agent_endpoint.py                                   # default model, 64 episodes x 3 turns x 32 tokens, HF
    python bench/agent_endpoint.py --engine vllm                     # the same with vLLM (continuous batching)
    python bench/agent_endpoint.py --engine hf-static                # HF over its static cache's slots (streams)
    python bench/agent_endpoint.py --model tiny                      # quick run (the tiny random model)
    python bench/agent_endpoint.py --episodes 64 --turns 3 --turn-tokens 16   # a reduced size on the default model

Both sides do the same token work on the same engine, in one process:
  multi: --episodes episodes of --turns turns of --turn-tokens tokens through the in-process multi-turn workflow, in
         an environment that never ends an episode early and answers every turn with "Go on." (bench/multiturn.py's
         Chatter), all episodes advanced together (common/explorer/rollouts.py).
  agent: the same episodes as agents (`--agent` workflow, common/explorer/agent.py): `agent(task, base_url, api_key)`
         below makes --turns calls with the real `openai` AsyncOpenAI client to the explorer's endpoint
         (common/explorer/endpoint.py), each appending the reply and the same "Go on." user message, so every call
         continues the episode's one sample; all episodes run concurrently and their calls join the engine together.
Reports sampled tokens/s of each (best of --repeats alternating runs), the ratio agent/multi (best of each, and per
repeat), the agent side's calls/s and p50/p95 call latency (client side: request sent to reply parsed), and with HF
each batched engine call's rows and seconds (how the calls were batched). The tiny
random model almost never emits its stop token early, so --model tiny measures the machinery at equal tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

USER_REPLY = "Go on."  # what bench/multiturn.py's Chatter answers every turn with


async def agent(task, base_url, api_key):
    """One episode: task["turns"] calls, each continuing the conversation with the reply and USER_REPLY. Each call's
    latency (seconds) is appended to task["latencies"] (a list shared with the benchmark)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task["prompt"]}]
    async with client:
        for turn in range(task["turns"]):
            t0 = time.perf_counter()
            reply = await client.chat.completions.create(model="policy", messages=messages)
            task["latencies"].append(time.perf_counter() - t0)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                         {"role": "user", "content": USER_REPLY}]
    return 0.0


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="tiny | default (or any model load_model knows)")
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--engine", choices=["hf", "hf-static", "vllm"], default="hf",
                   help="hf: generate with the dynamic cache (batched calls); hf-static: tandem's decode loop over a "
                   "static cache, whose slots calls join one by one; vllm")
    args = p.parse_args()
    t_start = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {text}", flush=True)

    say(f"importing torch, transformers{', vLLM' if args.engine == 'vllm' else ''}")
    import torch

    from bench.multiturn import Chatter  # noqa: F401  (registered below by name)
    from common.envs import ENVS
    from common.explorer.engine import HFEngine, SamplingConfig, StaticCacheSize
    from common.explorer.rollouts import run_episodes
    from common.explorer.workflow import Context
    from common.model import load_model, load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    ENVS["bench_chatter"] = "bench.multiturn:Chatter"
    say(f"building the {args.engine} engine on model {args.model}")
    tok = load_tokenizer(args.model)
    if args.engine.startswith("hf"):  # a slot per episode, room for every turn (and the user replies between)
        size = StaticCacheSize.plan(args.episodes, 256 + args.turns * (args.turn_tokens + 32))
        engine = HFEngine(load_model(args.model), tok, static_cache=size if args.engine == "hf-static" else None)
    else:  # as bench/multiturn.py builds it
        import tempfile

        from common.explorer.engine_vllm import VLLMEngine
        from common.model import resolve_model, save_servable_tiny

        path = save_servable_tiny(tempfile.mkdtemp()) if args.model == "tiny" else resolve_model(args.model)
        engine = VLLMEngine(path, tokenizer=tok, dtype="float32", kv_cache_gb=1.0)
    calls_log: list = []  # (rows, seconds) of each batched engine call (HF; vLLM steps instead)
    if not engine.streams:
        generate = engine.generate

        def logged(prompts, *a, **kw):
            t0 = time.perf_counter()
            out = generate(prompts, *a, **kw)
            calls_log.append((len(prompts), time.perf_counter() - t0))
            return out
        engine.generate = logged
    total = args.turns * args.turn_tokens
    budget = 4 * total + 512
    prompts = [f"Tell me a long story about the number {i}." for i in range(args.episodes)]
    # a turn cut at --turn-tokens goes on (as the agent goes on after a reply cut at max_tokens): every episode
    # lasts exactly --turns turns on both sides, whether or not the model emits its stop token
    multi_ctx = Context(tok, max_new_tokens=args.turn_tokens, max_turns=args.turns, episode_token_budget=budget,
                        truncated_turns="continue")
    agent_ctx = Context(tok, max_new_tokens=args.turn_tokens, episode_token_budget=budget,
                        agent=f"{os.path.abspath(__file__)}:agent", agent_max_calls=args.turns + 1,
                        agent_timeout_s=3600.0)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.turn_tokens, n=1)

    def tasks(name: str, latencies: list) -> list[dict]:
        if name == "multi":
            return [{"id": str(i), "env": "bench_chatter", "prompt": q} for i, q in enumerate(prompts)]
        return [{"id": str(i), "prompt": q, "turns": args.turns, "latencies": latencies} for i, q in enumerate(prompts)]

    runs = {"multi": multi_ctx, "agent": agent_ctx}
    say("warm-up: 2 episodes each way (starts the endpoint, loads the agent)")
    for name, ctx in runs.items():
        run_episodes(engine, ctx, tasks(name, [])[:2], SamplingConfig(1.0, 1.0, 8, 1))
    best, paired, latencies_of = {}, [], {}
    for r in range(args.repeats):
        for name, ctx in runs.items():
            say(f"{name} repeat {r}: {args.episodes} episodes x {args.turns} turns x {args.turn_tokens} tokens ...")
            latencies: list[float] = []
            calls_log.clear()
            torch.manual_seed(r)
            t0 = time.perf_counter()
            groups, counts = run_episodes(engine, ctx, tasks(name, latencies), sampling)
            seconds = time.perf_counter() - t0
            rate = counts["tokens"] / seconds
            line = f"  {name:5s} repeat {r}: {counts['tokens']} sampled tokens in {seconds:.1f}s = {rate:.1f} tok/s"
            if name == "agent":
                ends = [s.episode.end_reason for g in groups for s in g.responses]
                calls = sum(s.episode.calls for g in groups for s in g.responses if s.episode.samples[0] is s)
                bad = [e for e in ends if e != "done"]
                line += (f", {calls} calls = {calls / seconds:.1f} calls/s, latency p50 "
                         f"{percentile(latencies, 0.5):.2f}s p95 {percentile(latencies, 0.95):.2f}s, "
                         f"{counts['engine_calls']} engine calls" + (f", NOT DONE: {bad[:3]}" if bad else ""))
                if bad:
                    errors = {s.episode.error for g in groups for s in g.responses if s.episode.error}
                    line += f" {sorted(errors)[:2]}"
            else:
                line += f" ({counts['engine_calls']} engine calls)"
            print(line, flush=True)
            if calls_log:
                print(f"    engine calls (rows/seconds): {', '.join(f'{n}/{t:.1f}s' for n, t in calls_log)}", flush=True)
            if name not in best or rate > best[name][0]:
                best[name] = (rate, counts["tokens"], seconds)
                latencies_of[name] = (latencies, seconds)
            paired.append(rate)
    print(f"model {args.model}, engine {args.engine}, {args.episodes} episodes x {args.turns} turns x "
          f"{args.turn_tokens} tokens, torch threads {torch.get_num_threads()}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, (rate, tokens, seconds) in best.items():
        print(f"{name}: {rate:.1f} sampled tokens/s ({tokens} tokens, {seconds:.1f}s)")
    latencies, seconds = latencies_of["agent"]
    print(f"agent calls: {len(latencies) / seconds:.1f} calls/s, latency p50 {percentile(latencies, 0.5):.2f}s "
          f"p95 {percentile(latencies, 0.95):.2f}s (best agent run)")
    ratios = sorted(a / m for m, a in zip(paired[::2], paired[1::2]))  # each repeat ran multi first
    print(f"ratio agent/multi: {best['agent'][0] / best['multi'][0]:.2f} (best of each); per repeat "
          f"{', '.join(f'{x:.2f}' for x in ratios)} (median {ratios[len(ratios) // 2]:.2f})")


if __name__ == "__main__":
    main()
