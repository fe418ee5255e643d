"""Process-death handling, written once: a child dies with its parent, a process group is killed as a whole, and
nothing a worker started outlives it.

Used by the launcher's workers (common/runtime/launcher.py), the reward pool's verifier workers and RM servers (rewards/),
and the sandbox (rewards/sandbox.py). The one exception is rewards/_sandbox_launch.py, which runs under `python -I`
with the standard library only and so sets PR_SET_PDEATHSIG itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

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


def kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal the whole process group led by `pid` (a session leader started with setsid / start_new_session);
    a group that is already gone is fine."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# The guard of a worker's process group (see guard_group). Standard library only, started with `python -I -S`: it
# must not import the project or site packages (tens of MB, seconds on a loaded node) to wait and kill.
_GUARD = """# tandem: SIGKILLs this process group when its leader (a worker) ends; common/runtime/procs.py guard_group
import os, signal, sys, time
worker, agent = int(sys.argv[1]), int(sys.argv[2])
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)  # the agent stops the group with SIGTERM: wait for the worker to end instead

def parent_of(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None

while os.getppid() == worker and (not agent or parent_of(worker) == agent):
    time.sleep(0.2)
os.killpg(0, signal.SIGKILL)
"""


def guard_group() -> subprocess.Popen | None:
    """Make everything this process starts, now or later, end within a second of it, however it ends (kill -9
    included) and when its own parent (the torch elastic agent, or `python train_X.py`) dies.

    This process leads its own process group (torch elastic starts each worker in a new session; else it becomes a
    group leader here), and every child it starts stays in that group unless it leaves on purpose: vLLM's engine
    core (which ignores SIGTERM and outlives a killed owner) and the workers it starts, the reward pool, environment
    and tool processes, multiprocessing's resource tracker. The guard is one more member of the group, a small
    standard-library process that waits for this process to end (its parent pid changes) or to lose its own parent,
    then SIGKILLs the whole group, itself last. It knows nothing of what the worker starts, needs no code inside the
    engine (vLLM starts its processes itself, with spawn) and does not depend on which thread started a child, as
    PR_SET_PDEATHSIG does. Processes that start their own session (the sandbox) are not in the group: they die
    with their parent through PR_SET_PDEATHSIG (die_with_parent). Returns the guard, or None where there are no
    process groups."""
    if not hasattr(os, "killpg"):
        return None
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)  # a group of our own: the guard's kill must not reach the process that started us
    agent = os.getppid() if os.path.exists(f"/proc/{os.getpid()}/stat") else 0  # the agent watch needs /proc
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", _GUARD, str(os.getpid()), str(agent)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
