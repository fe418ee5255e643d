"""Schedule benchmark: the same config and the same number of trained samples through sync, one-step off-policy,
async and async with 2 explorers, one after another in one run (one torch thread per worker).

Prints wall-clock, samples/s, speedup vs sync, the ideal overlap bound (R+T)/max(R,T) from the sync run's measured
rollout time R and train time T per step, the fraction of that bound reached, mean staleness, and weight-sync time
as a share of the trainer step. Writes bench/out/schedules.png with the four timelines stacked like DESIGN.md (a)-(d).

    python bench/schedules.py                      # default model, about 15 minutes on 2 cores
    python bench/schedules.py --model tiny --steps 4 --out bench/out/tiny
    python bench/schedules.py --as-user            # the three entry scripts with their defaults, ~7 minutes
    python bench/schedules.py --as-user --repeats 3   # three rounds and the median of their ratios, ~21 minutes

--as-user runs `python train_sync.py --model default --steps 6`, then train_offpolicy.py and train_async.py with the
same two flags and nothing else (each script's own defaults: threads, core binding, in-flight groups, engine),
one after the other, and prints each whole run's wall time (the process, start-up and wrap-up included), its
in-run elapsed time, the steady s/step (steps 2 to the last) and the speed-up over sync, beside the overlap bound
(R+T)/max(R,T) from the sync run's rollout R and train T per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.runtime.metrics import buffer_spans, draw_timeline, read_metrics, read_timeline  # noqa: E402

SCHEDULES = [
    ("(a) sync", "train_sync.py", []),
    ("(b) one-step off-policy", "train_offpolicy.py", []),
    ("(c) async", "train_async.py", ["--max-staleness", "2", "--off-policy-correction", "decoupled"]),
    ("(d) async, 2 explorers", "train_async.py", ["--num-explorers", "2", "--max-staleness", "2",
                                                   "--off-policy-correction", "decoupled"]),
]


def run_entry(script: str, flags: list[str], out: str) -> None:
    """Run an entry script to the end in a fresh process (outputs in `out`); stop with its stderr if it fails."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *flags, "--out-dir", out],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: {script} failed:\n{proc.stderr[-3000:]}")


def phase_time(events, process_prefix, phases):
    return sum(e["end"] - e["start"] for e in events if e["process"].startswith(process_prefix) and e["phase"] in phases)


def as_user(opts) -> None:
    """The three entry scripts as a new user runs them (see the module docstring), --repeats rounds."""
    rounds = [as_user_round(opts, i) for i in range(opts.repeats)]
    if len(rounds) > 1:
        print(f"\nmedian over {len(rounds)} rounds (each ratio taken within its round):")
        for i, script in enumerate(SCRIPTS):
            whole = statistics.median(r["runs"][0]["whole_s"] / r["runs"][i]["whole_s"] for r in rounds)
            steady = statistics.median(r["runs"][0]["steady_s"] / r["runs"][i]["steady_s"] for r in rounds)
            print(f"{script:20s} whole {whole:5.2f}x sync   steady {steady:5.2f}x sync")
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "as_user.json"), "w") as f:
        json.dump({"rounds": rounds}, f, indent=2)


SCRIPTS = ("train_sync.py", "train_offpolicy.py", "train_async.py")


