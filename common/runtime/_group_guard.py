"""The guard of a worker's process group: SIGKILLs the group when its leader ends, then removes the shared-memory
files the group had mapped (common/runtime/procs.py guard_group starts it).

Run as `python -I -S _group_guard.py WORKER AGENT [FILE ...]` by the worker, in the worker's process group: standard
library only, nothing of the project or of site-packages imported (a guard must start fast and small on a loaded
node). The FILEs are the /dev/shm files the worker already mapped when it started the guard: not the group's but
its starter's (a worker forked by the launcher's forkserver maps torch elastic's queues), so they are left alone.
It waits until WORKER has ended (this process's parent changes: kill -9 included) or WORKER has lost its parent
AGENT (the torch elastic agent, or `python train_X.py`, killed), then:
- leaves the group, stops every process in it (SIGSTOP: none forks or maps anything more), reads which objects in
  /dev/shm they map or hold open (vLLM's message queues, the weight buffers, multiprocessing semaphores; the
  worker's own, read every second while it lived), SIGKILLs the group and removes those files. A killed process cannot remove its own, and the group's resource tracker dies
  with it, so these would otherwise hold memory until the node reboots. Other processes that mapped such a file
  keep their mapping; the workers of the run's other groups end with this one's (a dead rank ends the attempt).
"""

import os
import signal
import sys
import time

SHM = "/dev/shm"


def stat(pid) -> list[str]:
    """The fields of /proc/PID/stat after the command (state, ppid, pgrp, ...); [] where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):  # ended meanwhile
        return []


def parent_of(pid: int) -> int | None:
    fields = stat(pid)
    return int(fields[1]) if fields else None


def members(group: int) -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit() and (fields := stat(name))
            and int(fields[2]) == group]


def shared_files(pid: int) -> set[str]:
    """The shared-memory objects `pid` maps or holds open (not those already removed): /dev/shm's own entries.
    Files in folders below it are a run's or a user's (an --out-dir there: a timeline file open for one append)."""
    found = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                path = fields[5].rstrip("\n") if len(fields) == 6 else ""
                if os.path.dirname(path) == SHM and not path.endswith(" (deleted)"):
                    found.add(path)
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                path = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if os.path.dirname(path) == SHM and not path.endswith(" (deleted)"):
                found.add(path)
    except OSError:  # ended, or not ours to read
        pass
    return found


def kill_group(group: int, sig: int = signal.SIGKILL) -> None:
    """Signal the whole process group `group` (led by that pid: a session leader started with setsid /
    start_new_session, or a worker); a group that is already gone is fine."""
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):  # every member has ended already / not ours
        pass


def main(worker: int, agent: int, inherited: set[str]) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the agent stops the group with SIGTERM: wait for the worker to end
    group, proc = os.getpgid(0), os.path.isdir("/proc")
    worker_files, checked = set(), 0.0
    while os.getppid() == worker and (not agent or parent_of(worker) == agent):
        if proc and time.monotonic() - checked > 1.0:  # a dead worker's own mappings can no longer be read
            worker_files, checked = shared_files(worker), time.monotonic()
        time.sleep(0.2)
    if not proc:
        kill_group(group)
        return
    os.setpgid(0, 0)  # out of the group: the kill below must not end this process before it cleans up
    kill_group(group, signal.SIGSTOP)
    files = worker_files
    for pid in members(group):
        files |= shared_files(pid)
    kill_group(group)
    for path in files - inherited:
        try:
            os.unlink(path)
        except OSError:  # removed meanwhile, or not ours
            pass


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), set(sys.argv[3:]))
