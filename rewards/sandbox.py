"""Run an untrusted Python program with limits: `run(program, stdin="", limits=Limits()) -> Result`.

What protects a run (on Linux; `Result.mode` names each layer the machine allowed, e.g.
"cgroup-v1,namespaces,pivot-root,own-uid,seccomp,no-new-privs"; the explorer logs it as `reward/sandbox_mode`):
- Process: `python -I` (no user site, no PYTHON* variables) started in its own session/process group, with a
  scrubbed environment (nothing of the caller's, so no secrets), a wall-clock timeout enforced here, RLIMIT_CPU,
  RLIMIT_AS (memory), RLIMIT_FSIZE (file size), RLIMIT_NOFILE, RLIMIT_NPROC and no core dumps. The launcher dies
  with the caller (PR_SET_PDEATHSIG), is a child subreaper, and the whole tree is SIGKILLed at the end.
- Whole tree (rewards/_sandbox_tree.py): `cgroup-v2` or `cgroup-v1` where the machine lets us make cgroups (root
  on this kind of machine): memory (no swap), processes and one core of CPU for everything the program starts,
  CPU time summed over the tree; a child OOM-killed in the tree fails the run even if the program goes on.
  `tree-polled` otherwise: RSS and CPU of the launcher's descendants summed every 50 ms (a short burst can pass).
- Every run, before the program's first line: every descriptor but 0/1/2 closed (with a judge, also its two
  pipes to the judge), PR_SET_NO_NEW_PRIVS and a seccomp filter (`seccomp`, x86_64): no sockets of any family,
  no unshare/setns/clone with CLONE_NEW*, no ptrace or process_vm_*, no mount/umount/pivot_root/chroot or the new
  mount API, no io_uring, bpf, perf, keyrings, userfaultfd, modules, kexec, reboot, swap, clock setting or file
  handles; 32-bit and x32 syscalls are refused.
- `namespaces` (as root) or `user-namespace` (unprivileged, where the kernel allows user namespaces): a network
  namespace with no interfaces but a downed loopback, a PID namespace (PID 1 is the sandbox's: when it ends the
  kernel kills everything it started; /proc shows only the sandbox), private IPC and UTS, and a mount namespace
  with a new root (`pivot-root`): only the base Python installation (standard library; not the virtual
  environment), /usr, /lib*, /etc/ld.so.cache, five harmless devices, its own /proc and /sandbox, a fresh
  size-limited tmpfs (also /tmp) that is the working directory and vanishes with the namespace; all else
  read-only. The project, task files, datasets installed in the venv, other runs' folders and host UNIX
  sockets are not in it.
- `own-uid` (as root): the program runs as a uid of its own (never a real user's, no groups), so it cannot read
  or write root's files or signal other processes, and RLIMIT_NPROC counts exactly this sandbox's processes.
  A judge (see `harness` and rewards/code.py) runs as the next uid. In a `user-namespace` run the program is
  root of its namespace with every capability dropped (securebits NOROOT: none come back on exec).
Fallbacks, honestly: in a `user-namespace` run (not root) the program and the judge share the caller's uid (the
judge is non-dumpable, so the program cannot read its memory or descriptors), RLIMIT_NPROC is counted per user
namespace (Linux >= 5.14), and it has the file system view and no network as above. With `no-isolation` (no
namespaces allowed at all, e.g. an unprivileged container) there is no PID namespace (the program can signal
the caller's processes of its uid) and the host file system is there, held back by `landlock-vN` where the
kernel has Landlock (read only the Python installation, /usr, /lib*, the devices; read and write only the working
folder; nothing of /proc, the project or the venv; from ABI 6 no signals out of the domain); without Landlock it
is readable (and writable where the caller may write). Seccomp keeps sockets away either way; as root the program
runs under a uid of its own, or as uid 0 without capabilities where Python lives in a closed home
(`no-uid-drop`). Use `isolate="require"` to refuse to run without namespaces.

Throughput on 2 cores: see bench/rewards_sandbox.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from common.runtime._group_guard import kill_group
from rewards import _sandbox_tree as _tree

HERE = os.path.dirname(os.path.abspath(__file__))
# The launcher is imported (its compiled form cached in rewards/__pycache__), not run as a script (compiled anew
# every time: ~10 ms per run on 2 busy cores).
LAUNCH = [sys.executable, "-I", "-c",
          f"import sys; sys.path.insert(0, {HERE!r}); import _sandbox_launch as launch; launch.main()"]
UID_BASE = 1_500_000_000  # sandbox uids: far above any real account, one per run
IMPORTED = re.compile(r"^(?:from|import)[ \t]+([A-Za-z_]\w*)", re.MULTILINE)  # top-level modules a prompt imports
SIGNAL_REASONS = {signal.SIGXCPU: "cpu time limit", signal.SIGKILL: "killed", signal.SIGXFSZ: "file size limit",
                  signal.SIGSEGV: "segmentation fault"}


@dataclass
class Limits:
    timeout_s: float = 5.0      # wall clock
    cpu_s: float | None = None  # CPU seconds; default: timeout_s + 1
    memory_mb: int = 1024       # address space
    disk_mb: int = 64           # the tmpfs working directory
    file_mb: int = 16           # largest file the program may write
    nproc: int = 32             # processes (and threads)
    nofile: int = 64            # open file descriptors
    output_bytes: int = 1 << 20  # per stream; more is cut off and the run is stopped


@dataclass
class Result:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    duration_s: float = 0.0
    mode: str = ""              # what isolation the machine allowed, see the module docstring
    truncated: bool = False
    limit: str = ""             # the whole-tree limit the run broke, e.g. "memory limit (whole tree)"
    verdict: dict | None = None  # with a harness: what the judge reported (None: no verdict came, a failure)
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.limit

    @property
    def passed(self) -> bool:
        """With a harness: the judge saw every test pass (the exit status plays no part)."""
        return bool(self.verdict and self.verdict["passed"]) and not (self.timed_out or self.limit or self.truncated)

    @property
    def reason(self) -> str:
        if self.timed_out:
            return "timeout"
        if self.limit:
            return self.limit
        if self.truncated:
            return "output limit"
        if self.returncode is None or self.returncode == 0:
            return "ok"
        if self.returncode > 128:
            sig = self.returncode - 128
            return SIGNAL_REASONS.get(sig, f"signal {sig}")
        last = self.stderr.strip().splitlines()[-1:] or [f"exit code {self.returncode}"]
        return last[0][:200]


_counter = 0
_counter_lock = threading.Lock()


def _sandbox_uid() -> int | None:
    """A uid of this run's own (the next one is its judge's) when we are root (pid and a per-process counter keep
    concurrent runs apart)."""
    global _counter
    if os.geteuid() != 0:
        return None
    with _counter_lock:
        _counter += 1
        n = _counter
    return UID_BASE + (os.getpid() % (1 << 22)) * 64 + (n % 32) * 2  # and + 1 for the judge


def _clean_env(workdir: str) -> dict:
    """The only environment the program sees: nothing inherited from the caller."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8", "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1"}


