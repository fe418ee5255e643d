"""Process-death handling, written once: a child dies with its parent, and a process group is killed as a whole.

Used by the launcher's workers (common/runtime/launcher.py), the reward pool's verifier workers and RM servers (rewards/),
and the sandbox (rewards/sandbox.py). The one exception is rewards/_sandbox_launch.py, which runs under `python -I`
with the standard library only and so sets PR_SET_PDEATHSIG itself.
"""

from __future__ import annotations

import ctypes
import os
import signal

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
