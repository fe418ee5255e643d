"""`RewardPool`: verifiers in child processes, each item under a wall-clock limit, while the caller keeps generating.

A verifier that hangs, crashes, raises or grows past its memory limit gives score 0 with the reason, is counted, and
never stalls or kills the caller. What a verifier is and which kinds exist: rewards/base.py.

Each worker is a process tree of its own (rewards/_sandbox_tree.py): a cgroup with a memory limit (no swap) where
the machine lets us make cgroups, so the kernel stops a worker at the limit however fast it allocates; otherwise
the dispatcher sums the RSS of the worker and its children every 50 ms while it scores (a burst between two polls
can pass). Sandbox runs a worker starts live inside its tree. When a worker is replaced (timeout, crash, memory),
its whole tree is SIGKILLed at once (a worker is the child subreaper of its runs' processes and reaps them, so
none is left even as a zombie), and its sandbox runs' working folders and cgroups are removed, all before the
item's score is delivered.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import types
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for_any
from multiprocessing.reduction import ForkingPickler

from common.runtime.procs import die_with_parent
from rewards import _sandbox_tree as _tree
from rewards.base import Reward, check_kind, failed, score
from rewards.sandbox import remove_workdirs_of

MAX_CHUNK = 16  # items sent to a worker at once (each still has its own deadline)
JUDGE_TIMEOUT_S = 120.0  # per item for tasks with a judge_model (model loading happens inside the first item)
POLL_S = 0.05  # memory of a busy worker, where no cgroup enforces it
GRACE_S = 0.5  # a worker whose sandbox run was killed under it: time to reap the run's processes and answer
PR_SET_CHILD_SUBREAPER = 36
WORKER_NPROC = 4096  # processes and threads of one worker's tree (a sandbox run has its own, lower limit)


def _safe_score(score_fn, response: str, task: dict) -> Reward:
    try:
        result = score_fn(response, task)
    except Exception as e:  # noqa: BLE001  (a verifier bug must not take the run down: score 0, say why)
        return failed(f"error: {type(e).__name__}: {e}", traceback=traceback.format_exc(limit=3))
    if not isinstance(result, Reward):
        return failed(f"error: verifier returned {type(result).__name__}, not Reward")
    return result


@contextlib.contextmanager
def _main_hidden(score_fn):
    """A spawn child runs the parent's `__main__` script again (for an entry script: torch, transformers, ~1.5 s of
    CPU per worker) so that it can unpickle what was defined there. A worker needs only `_serve` and `score_fn`:
    unless score_fn itself lives in `__main__`, the child is started as if `__main__` were an empty module."""
    if getattr(score_fn, "__module__", None) in ("__main__", "__mp_main__"):
        yield
        return
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = saved


def _reap_adopted():
    """Reap the worker's exited children: a verifier waits for its own children, so what is left are orphans of a
    sandbox run killed from outside, which this worker adopted as a child subreaper (else they would wait for
    the machine's init, which may take a second)."""
    while True:
        try:
            if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG) is None:
                return
        except ChildProcessError:
            return


def _serve(conn, score_fn, parent_pid: int):
    """Verifier worker: warm the imports, say ready, then score (response, task) pairs until the pipe closes."""
    die_with_parent(parent_pid)
    with contextlib.suppress(OSError, AttributeError):  # Linux: orphans of our sandbox runs come to us
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the owner's business; it closes the pool
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" notice: the pool enforces it
    try:
        import rewards.math  # noqa: F401  (first-call latency out of the timed path)
    except ImportError:
        pass
    conn.send("ready")
    while True:
        try:
            chunk = conn.recv()  # a list of (response, task); one result goes back per item, in order
        except (EOFError, OSError):
            return
        for response, task in chunk:
            reward = _safe_score(score_fn, response, task)
            _reap_adopted()
            conn.send(reward)


def _kill_tree(tree):
    """SIGKILL every process of a worker's tree in one pass (polled: its descendants, read while the worker still
    holds them together); with cgroups, again until they are empty (a fork racing the kill)."""
    for pid in tree.pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if tree.dirs:
        tree.kill()


