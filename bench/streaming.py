"""The streaming explorer against the round-based one, side by side in one run (vLLM, default model).

    python bench/streaming.py multiturn                 # episodes with a 1 s tool: streaming vs rounds, ~6 min
    python bench/streaming.py longtail --before DIR     # train_async.py now vs the checkout in DIR, ~10 min

multiturn: the same episodes (--groups groups x --samples episodes of --turns turns x --turn-tokens tokens, in an
environment that never ends an episode early and sleeps --tool-latency-s in every step) generated four ways:
streaming (`Rollouts.step`, --inflight groups in flight, a new group started the moment one ends) and in rounds
(`Rollouts.generate` over --tasks-per-step groups at a time, the explorer of train_sync.py and of train_async.py
before streaming), each with and without the tool latency. Reports sampled tokens/s and the engine's busy fraction
(seconds inside vLLM steps / wall-clock) of each, and the ratios.

longtail: train_async.py on a single-turn workload whose response lengths spread widely (short arithmetic answers
and long stories, up to --max-new-tokens 256), once with this tree (streaming) and once with the tree in --before
(round-based explorer), same flags: trained samples/s (steps 2..N, start-up excluded), mean staleness, engine busy
fraction (vLLM busy spans over the explorer's wall-clock, from the timeline), response-length spread.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.envs import ENVS, Env, StepResult  # noqa: E402
from common.runtime.metrics import read_metrics, read_timeline  # noqa: E402

TOOL_LATENCY_S = 0.0


class SlowTool(Env):
    """Never done: every turn gets a short reply after TOOL_LATENCY_S (a tool call)."""

    def reset(self, task):
        return [{"role": "user", "content": task["prompt"]}]

    def step(self, action):
        time.sleep(TOOL_LATENCY_S)
        return StepResult([{"role": "user", "content": "Go on."}], 0.0, False, {})


def multiturn(opts):
    global TOOL_LATENCY_S
    import dataclasses

    import torch

    from common.explorer.engine import SamplingConfig
    from common.explorer.engine_vllm import VLLMEngine
    from common.explorer.rollouts import Rollouts
    from common.explorer.workflow import Context
    from common.model import load_tokenizer, resolve_model

    torch.set_num_threads(opts.threads or torch.get_num_threads())
    ENVS["bench_slow_tool"] = "__main__:SlowTool"
    tok = load_tokenizer(opts.model)
    engine = VLLMEngine(resolve_model(opts.model), tokenizer=tok, dtype="float32", kv_cache_gb=2.0)
    ctx = Context(tok, max_new_tokens=opts.turn_tokens, max_turns=opts.turns,
                  episode_token_budget=4 * opts.turns * opts.turn_tokens + 512)
    tasks = [{"id": str(i), "env": "bench_slow_tool", "prompt": f"Tell me a long story about the number {i}."}
             for i in range(opts.groups)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=opts.turn_tokens, n=1)

    def streaming(rollouts):
        started = 0
        while started < len(tasks) or rollouts.workflows:
            while started < len(tasks) and len(rollouts.workflows) < opts.inflight:
                rollouts.start(tasks[started], started, opts.samples)
                started += 1
            rollouts.step(engine, sampling, 0)
            rollouts.pop_finished()

    def rounds(rollouts):
        for i in range(0, len(tasks), opts.tasks_per_step):
            for k, task in enumerate(tasks[i:i + opts.tasks_per_step]):
                rollouts.start(task, i + k, opts.samples)
            rollouts.generate(engine, sampling, 0)
            rollouts.pop_finished()

    warm = Rollouts(dataclasses.replace(ctx, max_turns=1))
    warm.start(tasks[0], 0, 2)
    warm.generate(engine, SamplingConfig(1.0, 1.0, 8, 1), 0)
    warm.close()
    results = {}
    for name, run, latency in (("stream, no tool latency", streaming, 0.0),
                               (f"stream, {opts.tool_latency_s:g} s tool", streaming, opts.tool_latency_s),
                               (f"rounds, {opts.tool_latency_s:g} s tool", rounds, opts.tool_latency_s),
                               ("rounds, no tool latency", rounds, 0.0)):
        TOOL_LATENCY_S = latency
        torch.manual_seed(0)
        rollouts = Rollouts(ctx)
        busy, t0 = engine.busy_s, time.perf_counter()
        run(rollouts)
        seconds = time.perf_counter() - t0
        rollouts.close()
        results[name] = {"tokens": rollouts.tokens, "seconds": round(seconds, 1),
                         "tokens_per_s": round(rollouts.tokens / seconds, 1),
                         "engine_busy_frac": round((engine.busy_s - busy) / seconds, 3)}
        print(f"  {name}: {json.dumps(results[name])}", flush=True)
    engine.close()
    names = list(results)
    rate = {k: v["tokens_per_s"] for k, v in results.items()}
    print(f"model {opts.model}, {opts.groups} groups x {opts.samples} episodes x {opts.turns} turns x "
          f"{opts.turn_tokens} tokens; streaming {opts.inflight} groups in flight, rounds of {opts.tasks_per_step}")
    print(f"ratio stream with tool / stream without: {rate[names[1]] / rate[names[0]]:.2f}")
    print(f"ratio stream with tool / rounds with tool: {rate[names[1]] / rate[names[2]]:.2f}")
    print(f"ratio rounds with tool / rounds without: {rate[names[2]] / rate[names[3]]:.2f}")
    return results


LONGTAIL_FLAGS = ["--max-new-tokens", "256", "--tasks-per-step", "8", "--samples-per-task", "4",
                  "--minibatch-size", "32", "--eval-every", "0", "--checkpoint-every", "0", "--overwrite",
                  "--max-staleness", "4", "--off-policy-correction", "decoupled", "--no-drop-zero-signal-groups"]


def longtail_tasks(path: str, n: int = 64) -> str:
    """Three short arithmetic questions to one long story: responses from a few tokens to the 256-token cap."""
    rows = []
    for i in range(n):
        a, b = i % 7 + 2, i % 5 + 3
        if i % 4 == 3:
            rows.append({"id": f"long{i}", "prompt": f"Write a long, detailed story of at least 400 words about a "
                         f"town with {a} bridges and {b} towers. At the end, say how many bridges there are.",
                         "answer": str(a)})
        else:
            rows.append({"id": f"short{i}", "prompt": f"What is {a} + {b}? Reply with the number only.",
                         "answer": str(a + b)})
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def longtail(opts):
    os.makedirs(opts.out, exist_ok=True)
    data = longtail_tasks(os.path.join(opts.out, "longtail.jsonl"))
    flags = ["--model", opts.model, "--steps", str(opts.steps), "--taskset", data, "--eval-taskset", data,
             "--eval-size", "4", *LONGTAIL_FLAGS, *opts.extra.split()]
    results = {}
    for name, tree in (("streaming (this tree)", ROOT), (f"rounds ({opts.before})", opts.before)):
        out = os.path.join(opts.out, "stream" if tree == ROOT else "rounds")
        proc = subprocess.run([sys.executable, os.path.join(tree, "train_async.py"), *flags, "--out-dir", out],
                              cwd=tree, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tree})
        if proc.returncode != 0:
            sys.exit(f"error: {name} failed:\n{proc.stderr[-3000:]}")
        results[name] = summarize(out)
        print(f"  {name}: {json.dumps(results[name])}", flush=True)
    a, b = results.values()
    print(f"ratio trained samples/s streaming / rounds: {a['trained_samples_per_s'] / b['trained_samples_per_s']:.2f}")
    return results


def summarize(out: str) -> dict:
    rows = read_metrics(out)
    events = read_timeline(out)
    explorer = [e for e in events if e["process"].startswith("explorer")]
    wall = max(e["end"] for e in explorer) - min(e["start"] for e in explorer)
    generating = sum(e["end"] - e["start"] for e in explorer if e["phase"] in ("generate", "rollout"))
    seconds = rows[-1]["time/elapsed"] - rows[0]["time/elapsed"]
    samples = (len(rows) - 1) * (rows[1]["samples"] - rows[0]["samples"])
    lengths = [r["rollout/sampled_tokens_mean"] for r in rows]
    return {"steps": len(rows), "seconds_steps_2_on": round(seconds, 1),
            "trained_samples_per_s": round(samples / seconds, 3),
            "staleness_mean": round(sum(r.get("staleness/mean", 0) for r in rows) / len(rows), 2),
            "dropped_stale": rows[-1].get("dropped_stale", 0),
            "engine_busy_frac": round(generating / wall, 3),
            "tokens_per_s_mean": round(sum(r["rollout/tokens_per_s"] for r in rows) / len(rows), 1),
            "sampled_tokens_mean": round(sum(lengths) / len(lengths), 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["multiturn", "longtail"])
    p.add_argument("--model", default="default")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, default=32)
    p.add_argument("--tool-latency-s", type=float, default=1.0)
    p.add_argument("--tasks-per-step", type=int, default=4, help="multiturn: groups per round")
    p.add_argument("--inflight", type=int, default=8, help="multiturn: groups in flight when streaming")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--steps", type=int, default=8, help="longtail: trainer steps per run")
    p.add_argument("--before", default="", help="longtail: a checkout with the round-based train_async.py")
    p.add_argument("--extra", default="", help="longtail: more flags for both runs")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "streaming"))
    opts = p.parse_args()
    if opts.mode == "longtail" and not os.path.exists(os.path.join(opts.before, "train_async.py")):
        sys.exit("error: longtail needs --before DIR, a checkout with the round-based train_async.py")
    results = multiturn(opts) if opts.mode == "multiturn" else longtail(opts)
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, f"{opts.mode}.json"), "w") as f:
        json.dump({"argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
