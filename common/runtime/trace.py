"""The run's timeline as a Chrome trace-event file (timeline.trace.json): open it in https://ui.perfetto.dev or
chrome://tracing to zoom into every phase of every process.

Format: the JSON object form of the Trace Event Format, {"traceEvents": [...], "displayTimeUnit": "ms"}. Each
process of the timeline (explorers, the buffer, trainers, top to bottom as in timeline.png) is a trace process;
each phase a complete event ("ph": "X", microseconds since the run's first event) whose args keep the event's
fields (step, version, hashes ...). Phases that run in the background (sync-in-flight, reward-in-flight), batches
waiting in the buffer and groups in flight (train_async.py's streaming explorer) get threads of their own, as many
as overlap, so no thread holds overlapping events: the rows of "group in flight" count the groups in flight.
"""

from __future__ import annotations

import json
import os

BACKGROUND = ("sync-in-flight", "reward-in-flight")
GROUPS = "group"  # train_async.py: one event per group from its start to its scores, one row per group in flight


def lane_order(events: list[dict]) -> list[str]:
    explorers = sorted({e["process"] for e in events if e["process"].startswith("explorer")})
    trainers = sorted({e["process"] for e in events if e["process"].startswith("trainer")})
    others = sorted({e["process"] for e in events} - set(explorers) - set(trainers) - {"buffer"})
    return explorers + ["buffer"] + trainers + others


def lane_label(process: str) -> str:
    return process.replace("explorer", "Explorer ").replace("trainer", "Trainer ").title()


def _thread_group(event: dict) -> tuple[int, str]:
    """(first thread id, thread name) of an event's kind: phases, background phases, queued batches."""
    if event["phase"] == "buffer":
        return 200, "queued batch"
    if event["phase"] in BACKGROUND:
        return 100, "in flight"
    if event["phase"] == GROUPS:
        return 300, "group in flight"
    return 0, "phases"


def chrome_trace(events: list[dict]) -> dict:
    """Timeline events ({process, phase, start, end, ...} in seconds) -> a trace-event JSON object. Within a
    process, each kind of event takes the first thread of its group that is free at its start, so no thread holds
    two overlapping events (the trace viewers draw one stack per thread)."""
    if not events:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = min(e["start"] for e in events)
    lanes = lane_order(events)
    trace, threads, busy_until = [], {}, {}
    for pid, process in enumerate(lanes):
        trace.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": lane_label(process)}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    for e in sorted(events, key=lambda e: (e["start"], e["end"])):
        pid = lanes.index(e["process"])
        ts, dur = round((e["start"] - t0) * 1e6), round(max(e["end"] - e["start"], 0.0) * 1e6)
        tid, name = _thread_group(e)
        while busy_until.get((pid, tid), -1) > ts:  # taken: the next thread of the group
            tid += 1
        busy_until[(pid, tid)] = ts + dur
        threads[(pid, tid)] = name if tid % 100 == 0 else f"{name} {tid % 100 + 1}"
        args = {k: v for k, v in e.items() if k not in ("process", "phase", "start", "end")}
        trace.append({"name": e["phase"], "cat": e["phase"], "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur,
                      "args": args})
    for (pid, tid), name in sorted(threads.items()):
        trace.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        trace.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(out_dir: str, events: list[dict]) -> str:
    path = os.path.join(out_dir, "timeline.trace.json")
    with open(path, "w") as f:
        json.dump(chrome_trace(events), f)
    return path
