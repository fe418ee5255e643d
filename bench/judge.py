"""The judge tandem serves, HF engine against vLLM: seconds per call and calls/s for one response (`judge`) and a
group of four (`judge_group`), the same requests to both, over HTTP as the reward pool calls it
(rewards/judge_server.py). configs/judge.yaml's `--judge-engine auto` takes vLLM where it imports; this says
whether that is the faster choice on this machine.

    .venv/bin/python bench/judge.py [--model default] [--device cpu] [--n 24] [--engines hf vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rewards.judge import Endpoint, judge_messages, request  # noqa: E402
from rewards.judge_server import start_server  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROUP = 4


def requests(n: int) -> list[tuple[list[dict], int | None]]:
    """n single and n group requests from examples/open_ended.jsonl with distinct responses (no cache involved)."""
    tasks = [json.loads(line) for line in open(os.path.join(ROOT, "examples", "open_ended.jsonl"))]
    words = ("calm", "blue", "wide", "bright", "quiet", "old", "deep", "cold")
    out = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        answers = [f"It is {words[(i + k) % len(words)]} and {words[(i * 3 + k) % len(words)]} today, number {i}."
                   for k in range(GROUP)]
        out.append((judge_messages(task, answers[:1], f"{i:016x}", group=False), None))
        out.append((judge_messages(task, answers, f"{i:016x}", group=True), GROUP))
    return out


def measure(engine: str, model: str, device: str, n: int) -> dict:
    loader = None
    if engine == "vllm":
        from common.explorer.judge_vllm import VLLMJudge

        loader = VLLMJudge
    t0 = time.perf_counter()
    server = start_server(model, device, loader=loader)
    load_s = time.perf_counter() - t0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = Endpoint(f"http://127.0.0.1:{server.server_address[1]}/v1", model)
    work = requests(n)
    request(endpoint, *work[0], timeout_s=300)  # first call: warm-up, not timed
    seconds = {None: [], GROUP: []}
    scores = []
    for messages, count in work:
        t = time.perf_counter()
        scores.append(request(endpoint, messages, count, timeout_s=300))
        seconds[count].append(time.perf_counter() - t)
    server.shutdown()
    one, group = sum(seconds[None]) / n, sum(seconds[GROUP]) / n
    print(f"{engine}: load {load_s:.1f} s; judge {one:.2f} s a call ({1 / one:.2f} calls/s); "
          f"judge_group of {GROUP} {group:.2f} s a call ({1 / group:.2f} calls/s)", flush=True)
    return {"load_s": load_s, "judge_s_per_call": one, "judge_group_s_per_call": group, "scores": scores}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n", type=int, default=24, help="requests of each kind per engine")
    ap.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "judge_engines.json"))
    args = ap.parse_args()
    results = {e: measure(e, args.model, args.device, args.n) for e in args.engines}
    if {"hf", "vllm"} <= results.keys():
        for kind in ("judge_s_per_call", "judge_group_s_per_call"):
            print(f"{kind}: vLLM {results['hf'][kind] / results['vllm'][kind]:.2f}x the HF engine's speed")
        diff = max(abs(a - b) for x, y in zip(results["hf"]["scores"], results["vllm"]["scores"]) for a, b in zip(x, y))
        print(f"largest score difference between the engines: {diff:.3f} (of 1)")
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "device": args.device, "n": args.n, "cores": len(os.sched_getaffinity(0)),
                   "date": time.strftime("%Y-%m-%d %H:%M"), **results}, f, indent=1)


if __name__ == "__main__":
    main()