class RewardFuture:
    """The result of `RewardPool.submit`: `result(timeout)` -> list[Reward] in the order submitted."""

    def __init__(self, n: int):
        self._future: Future = Future()
        self.results: list[Reward | None] = [None] * n
        self.remaining = n
        self.submitted_at = time.time()
        self.done_at: float | None = None  # when the last item was scored
        if n == 0:
            self.done_at = self.submitted_at
            self._future.set_result([])

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> list[Reward]:
        """Wait (at most `timeout` seconds when given). Every item has its own deadline in the pool, so an
        untimed wait still ends; it raises if the pool was closed or its dispatcher died meanwhile."""
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"rewards not ready after {timeout}s") from None

    def _set(self, i: int, reward: Reward):
        if self.results[i] is None:
            self.results[i] = reward
            self.remaining -= 1
            if self.remaining == 0 and not self._future.done():
                self.done_at = time.time()
                self._future.set_result(list(self.results))


@dataclass
class _Worker:
    proc: object
    conn: object
    ready: bool = False
    items: deque = field(default_factory=deque)  # in flight, in order: (future, index, response, task, limit_s)
    deadline: float = 0.0  # for the item at the head of `items` (the one the worker is running)
    started: float = field(default_factory=time.time)
    tree: object = None  # _tree.TreeLimits: the worker and everything it starts


