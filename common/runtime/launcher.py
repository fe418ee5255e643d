"""One process per rank, started by torch elastic: `torchrun ... train_X.py` on one or several nodes, or
`python train_X.py`, which starts the same script once per rank through torch's elastic launcher API on this node
(`launch_local`; when every rank is on the CPU, forked from a forkserver that the launcher forks from itself once it
has imported the heavy modules: `start_forkserver`). What each rank does once started (its world, its watch, its
end) is common/runtime/worker.py.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import multiprocessing
import os
import runpy
import signal
import socket
import sys
import traceback
import uuid
from multiprocessing import connection, forkserver, resource_tracker

import torch

from common.compat import python
from common.runtime.worker import join_world, plan_world, run_worker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every worker imports (~3 CPU-s on a fresh interpreter): the launcher imports it once, then forks the server.
FORKSERVER_PRELOAD = ["torch", "transformers.modeling_utils", "common.trainer.trainer", "common.explorer.explorer"]
_forkserver_env: dict[str, str] | None = None  # this process's environment when the forkserver started


def start_forkserver(devices: list[str]) -> bool:
    """`python train_X.py` with every rank on the CPU of a machine without CUDA: import FORKSERVER_PRELOAD here, then
    fork a multiprocessing forkserver from this process; torch elastic's workers are forked from it (launch_local)
    instead of each importing the same modules again, and the server imports nothing (a spawned one would import
    torch a second time: ~1.4 CPU-s a run). Call it before this process starts a thread or runs the pre-flight
    checks (tokenizers, progress bars and vLLM's import may start threads, which a fork must not copy). A placement
    with a GPU, or a machine with CUDA, keeps fresh interpreters: CUDA must never be initialised before a fork, and
    importing transformers may call torch.cuda.is_available(), which initialises the driver. Returns whether it
    started (never on a Python whose private state common/compat/python.py was not checked on)."""
    global _forkserver_env
    if any(d != "cpu" for d in devices) or torch.cuda.is_available() or not python.forking_works():
        return False
    stop_forkserver()  # one an earlier launch in this process left (tests launch in theirs) holds that launch's
    # descriptors and state: this launch forks its own
    for name in FORKSERVER_PRELOAD:
        importlib.import_module(name)
    resource_tracker.ensure_running()  # the server and its workers inherit this process's tracker, as a spawned
    # server is passed it
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the server ends once every holder of alive_w has: this process, its workers
        sys.stdout.flush()  # nothing buffered here may be written again by a worker
        sys.stderr.flush()
        # SIGTERM blocked in the server (and, until they unblock it, in the workers): a SIGTERM to this process
        # group (`timeout`, Slurm) must not end the server first, which would end the workers before the trainers
        # checkpoint. Blocked, not ignored: a SIGTERM to this process meanwhile is delivered once unblocked.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        pid = os.fork()
        if pid == 0:  # the server: serves until its last client has ended, then exits without tearing down the
            code = 1  # torch and transformers imported above (seconds of CPU, with the run's output held open)
            try:
                os.close(alive_w)
                forkserver.main(listener.fileno(), alive_r, [])
            except SystemExit:  # every client has ended
                code = 0
            except BaseException:  # the server's own failure: said here, then it ends (its workers see it)
                traceback.print_exc()
            finally:
                os._exit(code)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        os.close(alive_r)
    python.adopt_forkserver(address, alive_w, pid)
    _forkserver_env = dict(os.environ)
    return True


def stop_forkserver() -> None:
    """End the forkserver at once, if this process started one: left to itself it waits for every process that
    holds its alive pipe (a worker's own children may), holding the run's stdout open. Its workers are processes of
    their own and have ended or been stopped by then. A later launch in this process forks a new one."""
    global _forkserver_env
    pid = python.forkserver_pid()
    if _forkserver_env is None or pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    python.forget_forkserver()
    _forkserver_env = None


def _forked_rank(command: list[str], env: dict[str, str], unset: list[str]) -> None:
    """One worker, forked from the forkserver (torch elastic's function entrypoint): the launcher's environment as
    it is now (torch elastic has set the rank's own variables), then `python -u *command` as a fresh interpreter
    would run it (an entry script, or run_function's `-m common.runtime.launcher`), so the worker's code path is the
    same."""
    os.setsid()  # as torch elastic starts binary workers: a session of their own (Ctrl-C reaches the launcher only)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    # Streams over the inherited descriptors, written through as a `python -u` worker's are (the server's may be
    # buffered, or a test's capture of this process's output).
    sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=like.encoding,
                                               errors=like.errors, write_through=True)
                              for fd, like in ((1, sys.__stdout__), (2, sys.__stderr__)))
    multiprocessing.set_start_method(None, force=True)  # the platform's default, not the launcher's forkserver
    # A resource tracker of its own, as a fresh interpreter's; none of the launcher's exit handlers and finalizers
    # (wandb's media folder, registered for removal when it is imported). The worker runs those it registers itself
    # at its exit (below), as a fresh interpreter would.
    python.forget_inherited_state()
    for name in unset:
        os.environ.pop(name, None)
    os.environ.update(env)
    try:
        if command[:2] == ["-m", __name__]:  # what `python -m common.runtime.launcher` runs (the end of this file)
            run_worker(_function_rank, *command[2:])
        else:
            sys.argv = list(command)
            runpy.run_path(command[0], run_name="__main__")
    finally:
        python.run_exit_handlers()  # as the script's interpreter would at exit (a multiprocessing child never does)


def launch_local(command: list[str], names: list[str], shutdown_s: float = 10.0) -> None:
    """`python train_X.py ...`: run `python command` once per worker in `names` on this node, through torch's
    elastic launcher API (what torchrun runs), so one code path serves one node and many. The first failure stops
    every rank; it is raised as one line naming the worker (its traceback, if any, is above it on stderr). After
    start_forkserver, a script's workers are forked from the forkserver instead (same script, same world)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its own report: see below
    # torch 2.11 has no shutdown_timeout (its agent gives failed-run workers 30 s before SIGKILL)
    newer = {"shutdown_timeout": int(shutdown_s)} if "shutdown_timeout" in LaunchConfig.__dataclass_fields__ else {}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=len(names), run_id=uuid.uuid4().hex[:12],
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0,
                          monitor_interval=0.1, start_method="spawn", **newer)
    os.environ["TANDEM_LOCAL"] = "1"  # workers leave one-line errors to this process
    try:
        if _forkserver_env is not None and (command[0] != "-m" or command[1] == __name__):
            config.start_method = "forkserver"
            env = {k: v for k, v in os.environ.items() if _forkserver_env.get(k) != v}
            unset = [k for k in _forkserver_env if k not in os.environ]
            elastic_launch(config, _forked_rank)(command, env, unset)
        else:
            elastic_launch(config, sys.executable)("-u", *command)
    except ChildFailedError as e:
        raise SystemExit(_root_cause(e, names)) from None
    finally:
        os.environ.pop("TANDEM_LOCAL", None)


def _root_cause(e, names: list[str]) -> str:
    """The failure that started it: a rank killed by a signal (its peers then fail on closed connections), else
    the earliest reported one."""
    def info(failure) -> dict:
        message = failure.error_file_data.get("message")
        return message.get("extraInfo", {}) if isinstance(message, dict) else {}

    def order(item):
        rank, failure = item
        return failure.exitcode >= 0, not info(failure), info(failure).get("time", failure.timestamp), rank

    rank, failure = min(e.failures.items(), key=order)
    name = names[rank] if rank < len(names) else f"rank{rank}"
    if failure.exitcode < 0:
        return f"error: worker {name} was killed by signal {-failure.exitcode} (no traceback: killed, out of " \
               "memory or crashed in native code)"
    if not info(failure):
        return f"error: worker {name} exited with code {failure.exitcode} and reported nothing"
    message = failure.error_file_data["message"]["message"]
    if message.startswith("error: "):
        return message
    print(f"[tandem] worker {name} failed; all workers stopped.\n{info(failure)['py_callstack']}", file=sys.stderr,
          flush=True)
    return f"error: worker {name} failed: {message.splitlines()[0] if message else 'no message'}"


def run_function(target: str, trainers: int, explorers: int, *args: str, timeout_s: float = 120) -> None:
    """Run `module:function(ctx, *args)` on every rank of a CPU world of `trainers` + `explorers` ranks (tests and
    benchmarks that drive the workers' parts directly)."""
    names = [w.name for w in plan_world(["cpu"] * trainers, ["cpu"] * explorers)]
    start_forkserver(["cpu"] * len(names))  # the ranks forked from this process's imports, where it can
    # Ranks that are fresh interpreters import the target as this process does: the folder it is found in (a test's
    # or a benchmark's) and the repository go first on their PYTHONPATH.
    module = target.split(":")[0]
    folder = os.path.dirname(importlib.util.find_spec(module).origin)
    for _ in module.split(".")[1:]:
        folder = os.path.dirname(folder)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([folder, ROOT, *([saved] if saved else [])])
    try:
        launch_local(["-m", "common.runtime.launcher", target, str(trainers), str(explorers), str(timeout_s),
                      *args], names)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved


def _function_rank(target: str, trainers: str, explorers: str, timeout_s: str, *args: str) -> None:
    module, function = target.split(":")
    torch.set_num_threads(1)  # every rank on the same cores, as the tests that use this run them
    ctx = join_world(plan_world(["cpu"] * int(trainers), ["cpu"] * int(explorers)), float(timeout_s), 15.0)
    getattr(importlib.import_module(module), function)(ctx, *args)
    ctx.close(float(timeout_s))


if __name__ == "__main__":
    from common.runtime import launcher  # the module the workers' code imports (not a second copy as __main__)

    run_worker(launcher._function_rank, *sys.argv[1:])
