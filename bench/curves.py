"""Learning curves side by side: several labelled runs of the entry scripts with shared flags, then one PNG of
held-out accuracy against trained samples and against wall-clock, and a table (JSON + stdout).

    # does async with a staleness bound + correction learn as well as sync for the same samples?
    python bench/curves.py --name staleness \
        --run "sync=train_sync.py" \
        --run "async, staleness 2, tis=train_async.py --max-staleness 2 --off-policy-correction tis" \
        -- --config configs/sync_default.yaml --eval-every 5
    # one GPU: runs share it (--parallel starts them together; compare wall-clock only between parallel runs)
    python bench/curves.py --name x --parallel --run ... -- --explorer-devices cuda:0 --trainer-devices cuda:0

Accuracy is greedy held-out accuracy (eval/accuracy; mean@N with --eval-samples N), before and after with its 95%
bootstrap interval over the tasks; the x value of an evaluation is the number of samples the
evaluated weights were trained on (eval/version x rollout batch), so sync and async points line up.
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

from common.runtime.metrics import read_metrics  # noqa: E402


def curve(out_dir: str) -> dict:
    """Evaluations of one run: trained samples, wall-clock seconds and accuracy of each, plus the run's summary."""
    config = json.load(open(os.path.join(out_dir, "config.json")))
    batch = config["tasks_per_step"] * config["samples_per_task"]
    summary = json.load(open(os.path.join(out_dir, "summary.json")))
    rows = read_metrics(out_dir)
    points = [(0, 0.0, summary["eval_before"])] if summary.get("eval_before") is not None else []
    points += [(int(r["eval/version"]) * batch, r["time/elapsed"], r["eval/accuracy"])
               for r in rows if "eval/accuracy" in r and r["eval/version"] > 0]
    points.append((summary["steps"] * batch, summary["elapsed"], summary["eval_after"]))
    return {"samples": [p[0] for p in points], "seconds": [p[1] for p in points], "accuracy": [p[2] for p in points],
            "reward_first": rows[0]["reward/mean"], "reward_last": rows[-1]["reward/mean"],
            "dropped_stale": summary.get("dropped_stale", 0),
            "intervals": [summary.get("eval_before_interval"), summary.get("eval_after_interval")]}  # 95% bootstrap


def plot(results: dict, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for label, c in results.items():
        axes[0].plot(c["samples"], c["accuracy"], marker="o", label=label)
        axes[1].plot([s / 60 for s in c["seconds"]], c["accuracy"], marker="o", label=label)
    axes[0].set_xlabel("trained samples")
    axes[1].set_xlabel("wall-clock (min)")
    axes[0].set_ylabel("held-out accuracy (greedy)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend()
    import textwrap

    fig.suptitle("\n".join(textwrap.wrap(title, 150)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    argv = sys.argv[1:]
    shared = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True, help="output name: bench/results/<name>.png and .json")
    p.add_argument("--run", action="append", required=True, metavar="LABEL=SCRIPT [FLAGS]",
                   help="one run: a label, '=', an entry script and its own flags")
    p.add_argument("--parallel", action="store_true", help="start every run at once (e.g. on one shared GPU)")
    p.add_argument("--reuse", action="store_true",
                   help="keep a run whose folder already holds a finished run (summary.json) instead of re-running it: "
                        "a long table can be built over several sittings")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out"), help="where the runs' folders go")
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "results"))
    opts = p.parse_args(argv)
    runs = []
    for spec in opts.run:
        if "=" not in spec:
            p.error(f"--run {spec!r}: expected LABEL=SCRIPT [FLAGS]")
        label, command = spec.split("=", 1)
        script, *flags = command.split()
        out = os.path.join(opts.out, opts.name, "".join(ch if ch.isalnum() else "_" for ch in label))
        runs.append((label, out, [sys.executable, os.path.join(ROOT, script), *shared, *flags, "--out-dir", out,
                                  "--overwrite"]))
    procs = []
    for label, out, cmd in runs:
        if opts.reuse and os.path.exists(os.path.join(out, "summary.json")):
            print(f"--- {label}: reusing the finished run in {out}", flush=True)
            continue
        print(f"--- {label}: {' '.join(cmd[1:])}", flush=True)
        os.makedirs(out, exist_ok=True)
        log = open(os.path.join(out + ".log"), "w")
        procs.append((label, out, subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), time.time()))
        if not opts.parallel:
            procs[-1][2].wait()
    for label, out, proc, start in procs:
        if proc.wait() != 0:
            sys.exit(f"error: run {label!r} failed (exit {proc.returncode}); its log: {out}.log")
    results = {label: curve(out) for label, out, _ in runs}
    os.makedirs(opts.results, exist_ok=True)
    title = f"{opts.name}: {' '.join(shared)}"
    plot(results, title, os.path.join(opts.results, f"{opts.name}.png"))
    with open(os.path.join(opts.results, f"{opts.name}.json"), "w") as f:
        json.dump({"shared_flags": shared, "runs": {label: cmd[2:] for label, _, cmd in runs}, "curves": results},
                  f, indent=1)
    print(f"\n{'run':<40} {'accuracy [95% interval] before -> after':>52} {'samples':>8} {'wall s':>8} {'dropped':>8}")
    for label, c in results.items():
        ends = [f"{a:.3f}" + (f" [{i[0]:.3f}, {i[1]:.3f}]" if i else "")
                for a, i in zip((c["accuracy"][0], c["accuracy"][-1]), c["intervals"])]
        print(f"{label:<40} {ends[0]:>24} -> {ends[1]:<24} {c['samples'][-1]:>8d} {c['seconds'][-1]:>8.0f} "
              f"{c['dropped_stale']:>8d}")
    print(f"plot: {os.path.join(opts.results, opts.name + '.png')}")


if __name__ == "__main__":
    main()
