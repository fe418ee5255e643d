"""Run outputs: metrics.jsonl (+ W&B, + a tqdm bar) and the timeline of every process's phases.

Each process appends its phases to out_dir/timeline/<process>.jsonl as they end (nothing is lost if a worker
dies); `write_timeline` merges them into timeline.json and draws timeline.png with lanes Explorer(s) / Buffer /
Trainer, like the schedule diagrams in DESIGN.md.
"""

from __future__ import annotations

import glob
import json
import os
import time
from contextlib import contextmanager

from common.runtime.trace import lane_label, lane_order, write_chrome_trace

PHASE_COLORS = {
    "rollout": "#4C72B0", "reward": "#DD8452", "eval": "#8172B3", "train": "#55A868", "sync": "#C44E52",
    "sync-checkpoint": "#E377C2", "sync-in-flight": "#F2A0A0", "wait": "#D0D0D0", "checkpoint": "#937860", "buffer": "#CCB974",
    "reward-in-flight": "#F5C29A", "generate": "#4C72B0", "group": "#1B9E77",
}


class Timeline:
    """Records phases of one process: `with timeline.phase("train", step=3): ...`."""

    def __init__(self, out_dir: str, process: str):
        os.makedirs(os.path.join(out_dir, "timeline"), exist_ok=True)
        self.path = os.path.join(out_dir, "timeline", f"{process}.jsonl")
        self.process = process
        self.totals: dict[str, float] = {}

    def record(self, phase: str, start: float, end: float, **extra):
        self.totals[phase] = self.totals.get(phase, 0.0) + (end - start)
        with open(self.path, "a") as f:
            f.write(json.dumps({"process": self.process, "phase": phase, "start": start, "end": end, **extra}) + "\n")

    @contextmanager
    def phase(self, phase: str, **extra):
        """Yields the event's extra fields: what the body adds to them is recorded too."""
        start = time.time()
        try:
            yield extra
        finally:
            self.record(phase, start, time.time(), **extra)

    def take_totals(self) -> dict[str, float]:
        """Seconds per phase since the last call (for per-step metrics)."""
        totals, self.totals = self.totals, {}
        return totals


def peak_gpu_memory(device, who: str) -> dict:
    """`memory/<who>_peak_gib`: the most GPU memory this process's torch allocator has held so far (off CUDA: none)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return {}
    return {f"memory/{who}_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30}


def read_jsonl(path: str) -> list[dict]:
    """The complete rows of a JSON-lines file another process may be appending to: a last line without its newline
    is being written (or was cut by a kill) and is left out."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def read_timeline(out_dir: str) -> list[dict]:
    events = []
    for path in sorted(glob.glob(os.path.join(out_dir, "timeline", "*.jsonl"))):
        events += read_jsonl(path)
    return sorted(events, key=lambda e: e["start"])


def buffer_spans(events: list[dict]) -> list[dict]:
    """Buffer lane: each rollout batch from the moment it is queued until a trainer takes it."""
    puts = {e["put"]: e for e in events if "put" in e}
    return [{"process": "buffer", "phase": "buffer", "start": puts[e["get"]]["end"], "end": e["end"], "batch": e["get"]}
            for e in events if e.get("get") in puts]


def write_timeline(out_dir: str, title: str = "", plot: bool = True) -> list[dict]:
    """timeline.json and timeline.trace.json from the processes' timeline files, and timeline.png unless not `plot`."""
    events = read_timeline(out_dir)
    events = events + buffer_spans(events)
    with open(os.path.join(out_dir, "timeline.json"), "w") as f:
        json.dump(events, f)
    write_chrome_trace(out_dir, events)  # timeline.trace.json: Perfetto / chrome://tracing
    if not plot:
        return events
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(15, 3.2))
    draw_timeline(ax, events, title=title)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "timeline.png"), dpi=110)
    plt.close(fig)
    return events


