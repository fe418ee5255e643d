"""Verifier throughput: math answers per second in-process and through RewardPool (plain numbers take the fast
path, LaTeX answers go through math-verify), and the pool's submit latency.

    .venv/bin/python bench/rewards_pool.py [--workers 2] [--n 2000]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rewards import RewardPool, score

logging.getLogger("math_verify").setLevel(logging.ERROR)


def batches(n: int):
    plain = ([f"Work...\nAnswer: {i % 97}" for i in range(n)], [{"id": f"arith-{i}", "answer": str(i % 89)}
                                                               for i in range(n)])
    latex = ([f"so \\boxed{{\\frac{{{i % 13 + 1}}}{{{i % 7 + 2}}}}}" for i in range(n)],
             [{"id": f"frac-{i}", "answer": f"{(i % 13 + 1) / (i % 7 + 2):.6f}"} for i in range(n)])
    return {"plain numbers (Answer: 42)": plain, "LaTeX fractions (math-verify)": latex}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
    print(f"cores available: {len(os.sched_getaffinity(0))}")
    with RewardPool(num_workers=args.workers, timeout_s=10) as pool:
        pool.score_batch(["Answer: 1"] * 4, [{"id": "w", "answer": "1"}] * 4)  # workers started and warm
        for label, (responses, tasks) in batches(args.n).items():
            k = min(200, args.n)
            score(responses[0], tasks[0])
            start = time.perf_counter()
            for r, t in zip(responses[:k], tasks[:k]):
                score(r, t)
            serial = k / (time.perf_counter() - start)
            start = time.perf_counter()
            future = pool.submit(responses, tasks)
            submit_ms = (time.perf_counter() - start) * 1000
            future.result(timeout=600)
            pooled = args.n / (time.perf_counter() - start)
            print(f"{label:32s} in-process {serial:8.0f}/s   RewardPool({args.workers}) {pooled:8.0f}/s   "
                  f"submit returns in {submit_ms:.1f} ms")


if __name__ == "__main__":
    main()
