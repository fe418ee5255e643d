"""Reward models behind one API: `score(response, task) -> Reward`, routed on task["reward"].

`RewardPool` scores batches in child processes: a verifier that hangs, crashes or raises gives score 0 with the
reason, is counted, and never stalls or kills the caller.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import signal
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for_any

KINDS = ("math", "code", "k12", "vision", "rm")


@dataclass
class Reward:
    score: float
    info: dict = field(default_factory=dict)  # at least {"reason": ...}


def score(response: str, task: dict) -> Reward:
    kind = task.get("reward", "math")
    if kind not in KINDS:
        raise ValueError(f"task {task.get('id')}: unknown reward {kind!r} (one of {', '.join(KINDS)})")
    try:
        module = importlib.import_module(f"rewards.{kind}")
    except ModuleNotFoundError:
        raise ValueError(f"task {task.get('id')}: reward {kind!r} is not available in this version") from None
    return module.score(response, task)


def _safe_score(score_fn, response: str, task: dict) -> Reward:
    try:
        return score_fn(response, task)
    except Exception as e:  # a verifier bug must not take the run down: score 0, say why
        return Reward(0.0, {"reason": f"error: {type(e).__name__}: {e}", "failed": True,
                            "traceback": traceback.format_exc(limit=3)})


def _serve(conn, score_fn):
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # die with the process that owns the pool
    except OSError:
        pass
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" notice: the pool enforces it
    while True:
        try:
            item = conn.recv()
        except EOFError:
            return
        conn.send(_safe_score(score_fn, *item))


class RewardPool:
    """Verifiers in `num_workers` child processes, each item under a `timeout_s` wall-clock limit.

    `score_fn` (a module-level function, default `rewards.score`) is how a custom verifier is plugged in.
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, score_fn=score):
        import multiprocessing as mp

        self.ctx = mp.get_context("spawn")
        self.timeout_s, self.score_fn = timeout_s, score_fn
        self.workers = [self._start() for _ in range(max(1, num_workers))]
        self.stats = {"scored": 0, "failed": 0, "timeouts": 0, "crashes": 0}

    def _start(self):
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_serve, args=(child, self.score_fn), daemon=True)
        proc.start()
        child.close()
        return proc, parent

    def _restart(self, i: int):
        proc, conn = self.workers[i]
        proc.kill()
        proc.join(timeout=5)
        conn.close()
        self.workers[i] = self._start()

    def score_batch(self, responses: list[str], tasks: list[dict]) -> list[Reward]:
        results: list[Reward | None] = [None] * len(responses)
        pending = list(range(len(responses)))[::-1]
        busy: dict[int, tuple[int, float]] = {}  # worker -> (item, deadline)
        while pending or busy:
            for w in range(len(self.workers)):
                if w not in busy and pending:
                    item = pending.pop()
                    self.workers[w][1].send((responses[item], tasks[item]))
                    busy[w] = (item, time.time() + self.timeout_s)
            conns = {self.workers[w][1]: w for w in busy}
            ready = wait_for_any(list(conns), timeout=max(0.0, min(d for _, d in busy.values()) - time.time()))
            for conn in ready:
                w = conns[conn]
                item, _ = busy.pop(w)
                try:
                    results[item] = conn.recv()
                except (EOFError, ConnectionResetError):
                    self.stats["crashes"] += 1
                    results[item] = Reward(0.0, {"reason": "verifier crashed", "failed": True})
                    self._restart(w)
            for w, (item, deadline) in list(busy.items()):
                if time.time() >= deadline:
                    del busy[w]
                    self.stats["timeouts"] += 1
                    results[item] = Reward(0.0, {"reason": f"timeout after {self.timeout_s:.0f}s", "failed": True})
                    self._restart(w)
        self.stats["scored"] += len(results)
        self.stats["failed"] += sum(bool(r.info.get("failed")) for r in results)
        return results

    def close(self):
        for proc, conn in self.workers:
            conn.close()
            proc.kill()
            proc.join(timeout=5)
        self.workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
