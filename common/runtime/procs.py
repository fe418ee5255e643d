"""Process-death handling, written once: a child dies with its parent, and nothing a worker started outlives it
(its group's guard: common/runtime/_group_guard.py, whose `kill_group` kills a process group as a whole for
everyone: the guard, an episode's --agent-cmd program, the sandbox).

Used by the launcher's workers (common/runtime/worker.py), the reward pool's verifier workers and RM servers
(rewards/). The one exception is rewards/_sandbox_launch.py, which runs under `python -I` with the standard library
only and so sets PR_SET_PDEATHSIG itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

from common.runtime._group_guard import shared_files

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when the thread that started it dies (Linux), so a killed owner
    leaves no orphans behind. With `parent_pid`: if that parent is already gone, exit now (it died before prctl)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the owner's close()/finalizer is the only cleanup
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def guard_group() -> subprocess.Popen | None:
    """Make everything this process starts, now or later, end within a second of it, however it ends (kill -9
    included) and when its own parent (the torch elastic agent, or `python train_X.py`) dies; the shared-memory
    files they had mapped are removed then too.

    This process leads its own process group (torch elastic starts each worker in a new session; else it becomes a
    group leader here), and every child it starts stays in that group unless it leaves on purpose: vLLM's engine
    core (which ignores SIGTERM and outlives a killed owner) and the workers it starts, the reward pool, environment
    and tool processes, multiprocessing's resource tracker. The guard is one more member of the group, a small
    standard-library process (common/runtime/_group_guard.py) that waits for this process to end (its parent pid
    changes) or to lose its own parent, then SIGKILLs the whole group. It knows nothing of what the worker starts,
    needs no code inside the engine (vLLM starts its processes itself, with spawn) and does not depend on which
    thread started a child, as PR_SET_PDEATHSIG does. Processes that start their own session (the sandbox) are not
    in the group: they die with their parent through PR_SET_PDEATHSIG (die_with_parent). Returns the guard, or None
    where there are no process groups."""
    if not hasattr(os, "killpg"):
        return None
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)  # a group of our own: the guard's kill must not reach the process that started us
    agent = os.getppid() if os.path.exists(f"/proc/{os.getpid()}/stat") else 0  # the agent watch needs /proc
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_group_guard.py")
    inherited = sorted(shared_files(os.getpid())) if agent else []  # the starter's, not the group's: kept
    return subprocess.Popen([sys.executable, "-I", "-S", script, str(os.getpid()), str(agent), *inherited],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
