"""Algorithm benchmark: grpo, dr_grpo, ppo and opmd one after another through train_sync.py on the same config and
budget (same steps, same samples per step, same seed), read back from each run's metrics.jsonl / summary.json.

Prints held-out accuracy before -> after, wall-clock, samples and train reward per algorithm, and writes one PNG
of held-out accuracy vs wall-clock for all of them (default bench/results/algos.png) plus <out>/algos.json.
Every flag this script does not know goes to train_sync.py unchanged (after --config, so it wins).

    python bench/algos.py                                   # configs/sync_default.yaml: default model, 40 steps, CPU
    python bench/algos.py --steps 20 --eval-every 4 --explorer-devices cuda:0 --trainer-devices cuda:1
    python bench/algos.py --model tiny --steps 2 --plot bench/out/algos-tiny/algos.png   # smoke test, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import time

from schedules import ROOT, run_entry  # bench/ is sys.path[0] when run as a script

from common.metrics import read_metrics  # noqa: E402  (ROOT is on sys.path via schedules)


def accuracy_curve(rows: list[dict], summary: dict) -> list[tuple[float, float]]:
    """(seconds of training, held-out accuracy) points. The eval logged in step s's row saw the weights after step
    s-1, so it is placed at the end of step s-1 (0 for the first); the final eval at the end of the last step."""
    ends = {r["step"]: r["time/elapsed"] for r in rows}
    points = [(ends.get(r["step"] - 1, 0.0), r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    if summary.get("eval_after") is not None:
        points.append((rows[-1]["time/elapsed"], summary["eval_after"]))
    return points


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algos", default="grpo,dr_grpo,ppo,opmd", help="comma-separated --algo values, run in order")
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "sync_default.yaml"))
    p.add_argument("--eval-every", type=int, default=5, help="held-out eval every N steps (points on the curve)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "algos"))
    p.add_argument("--plot", default=os.path.join(ROOT, "bench", "results", "algos.png"))
    opts, passthrough = p.parse_known_args()
    common = ["--config", opts.config, "--eval-every", str(opts.eval_every), "--checkpoint-every", "0", "--overwrite",
              *passthrough]  # the last occurrence of a flag wins
    results = []
    for algo in opts.algos.split(","):
        out = os.path.join(opts.out, algo)
        print(f"--- {algo}: train_sync.py {' '.join(common)} --algo {algo}", flush=True)
        start = time.time()
        run_entry("train_sync.py", [*common, "--algo", algo], out)
        rows = read_metrics(out)
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
        fifth = max(1, len(rows) // 5)
        results.append({
            "algo": algo, "eval_before": summary["eval_before"], "eval_after": summary["eval_after"],
            "train_s": rows[-1]["time/elapsed"], "total_s": time.time() - start, "samples": rows[-1]["samples"],
            "steps": len(rows), "reward_first": sum(r["reward/mean"] for r in rows[:fifth]) / fifth,
            "reward_last": sum(r["reward/mean"] for r in rows[-fifth:]) / fifth,
            "curve": accuracy_curve(rows, summary),
        })
    print(f"\n{'algo':8s} {'eval before':>11s} {'eval after':>10s} {'change':>7s} {'train s':>8s} {'samples':>7s} "
          f"{'reward first/last fifth':>23s}")
    for r in results:
        print(f"{r['algo']:8s} {r['eval_before']:11.3f} {r['eval_after']:10.3f} "
              f"{r['eval_after'] - r['eval_before']:+7.3f} {r['train_s']:8.1f} {r['samples']:7d} "
              f"{r['reward_first']:11.3f} / {r['reward_last']:.3f}")
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "algos.json"), "w") as f:
        json.dump({"flags": common, "runs": results}, f, indent=2)
    _plot(results, opts.plot)
    print(f"\nwrote {opts.plot} and {os.path.join(opts.out, 'algos.json')}")


def _plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        xs, ys = zip(*r["curve"])
        ax.plot(xs, ys, marker="o", label=f"{r['algo']} ({r['eval_before']:.2f} -> {r['eval_after']:.2f})")
    ax.set_xlabel("training wall-clock (s)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"train_sync.py, {results[0]['samples']} samples per algorithm")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