def _alive_pids_of(uid: int) -> list[int]:
    """Processes running as `uid` that are not zombies (a zombie runs nothing; its parent or init reaps it)."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b") ", 1)[1][:1] != b"Z":
                    pids.append(int(pid))
        except (OSError, IndexError):
            continue
    return pids


def kill_uid(uid: int, wait_s: float = 5.0) -> int:
    """SIGKILL every process running as `uid` (a sandbox uid: nothing else runs as it) and wait until they are
    gone (SIGKILL takes effect asynchronously; a fork bomb's children keep appearing for a moment)."""
    killed, deadline = 0, time.monotonic() + wait_s
    while time.monotonic() < deadline:
        pids = _alive_pids_of(uid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                continue
        time.sleep(0.01)
    return killed


def _read_all(proc, deadline: float, limit: int, watch) -> tuple[bytes, bytes, bool, bool, str | None]:
    """Read stdout and stderr until both close, the deadline passes or `watch()` names a broken whole-tree limit.
    -> (out, err, timed_out, truncated, broken limit or None)."""
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    for pipe in bufs:
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe, selectors.EVENT_READ)
    timed_out = truncated = False
    exited_at = broke = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            broke = watch()
            if broke:
                break
            if exited_at is None and _exited_unreaped(proc.pid, 0.0):  # not proc.poll(): it would reap
                exited_at = now
            if exited_at is not None and now - exited_at > 0.5:
                break  # the launcher is gone; a straggler holding the pipe open is killed below
            for key, _ in sel.select(timeout=min(deadline - now, 0.05)):
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.fileobj]
                buf += chunk[: max(0, limit - len(buf))]
                if len(buf) >= limit:
                    truncated = True
            if truncated:
                break
    finally:
        sel.close()
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), timed_out, truncated, broke