def as_user_round(opts, index: int) -> dict:
    rows = []
    for script in SCRIPTS:
        out = os.path.join(opts.out, "as_user", script.replace(".py", ""))
        print(f"--- round {index + 1}: python {script} --model {opts.model} --steps {opts.steps}", flush=True)
        start = time.time()
        run_entry(script, ["--model", opts.model, "--steps", str(opts.steps), "--overwrite", *opts.extra.split()], out)
        whole = time.time() - start
        events, metrics = read_timeline(out), read_metrics(out)
        ends = sorted(e["end"] for e in events if e["process"] == "trainer0" and e["phase"] == "train")
        rows.append({"script": script, "whole_s": whole, "elapsed_s": metrics[-1]["time/elapsed"],
                     "steady_s": (ends[-1] - ends[0]) / (len(ends) - 1),
                     "rollout_s": phase_time(events, "explorer", ("rollout", "reward")) / len(metrics),
                     "train_s": phase_time(events, "trainer", ("train", "sync")) / len(ends)})
        print(f"    {whole:.0f} s whole run, steady {rows[-1]['steady_s']:.1f} s/step", flush=True)
    sync = rows[0]
    R, T = sync["rollout_s"], sync["train_s"]
    print(f"\nsync run: rollout R = {R:.1f} s/step, train+sync T = {T:.1f} s/step -> overlap bound (R+T)/max(R,T) = "
          f"{(R + T) / max(R, T):.2f}x\n")
    print(f"{'script':20s} {'whole s':>8s} {'x sync':>7s} {'in-run s':>9s} {'steady s/step':>14s} {'x sync':>7s}")
    for r in rows:
        print(f"{r['script']:20s} {r['whole_s']:8.0f} {sync['whole_s'] / r['whole_s']:6.2f}x {r['elapsed_s']:9.0f} "
              f"{r['steady_s']:14.1f} {sync['steady_s'] / r['steady_s']:6.2f}x", flush=True)
    return {"R": R, "T": T, "runs": rows}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "schedules"))
    p.add_argument("--extra", default="", help="more flags for every run, e.g. '--sync-method checkpoint'")
    p.add_argument("--as-user", action="store_true", help="the entry scripts with their own defaults (docstring)")
    p.add_argument("--repeats", type=int, default=1, help="--as-user: rounds of the three runs (a shared machine's "
                   "speed drifts between runs: the median of the rounds' ratios)")
    opts = p.parse_args()
    if opts.as_user:
        return as_user(opts)
    common = ["--model", opts.model, "--steps", str(opts.steps), "--num-threads", "1", "--tasks-per-step", "4",
              "--samples-per-task", "4", "--max-new-tokens", "32", "--minibatch-size", "16", "--eval-every", "0",
              "--eval-size", "8", "--checkpoint-every", "0", "--no-drop-zero-signal-groups", "--overwrite",
              *opts.extra.split()]
    results = []
    for label, script, flags in SCHEDULES:
        out = os.path.join(opts.out, script.replace(".py", "") + ("2" if "--num-explorers" in flags else ""))
        print(f"--- {label}: {script} {' '.join(flags)}", flush=True)
        start = time.time()
        run_entry(script, [*common, *flags], out)
        events, rows = read_timeline(out), read_metrics(out)
        trains = [e for e in events if e["process"] == "trainer0" and e["phase"] == "train"]
        # Wall-clock of the training itself: first rollout starts .. last train step ends (start-up, the initial
        # eval and the final checkpoint are the same in every schedule and left out).
        t0 = min(e["start"] for e in events if e["phase"] == "rollout")
        wall = max(e["end"] for e in trains) - t0
        samples = rows[-1]["samples"]
        ends = sorted(e["end"] for e in trains)
        results.append({
            "label": label, "out": out, "events": events, "wall": wall, "samples": samples,
            # Steady state: time per trainer step after the first one (the pipeline is full).
            "step_time": (ends[-1] - ends[0]) / (len(ends) - 1),
            "rollout_per_step": phase_time(events, "explorer", ("rollout", "reward")) / max(1, len(rows)),
            "train_per_step": phase_time(events, "trainer", ("train",)) / len(trains),
            "sync_per_step": phase_time(events, "trainer", ("sync", "sync-checkpoint")) / len(trains),
            "staleness": sum(r["staleness/mean"] for r in rows) / len(rows),
            "dropped": rows[-1].get("dropped_stale", 0), "total_s": time.time() - start,
        })
    sync = results[0]
    R, T = sync["rollout_per_step"], sync["train_per_step"] + sync["sync_per_step"]
    bound = (R + T) / max(R, T)
    print(f"\nsync run: rollout R = {R:.1f} s/step, train+sync T = {T:.1f} s/step -> ideal speedup (R+T)/max(R,T) "
          f"= {bound:.2f}x\n")
    print("speedup: sync wall-clock / this wall-clock (the first rollout is never overlapped); steady: the same for "
          "the time per trainer step once the pipeline is full\n")
    print(f"{'schedule':26s} {'wall s':>7s} {'samples/s':>9s} {'speedup':>8s} {'of bound':>8s} {'s/step':>7s} "
          f"{'steady':>7s} {'of bound':>8s} {'staleness':>9s} {'dropped':>7s} {'sync/step':>9s}")
    for r in results:
        speedup, steady = sync["wall"] / r["wall"], sync["step_time"] / r["step_time"]
        r.update(speedup=speedup, of_bound=speedup / bound, steady_speedup=steady, steady_of_bound=steady / bound,
                 sync_share=r["sync_per_step"] / r["train_per_step"])
        print(f"{r['label']:26s} {r['wall']:7.1f} {r['samples'] / r['wall']:9.2f} {speedup:7.2f}x "
              f"{100 * speedup / bound:7.0f}% {r['step_time']:7.1f} {steady:6.2f}x {100 * steady / bound:7.0f}% "
              f"{r['staleness']:9.2f} {r['dropped']:7d} {100 * r['sync_share']:8.1f}%")
    _plot(results, os.path.join(opts.out, "schedules.png"))
    with open(os.path.join(opts.out, "schedules.json"), "w") as f:
        json.dump({"R": R, "T": T, "bound": bound,
                   "runs": [{k: v for k, v in r.items() if k != "events"} for r in results]}, f, indent=2)
    print(f"\nwrote {os.path.join(opts.out, 'schedules.png')}")


def _plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(14, 2.6 * len(results)), sharex=True)
    for ax, r in zip(axes, results):
        events = r["events"] + buffer_spans(r["events"])
        draw_timeline(ax, [e for e in events if e["phase"] not in ("eval", "checkpoint")],
                      title=f"{r['label']}: {r['wall']:.0f} s, {r['speedup']:.2f}x vs sync")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