class RewardPool:
    """Verifiers in `num_workers` child processes (spawn, non-daemon), each item under a wall-clock limit.

    - `timeout_s`: per item (a task may ask for more with `task["reward_timeout_s"]`, e.g. long code tests;
      tasks with a `judge_model` get at least JUDGE_TIMEOUT_S since the first one loads the judge).
    - `memory_mb`: per worker, everything it starts included (a sandbox run's own limit counts inside it); an item
      that takes the worker over it scores 0 ("memory limit ...") and the worker is replaced. It also bounds a
      `--reward-fn` function and a judge model loaded in the worker.
    - `score_fn`: a module-level function (default `rewards.score`): how a custom verifier is plugged in.
    - `rm_model`, `rm_device`, `rm_batch_size`: the learned reward model for `reward: rm` tasks (a task may
      name its own with `task["rm_model"]`). It is served by one process per model on its own device
      (`rewards.rm.RMServer`), batched, started on first use.
    - `judge_model`: the K-12 / vision judge (`--judge-model`) for tasks that do not name their own; it runs
      inside the verifier workers (loaded once per worker, on CPU unless the task says `judge_device`).
    - `judge_url`, `judge_model`, `judge_api_key_env`, `judge_device`, `judge_timeout_s`, `judge_concurrency`: the
      judge of `reward: judge` / `judge_group` tasks (rewards/judge.py `JudgeClient`): the server at judge_url
      (model judge_model, key from the environment variable judge_api_key_env), or else judge_model served by
      tandem on judge_device (rewards/judge_server.py, started on first use; on transformers, or on what
      `judge_loader(model, device, judge_max_model_len)` loads: the explorer's vLLM, common/explorer/judge_vllm.py).
      Calls run on threads, each under judge_timeout_s, at most judge_concurrency at once (1 for the served judge:
      it answers one at a time).
      `submit(..., groups)` says which items form a group: a judge_group task's group is judged in one call.
    - `stats`: scored / failed / timeouts / crashes / errors, cumulative.

    Scoring runs on a dispatcher thread, so `submit` returns at once and generation goes on meanwhile.
    Safe to create inside any non-daemon process, such as an explorer rank (a process torch elastic started).
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, score_fn=score, rm_model: str | None = None,
                 rm_device: str = "cpu", rm_batch_size: int = 16, rm_timeout_s: float = 120.0,
                 judge_model: str | None = None, memory_mb: int = 4096, judge_url: str | None = None,
                 judge_api_key_env: str = "JUDGE_API_KEY", judge_device: str = "cpu", judge_timeout_s: float = 60.0,
                 judge_concurrency: int = 8, judge_loader=None, judge_max_model_len: int = 0):
        import multiprocessing as mp

        self.ctx = mp.get_context("spawn")
        self.num_workers, self.timeout_s, self.score_fn = max(1, num_workers), timeout_s, score_fn
        self.routes_kinds = getattr(score_fn, "routes_kinds", True)  # False: score_fn scores every task itself
        self.rm_model, self.rm_device, self.rm_batch_size, self.rm_timeout_s = (
            rm_model, rm_device, rm_batch_size, rm_timeout_s)
        self.judge_model, self.memory_mb = judge_model, memory_mb
        self.judge_url, self.judge_api_key_env, self.judge_device = judge_url, judge_api_key_env, judge_device
        self.judge_timeout_s, self.judge_concurrency = judge_timeout_s, judge_concurrency
        self.judge_loader, self.judge_max_model_len = judge_loader, judge_max_model_len
        self._judge = None  # rewards.judge.JudgeClient, made for the first judge task
        self._judge_seen = dict.fromkeys(("items", "calls", "cache_hits", "failed", "timeouts", "busy_s"), 0)
        self._wake_lock = threading.Lock()  # judge-call threads wake the dispatcher too
        self.stats = {"scored": 0, "failed": 0, "timeouts": 0, "crashes": 0, "errors": 0, "memory": 0}
        self._jobs: queue.Queue = queue.Queue()
        self._wake_r, self._wake_w = self.ctx.Pipe(duplex=False)
        self._closing = threading.Event()
        self._procs: set = set()  # every child alive, for the exit-time finalizer
        self._trees: dict = {}  # worker pid -> its TreeLimits, for the exit-time finalizer
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._rm: dict[str, object] = {}  # model path -> RMClient
        self._error: BaseException | None = None
        # Kill the children at interpreter exit even if close() was never called; multiprocessing runs this before
        # it joins non-daemon children, so exit never waits on a busy verifier.
        from multiprocessing import util
        self._finalizer = util.Finalize(self, RewardPool._kill_all, args=(self._procs, self._lock, self._trees),
                                        exitpriority=100)
        self._thread = threading.Thread(target=self._dispatch, name="reward-dispatcher", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- public API
    def submit(self, responses: list[str], tasks: list[dict], groups: list | None = None) -> RewardFuture:
        """Queue a batch for scoring and return at once. Unknown reward kinds fail here (a config error).
        `groups`: one key per item, equal for the items of one sample group (default: every item its own)."""
        if len(responses) != len(tasks) or (groups is not None and len(groups) != len(tasks)):
            raise ValueError(f"{len(responses)} responses for {len(tasks)} tasks"
                             f"{'' if groups is None else f' and {len(groups)} group keys'}")
        for task in tasks if self.routes_kinds else ():
            check_kind(task)
        if self._closing.is_set():
            raise RuntimeError("RewardPool is closed")
        future = RewardFuture(len(responses))
        if responses:
            self._jobs.put((future, list(responses), list(tasks), list(groups or range(len(tasks)))))
            self._wake()
        return future

    def score_batch(self, responses: list[str], tasks: list[dict], groups: list | None = None) -> list[Reward]:
        return self.submit(responses, tasks, groups).result()

    def close(self):
        """Stop the dispatcher, kill every child, fail pending futures. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._wake()
        self._thread.join(timeout=30)
        RewardPool._kill_all(self._procs, self._lock, self._trees)
        for conn in (self._wake_r, self._wake_w):
            conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110  (interpreter teardown: the finalizer killed the children)
            pass

    # ---------------------------------------------------------------- processes
    @staticmethod
    def _kill_all(procs: set, lock: threading.Lock, trees: dict):
        with lock:
            victims, doomed = list(procs), list(trees.values())
            procs.clear()
            trees.clear()
        for tree in doomed:
            _kill_tree(tree)
        for proc in victims:
            if proc.is_alive():
                proc.kill()
        for proc in victims:
            proc.join(timeout=5)
        for tree in doomed:
            tree.close()
            remove_workdirs_of(tree.root_pid)

    def _wake(self):
        with self._wake_lock:
            try:
                self._wake_w.send_bytes(b"")
            except OSError:  # closed: the dispatcher is gone anyway
                pass

    def _start_worker(self) -> _Worker:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_serve, args=(child, self.score_fn, os.getpid()),
                                name="reward-worker", daemon=False)
        with _main_hidden(self.score_fn):
            proc.start()
        child.close()
        tree = self._worker_tree(proc.pid)
        with self._lock:
            self._procs.add(proc)
            self._trees[proc.pid] = tree
        return _Worker(proc, parent, tree=tree)

    def _worker_tree(self, pid: int):
        """The worker's own cgroups (it joins them while it still imports, before it scores anything), or a
        polled tree rooted at it."""
        try:
            tree = _tree.TreeLimits.create(f"{os.getpid()}-{pid}", self.memory_mb, WORKER_NPROC, math.inf,
                                           prefix=_tree.POOL_PREFIX)
            tree.join(pid)
        except OSError:  # no cgroups here, or they refuse this one
            if "tree" in locals():
                tree.close()
            tree = _tree.TreeLimits("tree-polled", [], self.memory_mb, WORKER_NPROC, math.inf)
            tree.root_pid = pid
        return tree

    def _stop(self, w: _Worker):
        """Kill the worker and everything it started at once (a sandbox run's processes included), then remove
        its cgroups and its sandbox runs' working folders. When it was inside a sandbox run, the run's processes
        go first, and the worker gets GRACE_S to see its run end, clean up after it and answer: it reaps the run's
        processes (as their subreaper) so that none is left even as a zombie."""
        run = [pid for pid in w.tree.pids() if pid != w.proc.pid]
        if run and w.proc.is_alive():
            for pid in run:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError, EOFError):
                w.conn.poll(GRACE_S)
        _kill_tree(w.tree)
        w.proc.kill()
        w.proc.join(timeout=5)
        for busy in w.tree.close():
            logging.getLogger(__name__).warning("reward worker cgroup %s still busy; swept later", busy)
        remove_workdirs_of(w.proc.pid)
        with self._lock:
            self._procs.discard(w.proc)
            self._trees.pop(w.proc.pid, None)
        w.conn.close()

    def _rm_client(self, model: str):
        if model not in self._rm:
            from rewards.rm import RMClient
            self._rm[model] = RMClient(self.ctx, model, self.rm_device, self.rm_batch_size, self.rm_timeout_s,
                                       on_start=self._track, on_stop=self._untrack)
        return self._rm[model]

    def _track(self, proc):
        with self._lock:
            self._procs.add(proc)

    def _untrack(self, proc):
        with self._lock:
            self._procs.discard(proc)

    def _judge_client(self):
        if self._judge is None:
            from rewards.judge import Endpoint, JudgeClient

            if self.judge_url:
                endpoint = Endpoint(self.judge_url, self.judge_model or "", os.environ.get(self.judge_api_key_env, ""))
                self._judge = JudgeClient(endpoint, self.judge_timeout_s, self.judge_concurrency, self._wake)
            else:
                from rewards.judge_server import JudgeServer

                server = JudgeServer(self.ctx, self.judge_model, self.judge_device, on_start=self._track,
                                     on_stop=self._untrack, loader=self.judge_loader,
                                     max_model_len=self.judge_max_model_len)
                self._judge = JudgeClient(None, self.judge_timeout_s, 1, self._wake, server=server)
        return self._judge

    def judge_metrics(self) -> dict:
        """The judge since the last call (reward/judge_*): calls made, calls per second of judging (wall time with
        a call running), the share of items a cache hit or a call in flight answered, failed and timed-out calls.
        {} until a judge task was seen."""
        if self._judge is None:
            return {}
        stats = {**self._judge.stats, "busy_s": self._judge.busy_s()}
        delta = {k: stats[k] - seen for k, seen in self._judge_seen.items()}
        self._judge_seen = {k: stats[k] for k in delta}
        return {"reward/judge_calls": delta["calls"], "reward/judge_failed": delta["failed"],
                "reward/judge_timeouts": delta["timeouts"],
                "reward/judge_calls_per_s": delta["calls"] / delta["busy_s"] if delta["busy_s"] > 0 else 0.0,
                "reward/judge_cache_hit_rate": delta["cache_hits"] / delta["items"] if delta["items"] else 0.0}

    # ---------------------------------------------------------------- dispatcher thread
    def _finish(self, future: RewardFuture, i: int, reward: Reward):
        self.stats["scored"] += 1
        if reward.info.get("failed"):
            self.stats["failed"] += 1
            if str(reward.info.get("reason", "")).startswith("error"):
                self.stats["errors"] += 1
        future._set(i, reward)

    def _item_timeout(self, task: dict) -> float:
        if "reward_timeout_s" in task:
            return float(task["reward_timeout_s"])
        if task.get("judge_model"):  # a worker's first judge call loads the LM (seconds); later calls are fast
            return max(self.timeout_s, JUDGE_TIMEOUT_S)
        return self.timeout_s

    def _dispatch(self):
        pending: deque = deque()  # (future, index, response, task)
        try:
            self._workers = [self._start_worker() for _ in range(self.num_workers)]
            while not self._closing.is_set():
                while True:  # new jobs: rm items go to their model's server, the rest to the verifier workers
                    try:
                        future, responses, tasks, groups = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    judged: dict = {}  # (group key, one or group) -> (task, [(index, response)])
                    for i, (response, task) in enumerate(zip(responses, tasks)):
                        if self.routes_kinds and task.get("reward") in ("judge", "judge_group"):
                            if not (self.judge_url or self.judge_model):
                                self._finish(future, i, failed(f"error: task {task.get('id')}: no judge given "
                                                               "(--judge-url, or --judge-model to serve one)"))
                                continue
                            group = task["reward"] == "judge_group"
                            judged.setdefault((groups[i] if group else i, group), (task, []))[1].append((i, response))
                        elif self.routes_kinds and task.get("reward") == "rm":
                            model = task.get("rm_model") or self.rm_model
                            if not model:
                                self._finish(future, i, failed(f"error: task {task.get('id')}: no rm_model given"))
                            else:
                                self._rm_client(model).add(future, i, response, task, self._finish)
                        else:
                            if self.judge_model and not self.judge_url and task.get("reward") in ("k12", "vision") and \
                                    "judge_model" not in task:
                                task = {**task, "judge_model": self.judge_model}
                            pending.append((future, i, response, task))
                    for (_, group), (task, items) in judged.items():
                        self._judge_client().add(future, items, task, group, self._finish)
                self._step(pending)
        except BaseException as e:  # the dispatcher itself broke: fail every waiter loudly rather than hang them
            self._error = e
            logging.getLogger(__name__).exception("reward dispatcher died")
        finally:
            self._shutdown(pending)

    def _step(self, pending: deque):
        while pending:  # hand out work in chunks: one round trip per chunk, not per item (cheap verifiers)
            w = next((w for w in self._workers if w.ready and not w.items), None)
            if w is None:
                break
            size = max(1, min(MAX_CHUNK, len(pending) // (2 * len(self._workers))))
            chunk = [pending.popleft() for _ in range(min(size, len(pending)))]
            w.items.extend((f, i, r, t, self._item_timeout(t)) for f, i, r, t in chunk)
            w.deadline = time.time() + w.items[0][4]
            try:
                w.conn.send([(r, t) for _, _, r, t in chunk])
            except OSError:  # the worker is gone: the chunk never started, so it goes back to the queue
                pending.extendleft(reversed(chunk))
                w.items.clear()
                self._replace(w)
            except (TypeError, AttributeError, pickle.PicklingError):  # pickling fails before anything is sent
                w.items.clear()
                for item in reversed(chunk):  # fail only the items that cannot be pickled, requeue the others
                    try:
                        ForkingPickler.dumps(item[2:])
                        pending.appendleft(item)
                    except (TypeError, AttributeError, pickle.PicklingError) as e:
                        self._finish(item[0], item[1], failed(f"error: task cannot be sent to a verifier: {e}"))
        if self._judge is not None:  # start queued judge calls now, before the wait
            self._judge.poll(self._finish)
        waits = [w.deadline for w in self._workers if w.items] + [c.deadline for c in self._rm.values() if c.busy]
        if self._judge is not None and self._judge.deadline() is not None:
            waits.append(self._judge.deadline())
        waits += [w.started + 120 for w in self._workers if not w.ready]  # a worker that never starts
        if any(w.items and w.tree.kind == "tree-polled" for w in self._workers):
            waits.append(time.time() + POLL_S)
        timeout = max(0.0, min(waits) - time.time()) if waits else None
        conns = {w.conn: w for w in self._workers}
        rm_conns = {c.conn: c for c in self._rm.values() if c.conn is not None}
        ready = wait_for_any([self._wake_r, *conns, *rm_conns], timeout=timeout)
        for conn in ready:
            if conn is self._wake_r:
                while self._wake_r.poll():
                    self._wake_r.recv_bytes()
            elif conn in conns:
                self._receive(conns[conn], pending)
            else:
                rm_conns[conn].receive(self._finish)
        now = time.time()
        for w in self._workers:
            if w.items and w.tree.kind == "tree-polled" and w.tree.violation():
                self._memory_failure(w, pending)
            elif w.items and now >= w.deadline:
                self.stats["timeouts"] += 1
                self._fail_worker(w, failed(f"timeout after {w.items[0][4]:g}s"), pending)
            elif not w.ready and now >= w.started + 120:
                self._replace(w)
        for client in self._rm.values():
            client.poll(self._finish)
        if self._judge is not None:
            self._judge.poll(self._finish)

    def _receive(self, w: _Worker, pending: deque):
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):  # the worker died mid-item (segfault, os._exit, OOM kill)
            code = w.proc.exitcode
            w.proc.join(timeout=1)
            code = w.proc.exitcode if code is None else code
            if w.tree.violation():  # the kernel stopped it at its cgroup's memory limit
                self._memory_failure(w, pending)
                return
            self.stats["crashes"] += 1
            self._fail_worker(w, failed(f"verifier crashed (exit code {code})"), pending)
            return
        if msg == "ready":
            w.ready = True
        elif w.items:
            future, i, *_ = w.items.popleft()
            self._finish(future, i, msg)
            if w.items:  # the worker moves straight on to the next item of its chunk
                w.deadline = time.time() + w.items[0][4]

    def _memory_failure(self, w: _Worker, pending: deque):
        self.stats["memory"] += 1
        self._fail_worker(w, failed(f"memory limit: the verifier's process tree went over {self.memory_mb} MB "
                                    f"({w.tree.kind}); worker replaced"), pending)

    def _fail_worker(self, w: _Worker, reward: Reward, pending: deque):
        """Give the item the worker was running `reward`, put the rest of its chunk back at the front of the
        queue (they never started), and replace the worker (it may be stuck or dead)."""
        head = w.items.popleft() if w.items else None
        for f, i, r, t, _ in reversed(w.items):
            pending.appendleft((f, i, r, t))
        w.items.clear()
        self._replace(w)  # first: when the verdict arrives, the worker's processes and files are gone
        if head is not None:
            self._finish(head[0], head[1], reward)

    def _replace(self, w: _Worker):
        self._stop(w)
        fresh = self._start_worker()
        w.proc, w.conn, w.ready, w.items, w.started, w.tree = (fresh.proc, fresh.conn, False, deque(), fresh.started,
                                                                fresh.tree)

    def _shutdown(self, pending: deque):
        for w in self._workers:
            self._stop(w)
        for client in self._rm.values():
            client.close()
        if self._judge is not None:
            self._judge.close()
        reason = RuntimeError("RewardPool closed" if self._error is None else f"reward dispatcher died: {self._error}")
        futures = {id(f): f for f, *_ in pending}
        futures.update({id(item[0]): item[0] for w in self._workers for item in w.items})
        while True:
            try:
                future, *_ = self._jobs.get_nowait()
            except queue.Empty:
                break
            futures[id(future)] = future
        for client in [*self._rm.values(), *([self._judge] if self._judge is not None else [])]:
            futures.update({id(f): f for f in client.futures()})
        for future in futures.values():
            if not future.done():
                future._future.set_exception(reason)
        self._closing.set()

