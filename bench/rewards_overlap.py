"""Reward scoring hidden behind generation: Explorer.rollout with --rollout-chunks 1, 2, 4 on code tasks (every
response runs --tests sandboxed test cases), per step: generation time, the reward wait left after generation, the
scoring time that ran during generation (reward/hidden_s) and the step total; medians, the settings interleaved
step by step so that load on a shared machine hits them alike.

    .venv/bin/python bench/rewards_overlap.py [--model tiny] [--chunks 1 2 4] [--steps 3] [--tests 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.config import CommonArgs, parse_args  # noqa: E402
from common.explorer import Explorer  # noqa: E402
from common.metrics import Timeline  # noqa: E402


def code_tasks(n: int, n_tests: int) -> list[dict]:
    return [{"id": f"echo-{i}", "reward": "code", "prompt": "Read a number and print it twice, one per line.",
             "tests": [{"input": str(k), "output": f"{k}\n{k}"} for k in range(n_tests)]} for i in range(n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tests", type=int, default=4)
    ap.add_argument("--tasks-per-step", type=int, default=8)
    ap.add_argument("--samples-per-task", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reward-workers", type=int, default=1)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "code.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps(t) + "\n" for t in code_tasks(64, a.tests))
        args = parse_args(CommonArgs, [
            "--model", a.model, "--taskset", data, "--eval-taskset", data, "--eval-size", "1",
            "--tasks-per-step", str(a.tasks_per_step), "--samples-per-task", str(a.samples_per_task),
            "--max-new-tokens", str(a.max_new_tokens), "--minibatch-size", "4", "--micro-batch-size", "4",
            "--reward-workers", str(a.reward_workers)])
        explorer = Explorer(args, "cpu", Timeline(tmp, "explorer0"))
        print(f"cores: {len(os.sched_getaffinity(0))}; model {a.model}; {a.tasks_per_step} code tasks x "
              f"{a.samples_per_task} samples, {a.max_new_tokens} new tokens, {a.tests} sandboxed tests per response, "
              f"{a.reward_workers} reward worker(s); medians over {a.steps} steps (s/step)")
        try:
            explorer.rollout(step=0)  # warm: model, reward worker, sandbox first use
            rows: dict[int, list[dict]] = {c: [] for c in a.chunks}
            for step in range(1, a.steps + 1):  # settings interleaved, so load drift on a shared machine hits all
                for chunks in a.chunks:
                    args.rollout_chunks = chunks
                    rows[chunks].append(explorer.rollout(step)[1])
            base = None
            for chunks in a.chunks:
                med = {k: statistics.median(r[k] for r in rows[chunks])
                       for k in ("time/rollout", "time/reward", "reward/hidden_s", "rollout/tokens_per_s")}
                total = statistics.median(r["time/rollout"] + r["time/reward"] for r in rows[chunks])
                scoring = med["reward/hidden_s"] + med["time/reward"]
                base = base or total
                print(f"--rollout-chunks {chunks}: generate {med['time/rollout']:6.2f}  reward wait "
                      f"{med['time/reward']:6.2f}  hidden {med['reward/hidden_s']:6.2f} "
                      f"({med['reward/hidden_s'] / max(scoring, 1e-9):4.0%} of scoring)  step {total:6.2f} "
                      f"(x{total / base:.2f})  {med['rollout/tokens_per_s']:6.0f} tokens/s")
        finally:
            explorer.close()


if __name__ == "__main__":
    main()
