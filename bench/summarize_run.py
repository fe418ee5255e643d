"""Print a run's learning figures and its time split per trainer step, from metrics.jsonl and the timeline.

    python bench/summarize_run.py runs/sync-20261122-114824
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.runtime.metrics import plot_reward_curve, read_metrics, read_timeline  # noqa: E402


def main(out_dir: str):
    rows = read_metrics(out_dir)
    if not rows:
        sys.exit(f"error: {out_dir}: no metrics.jsonl rows")
    summary_path = os.path.join(out_dir, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    evals = [(r["step"], r["time/elapsed"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    print(f"steps: {len(rows)}, wall-clock: {rows[-1]['time/elapsed'] / 60:.1f} min")
    print("held-out accuracy (greedy) by step: " + ", ".join(f"step {s} ({t / 60:.1f} min): {a:.2f}" for s, t, a in evals)
          + (f", final: {summary['eval_after']:.2f}" if summary.get("eval_after") is not None else ""))
    first, last = rows[: max(1, len(rows) // 5)], rows[-max(1, len(rows) // 5):]
    mean = lambda rs, k: sum(r.get(k, 0.0) for r in rs) / len(rs)  # noqa: E731
    print(f"train reward: first fifth {mean(first, 'reward/mean'):.3f} -> last fifth {mean(last, 'reward/mean'):.3f}")
    events = read_timeline(out_dir)
    steps = max(1, len(rows))
    print("time per step (s), from the timeline:")
    for process in sorted({e["process"] for e in events}):
        totals: dict[str, float] = {}
        for e in events:
            if e["process"] == process:
                totals[e["phase"]] = totals.get(e["phase"], 0.0) + e["end"] - e["start"]
        print(f"  {process:10s} " + "  ".join(f"{k} {v / steps:6.2f}" for k, v in sorted(totals.items())))
    plot_reward_curve(out_dir)
    print(f"reward curve: {os.path.join(out_dir, 'reward.png')}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/latest")
