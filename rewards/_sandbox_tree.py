"""Whole-tree limits of one sandbox run: memory, processes and CPU time of every process the program starts.

`TreeLimits.create(name, memory_mb, nproc, cpu_s)` makes them as the machine allows:
- "cgroup-v2": a cgroup under ours in the unified hierarchy (memory.max with no swap, pids.max, cpu.max of one
  core), where our cgroup delegates the memory, pids and cpu controllers to its children (this path is written
  to the kernel's documented interface but was not exercised on the development machine, a v1/hybrid host);
- "cgroup-v1": one cgroup per controller (memory + memsw, pids, cpuacct for CPU time), where the v1 hierarchies
  are writable (root on a v1 or hybrid machine). No cpu quota: moving a process into each v1 hierarchy costs an
  RCU grace period (milliseconds on a loaded machine), and CPU time is limited through cpuacct anyway;
- "tree-polled": neither: the caller polls the summed RSS and CPU time of the launcher's descendants (the
  launcher is a child subreaper, so orphans stay below it) every 50 ms and kills the tree over a limit. A burst
  between two polls can exceed it; RLIMIT_AS and RLIMIT_NPROC still bound each process and the uid.
`violation()` says which limit the tree broke (or None); `kill()` SIGKILLs every process in it; `close()` removes
the cgroups. Names carry the creating pid, so `sweep()` removes those of callers that died mid-run.
The reward pool puts each verifier worker in a tree of its own the same way (`join`); the sandbox runs a worker
starts then nest inside it, and `kill`/`close` take the nested cgroups with them.
"""

from __future__ import annotations

import os
import signal
import time

ROOT = "/sys/fs/cgroup"
PREFIX = "tandem-sbx-"
POOL_PREFIX = "tandem-pool-"  # a reward worker's tree (a sandbox run's stays tandem-sbx-)
CPU_PERIOD_US = 100_000
_kind: str | None = None