def draw_timeline(ax, events: list[dict], title: str = ""):
    """Lanes top to bottom: explorers, buffer, trainers; x = seconds since the first event."""
    if not events:
        return
    t0 = min(e["start"] for e in events)
    lanes = [p for p in lane_order(events) if p == "buffer" or p.startswith(("explorer", "trainer"))]
    explorers = [p for p in lanes if p.startswith("explorer")]
    y = {name: len(lanes) - 1 - i for i, name in enumerate(lanes)}
    seen = set()
    for e in events:
        if e["process"] not in y or e["start"] == e["end"]:  # an instant (the cores' changes): in the trace only
            continue
        lane = y[e["process"]]
        height, base = 0.8, lane - 0.4
        if e["phase"] == "buffer":  # a batch's time in the queue, one sub-lane per explorer
            share = 0.8 / max(1, len(explorers))
            height, base = share, lane - 0.4 + share * int(str(e["batch"]).split("-")[0])
        elif e["phase"] in ("sync-in-flight", "reward-in-flight"):  # in the background: a strip under the lane
            height, base = 0.2, lane - 0.45
        elif e["phase"] == "group":  # a group in flight (train_async.py): a faint strip over the lane, darker
            height, base = 0.15, lane + 0.3  # where more groups overlap (Perfetto shows one row per group)
        label = e["phase"] if e["phase"] not in seen else None
        seen.add(e["phase"])
        ax.broken_barh([(e["start"] - t0, e["end"] - e["start"])], (base, height),
                       facecolors=PHASE_COLORS.get(e["phase"], "#999999"), edgecolor="white" if e["phase"] != "group"
                       else "none", linewidth=0.3, label=label, alpha=0.15 if e["phase"] == "group" else 1.0)
    ax.set_yticks(list(y.values()), [lane_label(n) for n in y])
    ax.set_xlabel("seconds")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, framealpha=0.8)  # outside: lanes stay visible


class MetricsLogger:
    """metrics.jsonl rows (one per trainer step), optional W&B, and a tqdm bar with step, reward and ETA."""

    def __init__(self, out_dir: str, config: dict, total_steps: int, start_step: int = 0, track: bool = False,
                 project: str = "tandem", show_progress: bool = True, run_name: str | None = None,
                 entity: str | None = None, tags: tuple[str, ...] = (), resumed: bool = False):
        from tqdm import tqdm

        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.resumed = resumed  # rows of a resumed run carry "resumed": true
        self.wandb = None
        if track:
            import wandb

            # Exactly once in W&B too: a resumed run continues the same W&B run; what W&B does not hold yet of the
            # rows kept in metrics.jsonl is sent first, and steps it already holds are not sent again.
            self.wandb_state = os.path.join(out_dir, "wandb_run.json")
            run_id = read_json(self.wandb_state, {}).get("id") if resumed else None
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self.wandb = wandb.init(project=project, config=config, dir=out_dir, mode=mode,
                                    id=run_id, resume="allow" if run_id else None,
                                    name=run_name, entity=entity, tags=list(tags) or None)
            self.wandb_logged = 0
            if run_id:
                self.wandb_logged = self._wandb_backfill(out_dir, run_id)
            with open(self.wandb_state + ".tmp", "w") as f:
                json.dump({"id": self.wandb.id}, f)
            os.replace(self.wandb_state + ".tmp", self.wandb_state)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", disable=not show_progress,
                        dynamic_ncols=True)

    def _wandb_backfill(self, out_dir: str, run_id: str) -> int:
        """The last step W&B holds of run `run_id` (online: the server's; offline: what the earlier offline runs
        wrote to disk; a killed run's buffered rows never got there), after sending it the rows of metrics.jsonl
        after that step."""
        held = self.wandb.starting_step - 1
        for folder in glob.glob(os.path.join(out_dir, "wandb", f"offline-run-*-{run_id}")):
            held = max(held, max(wandb_offline_steps(folder), default=0))
        for row in read_metrics(out_dir):
            if row["step"] > held:
                self.wandb.log(row, step=row["step"])
                held = row["step"]
        return held

    def log(self, row: dict):
        if self.resumed:
            row = {**row, "resumed": True}
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as e:
            raise SystemExit(f"error: could not write {os.path.abspath(self.path)}: {e.strerror or e} "
                             "(free some space, then --resume)") from None
        if self.wandb is not None and row["step"] > self.wandb_logged:
            self.wandb.log(row, step=row["step"])
            self.wandb_logged = row["step"]
        shown = {"reward": row.get("reward/mean")}
        if "eval/accuracy" in row:
            shown["eval"] = row["eval/accuracy"]
        self.bar.set_postfix({k: f"{v:.3f}" for k, v in shown.items() if v is not None})
        self.bar.update(1)

    def close(self):
        self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


