"""Rollout tokens/s inside a real `train_sync.py --engine vllm` run vs the same engine alone (bench/engines.py) on
the same prompts (the run's arith tasks), lengths (48 new tokens), batch (8 x 4) and temperature (0.5), one after
the other in one invocation. The run's figure is metrics' rollout/tokens_per_s of every step but the first.

    python bench/rollout_in_run.py --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.schedules import run_entry  # noqa: E402
from common.runtime.metrics import read_metrics  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "rollout_in_run"))
    opts = p.parse_args()
    run_dir = os.path.join(opts.out, "run")
    run_entry("train_sync.py", ["--config", os.path.join(ROOT, "configs", "sync_default.yaml"), "--engine", "vllm",
                                "--steps", str(opts.steps), "--eval-every", "0", "--eval-size", "4",
                                "--checkpoint-every", "0", "--overwrite"], run_dir)
    rows = read_metrics(run_dir)[1:]
    in_run = sum(r["rollout/tokens_per_s"] for r in rows) / len(rows)
    bench_json = os.path.join(opts.out, "engines.json")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "engines.py"), "--engines", "vllm",
                           "--arith", "--fresh-prefix", "--prompts", "8", "--n", "4", "--max-new-tokens", "48",
                           "--temperature", "0.5", "--repeats", "3", "--json", bench_json],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: bench/engines.py failed:\n{proc.stderr[-3000:]}")
    alone = json.load(open(bench_json))["vllm"]["tokens_per_s"]
    result = {"in_run_tokens_per_s": round(in_run, 1), "per_step": [round(r["rollout/tokens_per_s"], 1) for r in rows],
              "engine_alone_tokens_per_s": alone, "ratio": round(in_run / alone, 2)}
    print(f"[rollout_in_run] {json.dumps(result)}")
    with open(os.path.join(opts.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