def _own_paths() -> dict[str, str]:
    """controller ('' for the unified hierarchy) -> our cgroup's path inside it."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _write(path: str, value: str):
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _v2_base() -> str | None:
    own = _own_paths()
    if "" not in own or not os.path.exists(os.path.join(ROOT, "cgroup.controllers")):
        return None
    base = ROOT + own[""].rstrip("/")
    try:
        enabled = set(_read(os.path.join(base, "cgroup.subtree_control")).split())
        if not {"memory", "pids", "cpu"} <= enabled:
            _write(os.path.join(base, "cgroup.subtree_control"), "+memory +pids +cpu")  # EBUSY if we live in it
        return base if os.access(base, os.W_OK) else None
    except OSError:
        return None


def _v1_bases() -> dict[str, str] | None:
    own = _own_paths()
    bases = {}
    for c in ("memory", "pids", "cpuacct"):
        base = f"{ROOT}/{c}{own.get(c, '/').rstrip('/')}"
        if c not in own or not os.access(base, os.W_OK):
            return None
        bases[c] = base
    return bases


def kind() -> str:
    """What this machine allows (checked once per process): cgroup-v2, cgroup-v1 or tree-polled."""
    global _kind
    if _kind is None:
        _kind = "cgroup-v2" if _v2_base() else "cgroup-v1" if _v1_bases() else "tree-polled"
    return _kind


class TreeLimits:
    def __init__(self, kind_: str, dirs: list[str], memory_mb: int, nproc: int, cpu_s: float):
        self.kind, self.dirs = kind_, dirs
        self.memory_b, self.nproc, self.cpu_s = memory_mb << 20, nproc, cpu_s
        self.root_pid: int | None = None  # tree-polled: the launcher
        self._next_poll = 0.0

    @classmethod
    def create(cls, name: str, memory_mb: int, nproc: int, cpu_s: float, prefix: str = PREFIX) -> "TreeLimits":
        k = kind()
        dirs = []
        try:
            if k == "cgroup-v2":
                d = os.path.join(_v2_base(), prefix + name)
                os.mkdir(d)
                dirs.append(d)
                _write(f"{d}/memory.max", str(memory_mb << 20))
                if os.path.exists(f"{d}/memory.swap.max"):
                    _write(f"{d}/memory.swap.max", "0")
                _write(f"{d}/pids.max", str(nproc))
                _write(f"{d}/cpu.max", f"{CPU_PERIOD_US} {CPU_PERIOD_US}")
            elif k == "cgroup-v1":
                for c, base in _v1_bases().items():
                    d = os.path.join(base, prefix + name)
                    os.mkdir(d)
                    dirs.append(d)
                mem, pids, _ = dirs
                _write(f"{mem}/memory.limit_in_bytes", str(memory_mb << 20))
                if os.path.exists(f"{mem}/memory.memsw.limit_in_bytes"):
                    _write(f"{mem}/memory.memsw.limit_in_bytes", str(memory_mb << 20))
                _write(f"{pids}/pids.max", str(nproc))
        except OSError:
            for d in dirs:
                os.rmdir(d)
            raise
        return cls(k, dirs, memory_mb, nproc, cpu_s)

    def launcher_arg(self) -> str:
        """The cgroups the launcher joins before it forks (':'-separated; empty when polled)."""
        return ":".join(self.dirs)

    def _cpu_s(self) -> float:
        if self.kind == "cgroup-v2":
            stat = dict(line.split() for line in _read(f"{self.dirs[0]}/cpu.stat").splitlines())
            return int(stat["usage_usec"]) / 1e6
        return int(_read(f"{self.dirs[2]}/cpuacct.usage")) / 1e9

    def _oom_kills(self) -> int:
        path = f"{self.dirs[0]}/memory.events" if self.kind == "cgroup-v2" else f"{self.dirs[0]}/memory.oom_control"
        for line in _read(path).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def violation(self) -> str | None:
        """'memory limit (whole tree)' or 'cpu time limit (whole tree)' once the tree broke one, else None."""
        if self.kind == "tree-polled":
            now = time.monotonic()
            if self.root_pid is None or now < self._next_poll:
                return None
            self._next_poll = now + 0.05
            rss, cpu = _tree_usage(self.root_pid)
            if rss > self.memory_b:
                return "memory limit (whole tree)"
            return "cpu time limit (whole tree)" if cpu > self.cpu_s else None
        if self._oom_kills():
            return "memory limit (whole tree)"
        return "cpu time limit (whole tree)" if self._cpu_s() > self.cpu_s else None

    def join(self, pid: int):
        """Move a running process (all its threads) into the tree's cgroups; polled: make it the tree's root."""
        self.root_pid = pid
        for d in self.dirs:
            _write(f"{d}/cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        """Every process of the tree, including those of cgroups nested in ours (a sandbox run of a worker)."""
        if self.kind == "tree-polled":
            return _descendants(self.root_pid) if self.root_pid else []
        out = []
        for d in self.dirs[:2] if self.kind == "cgroup-v1" else self.dirs:
            for folder, _, _ in os.walk(d):
                try:
                    out += [int(p) for p in _read(f"{folder}/cgroup.procs").split()]
                except OSError:  # removed meanwhile
                    continue
        return sorted(set(out))

    def kill(self, wait_s: float = 5.0):
        """SIGKILL every process of the tree until none is left (a fork bomb keeps adding some for a moment)."""
        if self.kind == "cgroup-v2" and os.path.exists(f"{self.dirs[0]}/cgroup.kill"):
            _write(f"{self.dirs[0]}/cgroup.kill", "1")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
            time.sleep(0.005)

    def close(self, wait_s: float = 5.0) -> list[str]:
        """Remove the cgroups (after `kill`; a dying process leaves its cgroup a moment later). -> those still
        busy after `wait_s` (left for `sweep` once this process is gone; never seen in the tests)."""
        deadline, left = time.monotonic() + wait_s, []
        nested = [f for d in self.dirs for f, _, _ in os.walk(d, topdown=False) if f != d]
        for d in nested + self.dirs:
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: still has members
                    if time.monotonic() > deadline:
                        left.append(d)
                        break
                    time.sleep(0.005)
        self.dirs = []
        return left


def sweep() -> int:
    """Remove cgroups of callers that died mid-run (the creating pid is in the name)."""
    if kind() == "tree-polled":
        return 0
    bases = [_v2_base()] if kind() == "cgroup-v2" else list(_v1_bases().values())
    removed = 0
    for base in bases:
        for name in os.listdir(base):
            prefix = next((p for p in (PREFIX, POOL_PREFIX) if name.startswith(p)), "")
            pid = name[len(prefix):].split("-", 1)[0] if prefix else ""
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                try:
                    for folder, _, _ in os.walk(f"{base}/{name}", topdown=False):  # nested ones first
                        for member in _read(f"{folder}/cgroup.procs").split():
                            os.kill(int(member), signal.SIGKILL)
                        os.rmdir(folder)
                    removed += 1
                except OSError:
                    continue
    return removed


def proc_stats() -> dict[int, list[bytes]]:
    """pid -> the fields of /proc/<pid>/stat after the command name (state, ppid, ...) of every live process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                table[int(entry)] = f.read().rsplit(b") ", 1)[1].split()
        except (OSError, IndexError):
            continue
    return table


def _proc_table() -> dict[int, tuple[int, int, float]]:
    """pid -> (ppid, rss bytes, cpu seconds) of every live process."""
    tick, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    return {pid: (int(f[1]), int(f[21]) * page, (int(f[11]) + int(f[12])) / tick) for pid, f in proc_stats().items()}


def _descendants(root: int, table=None) -> list[int]:
    table = table or _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            out.append(pid)
        todo += children.get(pid, [])
    return out


def _tree_usage(root: int) -> tuple[int, float]:
    table = _proc_table()
    pids = _descendants(root, table)
    return sum(table[p][1] for p in pids), sum(table[p][2] for p in pids)
