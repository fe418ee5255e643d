"""The run's timeline as a Chrome trace-event file (timeline.trace.json): open it in https://ui.perfetto.dev or
chrome://tracing to zoom into every phase of every process.

Format: the JSON object form of the Trace Event Format, {"traceEvents": [...], "displayTimeUnit": "ms"}. Each
process of the timeline (explorers, the buffer, trainers, top to bottom as in timeline.png) is a trace process;
each phase a complete event ("ph": "X", microseconds since the run's first event) whose args keep the event's
fields (step, version, hashes ...). Phases that run in the background (sync-in-flight, reward-in-flight) get a
thread of their own, and so does each explorer's share of the buffer, so no thread holds overlapping events.
"""

from __future__ import annotations

import json
import os

BACKGROUND = ("sync-in-flight", "reward-in-flight")


def lane_order(events: list[dict]) -> list[str]:
    explorers = sorted({e["process"] for e in events if e["process"].startswith("explorer")})
    trainers = sorted({e["process"] for e in events if e["process"].startswith("trainer")})
    others = sorted({e["process"] for e in events} - set(explorers) - set(trainers) - {"buffer"})
    return explorers + ["buffer"] + trainers + others


def lane_label(process: str) -> str:
    return process.replace("explorer", "Explorer ").replace("trainer", "Trainer ").title()


def chrome_trace(events: list[dict]) -> dict:
    """Timeline events ({process, phase, start, end, ...} in seconds) -> a trace-event JSON object."""
    if not events:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = min(e["start"] for e in events)
    lanes = lane_order(events)
    trace, threads = [], set()
    for pid, process in enumerate(lanes):
        trace.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": lane_label(process)}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    for e in events:
        pid = lanes.index(e["process"])
        if e["phase"] == "buffer":  # one thread per explorer: batches of one explorer never overlap in the queue
            tid, thread = 1 + int(str(e["batch"]).split("-")[0]), f"from Explorer {str(e['batch']).split('-')[0]}"
        elif e["phase"] in BACKGROUND:
            tid, thread = 1, "in flight"
        else:
            tid, thread = 0, "phases"
        threads.add((pid, tid, thread))
        args = {k: v for k, v in e.items() if k not in ("process", "phase", "start", "end")}
        trace.append({"name": e["phase"], "cat": e["phase"], "ph": "X", "pid": pid, "tid": tid,
                      "ts": round((e["start"] - t0) * 1e6, 1), "dur": round(max(e["end"] - e["start"], 0) * 1e6, 1),
                      "args": args})
    for pid, tid, thread in sorted(threads):
        trace.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread}})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(out_dir: str, events: list[dict]) -> str:
    path = os.path.join(out_dir, "timeline.trace.json")
    with open(path, "w") as f:
        json.dump(chrome_trace(events), f)
    return path
