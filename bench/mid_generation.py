"""train_async.py with vLLM: weights taken between decode steps of a running round (--mid-generation-updates, the
default) vs only between rounds (--no-mid-generation-updates), one after another in one run, same config.

    python bench/mid_generation.py                         # default model, 6 steps each
    python bench/mid_generation.py --steps 3 --extra "--max-new-tokens 32"

Prints per run: trained samples/s (first rollout start .. last trainer step end), s per trainer step once the pipeline
is full, mean staleness of the trained samples, how many weight updates the explorer took inside a generation round,
and the explorer's time per weight update (broadcast arrival .. vLLM holds the weights) against the trainer's step
time. Speed figures are only comparable within one invocation (2 shared cores here).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.schedules import run_entry  # noqa: E402
from common.runtime.metrics import read_metrics, read_timeline  # noqa: E402


def measure(out: str, label: str, total_s: float) -> dict:
    events, rows = read_timeline(out), read_metrics(out)
    trains = sorted((e for e in events if e["process"] == "trainer0" and e["phase"] == "train"), key=lambda e: e["end"])
    rollouts = [e for e in events if e["process"] == "explorer0" and e["phase"] == "rollout"]
    syncs = [e for e in events if e["process"] == "explorer0" and e["phase"] == "sync" and e.get("version", 0) > 0]
    inside = [s for s in syncs if any(r["start"] < s["start"] < r["end"] for r in rollouts)]
    t0 = min(r["start"] for r in rollouts)
    wall = trains[-1]["end"] - t0
    return {"run": label, "wall_s": round(wall, 1), "samples": rows[-1]["samples"],
            "samples_per_s": round(rows[-1]["samples"] / wall, 3),
            "s_per_step": round((trains[-1]["end"] - trains[0]["end"]) / max(1, len(trains) - 1), 1),
            "staleness_mean": round(sum(r["staleness/mean"] for r in rows) / len(rows), 2),
            "dropped_stale": rows[-1].get("dropped_stale", 0),
            "updates": len(syncs), "updates_mid_generation": len(inside),
            "update_s": round(sum(s["end"] - s["start"] for s in syncs) / max(1, len(syncs)), 3),
            "train_step_s": round(sum(e["end"] - e["start"] for e in trains) / len(trains), 1),
            "total_s": round(total_s, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "mid_generation"))
    p.add_argument("--extra", default="", help="more flags for both runs")
    p.add_argument("--json", default="")
    opts = p.parse_args()
    common = ["--model", opts.model, "--engine", "vllm", "--steps", str(opts.steps), "--num-threads", "1",
              "--tasks-per-step", "4", "--samples-per-task", "4", "--max-new-tokens", "48", "--minibatch-size", "16",
              "--micro-batch-size", "8", "--eval-every", "0", "--eval-size", "4", "--checkpoint-every", "0",
              "--max-staleness", "4", "--no-drop-zero-signal-groups", "--overwrite", *opts.extra.split()]
    results = []
    for label, flag in (("between decode steps", "--mid-generation-updates"),
                        ("between rounds", "--no-mid-generation-updates")):
        out = os.path.join(opts.out, flag.strip("-"))
        start = time.time()
        run_entry("train_async.py", [*common, flag], out)
        results.append(measure(out, label, time.time() - start))
        print(f"[mid_generation] {json.dumps(results[-1])}", flush=True)
    print("\n| weights taken | samples/s | s/step | mean staleness | updates (mid-round) | update s | train step s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['run']} | {r['samples_per_s']} | {r['s_per_step']} | {r['staleness_mean']} | "
              f"{r['updates']} ({r['updates_mid_generation']}) | {r['update_s']} | {r['train_step_s']} |")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