def wandb_offline_steps(folder: str) -> list[int]:
    """History steps an offline W&B run folder holds on disk: its .wandb file is a LevelDB-style log (7-byte file
    header, 32 KiB blocks of records each with a 7-byte header: CRC, length, kind) of protobuf Records."""
    import struct

    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    steps = []
    for path in glob.glob(os.path.join(folder, "*.wandb")):
        with open(path, "rb") as f:
            data = f.read()
        pos, block, payload = 7, 32768, b""
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # the block's trailer
                pos += block - pos % block
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if length == 0 and kind == 0:
                break
            payload += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a whole record, or the last piece of one
                record = pb.Record()
                try:
                    record.ParseFromString(payload)
                except DecodeError:  # a torn last record of a killed run
                    break
                if record.WhichOneof("record_type") == "history":
                    steps.append(record.history.step.num)
                payload = b""
    return steps


def read_json(path: str, default):
    """A JSON file's value; `default` where it is missing or unreadable (a run that has not written it)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def rewind_metrics(out_dir: str, step: int) -> int:
    """Resume from the checkpoint of `step`: rows after it (and a half-written last line) go, as the resumed run
    writes them again, so every step appears once. Atomic (temp file + rename). Returns how many rows went."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # killed mid-write
                dropped += 1
                continue
            if row.get("step", 0) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
    return dropped


def read_metrics(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "metrics.jsonl")
    return read_jsonl(path) if os.path.exists(path) else []


def reward_curve_points(out_dir: str, key: str = "eval/accuracy"
                        ) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(train reward per trainer step, held-out `key` per evaluation) with x = trainer steps done. An evaluation
    sits at the step count of the weights it measured (eval/version): the one before training at 0, the final one
    at the last step."""
    rows = read_metrics(out_dir)
    train = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]  # partial rollouts: early may be none
    evals = [(r.get("eval/version", r["step"] - 1), r[key]) for r in rows if key in r]
    summary = read_json(os.path.join(out_dir, "summary.json"), {})
    # every evaluation, also those that shared a row with a later one
    evals += [(e["eval/version"], e[key]) for e in summary.get("evals", []) if "eval/version" in e and key in e]
    if key == "eval/accuracy" and summary.get("eval_after") is not None:
        evals.append((summary["steps"], summary["eval_after"]))
    return train, sorted(set(evals))


def plot_reward_curve(out_dir: str, path: str | None = None, title: str | None = None):
    """reward.png: training reward per trainer step, held-out accuracy at the step it was measured, and the held-out
    reward mean where it says more (a judged taskset's accuracy, reward 1, stays 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = reward_curve_points(out_dir)
    means = reward_curve_points(out_dir, "eval/reward_mean")[1]
    means = means if dict(means) != dict(evals) else []
    if not train and not evals:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), ".-", label="train reward (batch mean)", alpha=0.6)
    if evals:
        samples = read_json(os.path.join(out_dir, "config.json"), {}).get("eval_samples", 1)
        ax.plot(*zip(*evals), "o-", label="held-out accuracy (greedy)" if samples == 1 else f"held-out mean@{samples}")
    if means:
        ax.plot(*zip(*means), "s--", label="held-out reward mean")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward / accuracy")
    ax.set_title(title or f"{os.path.basename(os.path.normpath(out_dir))}: reward and held-out accuracy")
    ax.xaxis.get_major_locator().set_params(integer=True)
    values = [v for _, v in train + evals + means]
    ax.set_ylim(min(0.0, *values) - 0.02, max(1.0, *values) + 0.02)  # shaped rewards may leave [0, 1]
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path or os.path.join(out_dir, "reward.png"), dpi=110)
    plt.close(fig)