WORKDIR_PREFIX = "tandem-sbx-"
_swept = False


def _process_alive(pid: int) -> bool:
    """Exists and is not a zombie (a killed worker may wait a while to be reaped by init)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b") ", 1)[1][:1] != b"Z"
    except (OSError, IndexError):
        return False


def sweep_stale_workdirs(root: str | None = None) -> int:
    """Remove working folders left by sandbox callers that died mid-run (killed workers never reach their
    cleanup). Folder names carry the creating pid; only folders of pids that no longer exist are removed."""
    root = root or tempfile.gettempdir()
    removed = 0
    for name in os.listdir(root):
        if not name.startswith(WORKDIR_PREFIX):
            continue
        pid = name[len(WORKDIR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed += 1
    return removed


def remove_workdirs_of(pid: int, root: str | None = None) -> int:
    """Remove the working folders of sandbox runs started by process `pid`, which must be dead (the reward pool
    calls this right after it killed a worker mid-run, instead of waiting for the next run's sweep)."""
    root = root or tempfile.gettempdir()
    prefix = f"{WORKDIR_PREFIX}{pid}-"
    names = [n for n in os.listdir(root) if n.startswith(prefix)]
    for name in names:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return len(names)


def _compile_launcher():
    """Write the launcher's and the harness's .pyc (the launcher runs with PYTHONDONTWRITEBYTECODE). A read-only
    checkout just compiles them on every run."""
    import importlib.util
    import py_compile

    for name in ("_sandbox_launch.py", "_sandbox_harness.py"):
        source = os.path.join(HERE, name)
        try:
            py_compile.compile(source, importlib.util.cache_from_source(source), doraise=True)
        except (OSError, py_compile.PyCompileError):
            continue


def _tree_limits(name: str, limits: Limits, cpu_s: float) -> _tree.TreeLimits:
    try:
        return _tree.TreeLimits.create(name, limits.memory_mb, limits.nproc, cpu_s)
    except OSError:  # cgroups exist but refuse this one: poll instead (the mode says so)
        return _tree.TreeLimits("tree-polled", [], limits.memory_mb, limits.nproc, cpu_s)


def _read_verdict(fd: int, nonce: str) -> dict | None:
    """The judge's verdict, only if it carries this run's nonce."""
    os.set_blocking(fd, False)
    data = b""
    while len(data) < 1 << 16:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    try:
        verdict = json.loads(data)
    except ValueError:
        return None
    if type(verdict) is not dict or verdict.get("nonce") != nonce or type(verdict.get("passed")) is not bool:
        return None
    return verdict


def run(program: str, stdin: str = "", limits: Limits | None = None, isolate: bool | str = True,
        harness: dict | None = None) -> Result:
    """Run `program` (Python source) with `stdin`; see the module docstring for what it may and may not do.
    `isolate`: True (namespaces when the machine allows them), "require" (refuse to run without), False.
    `harness`: {"prompt", "test", "entry_point"} of a HumanEval-style task: the program is only the candidate's
    definitions; a judge process runs the test against it and `Result.verdict` holds what the judge saw (see
    rewards/code.py)."""
    global _swept
    if not _swept:  # once per process: leftovers of callers killed mid-run; the launcher's compiled form
        _swept = True
        sweep_stale_workdirs()
        _tree.sweep()
        _compile_launcher()
    limits = limits or Limits()
    uid = _sandbox_uid()
    workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-")
    start = time.monotonic()
    cpu_s = math.ceil(limits.cpu_s or limits.timeout_s + 1)
    ours = {}  # descriptors to close at the end
    ours["mode_r"], ours["mode_w"] = os.pipe()
    proc = tree = nonce = None
    try:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(program)
        stdin_path = os.path.join(workdir, "stdin.txt")
        with open(stdin_path, "w") as f:
            f.write(stdin)
        if uid is not None:  # only matters without namespaces: there the program runs in this very folder
            os.chown(workdir, uid, uid)
        tree = _tree_limits(os.path.basename(workdir)[len(WORKDIR_PREFIX):], limits, cpu_s)
        cfg = {"parent": os.getpid(), "workdir": workdir, "uid": uid,
               "judge_uid": None if uid is None else uid + 1, "mode_fd": ours["mode_w"],
               "isolate": "require" if isolate == "require" else "yes" if isolate else "no",
               "cpu_s": cpu_s, "memory_mb": limits.memory_mb, "disk_mb": limits.disk_mb, "file_mb": limits.file_mb,
               "nproc": limits.nproc, "nofile": limits.nofile, "tree": tree.kind,
               "cgroups": tree.launcher_arg() or None}
        if harness is not None:
            nonce = secrets.token_hex(16)
            ours["spec"] = os.memfd_create("spec", 0)  # no path: only the judge, which inherits it, can read it
            spec = {"nonce": nonce, **{k: harness[k] for k in ("prompt", "test", "entry_point")}}
            os.write(ours["spec"], json.dumps(spec).encode())
            os.lseek(ours["spec"], 0, os.SEEK_SET)
            ours["result_r"], ours["result_w"] = os.pipe()
            cfg.update(spec_fd=ours["spec"], result_fd=ours["result_w"], entry_point=harness["entry_point"],
                       warm=",".join(sorted(set(IMPORTED.findall(harness["prompt"])))) or None)
        with open(stdin_path) as stdin_file:
            proc = subprocess.Popen(
                [*LAUNCH, *(f"{k}={v}" for k, v in cfg.items())], stdin=stdin_file,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_clean_env(workdir), cwd=workdir,
                start_new_session=True, pass_fds=[ours[k] for k in ("mode_w", "spec", "result_w") if k in ours])
        for key in ("mode_w", "spec", "result_w"):  # the launcher has them now
            if key in ours:
                os.close(ours.pop(key))
        tree.root_pid = proc.pid
        out, err, timed_out, truncated, broke = _read_all(proc, start + limits.timeout_s, limits.output_bytes,
                                                          tree.violation)
        broke = broke or tree.violation()  # e.g. a child OOM-killed while the program itself went on
        tree.kill()  # the program and everything it started, whatever session or process group it moved to
        if uid is not None:
            kill_uid(uid)
            kill_uid(uid + 1)
        if not _exited_unreaped(proc.pid, 2.0):
            _kill_group(proc)
        # Stragglers left in the group (only possible without a PID namespace). The launcher is not reaped yet,
        # so its pid, the group id, cannot have been reused by an unrelated process group.
        _kill_group(proc)
        returncode = proc.wait(timeout=5)
        os.set_blocking(ours["mode_r"], False)
        try:
            mode = os.read(ours["mode_r"], 4096).decode()
        except BlockingIOError:
            mode = ""
        verdict = _read_verdict(ours["result_r"], nonce) if "result_r" in ours else None
        return Result(None if timed_out else returncode, out.decode(errors="replace"), err.decode(errors="replace"),
                      timed_out, time.monotonic() - start, mode, truncated, limit=broke or "", verdict=verdict)
    finally:
        if proc is not None and proc.poll() is None:
            _kill_group(proc)
            proc.wait(timeout=5)
        if tree is not None:
            tree.kill()
            for busy in tree.close():
                print(f"sandbox: cgroup {busy} still busy after the run; swept once this process has exited",
                      file=sys.stderr)
        if uid is not None:
            kill_uid(uid)  # anything that escaped the process group (setsid) without a PID namespace
            kill_uid(uid + 1)
        for fd in ours.values():
            os.close(fd)
        for pipe in (proc.stdout, proc.stderr) if proc is not None else ():
            pipe.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _exited_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for the child to exit, leaving it unreaped (a zombie keeps its pid reserved)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)


def _kill_group(proc):
    kill_group(proc.pid)  # the session leader's pid is the group id
