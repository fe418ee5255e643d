"""Sandbox launcher: `python -I _sandbox_launch.py key=value ...`, started by rewards.sandbox.run (stdlib only;
it imports as little as it can, since its start-up time is paid on every execution).

It runs with the caller's privileges but a scrubbed environment, in its own session, and does, before any
untrusted code runs:
  1. die with the caller (PR_SET_PDEATHSIG);
  2. new mount, network, PID, IPC and UTS namespaces (as root directly, otherwise through a user namespace);
  3. a size-limited tmpfs as the working directory (holding only main.py), every other mount read-only, homes that
     others cannot enter replaced by an empty tmpfs (with just the Python installation bound back in);
  4. fork: the child is PID 1 of the new PID namespace (when it exits, the kernel kills everything it started),
     mounts a fresh /proc (only the sandbox's own processes are visible), sets the rlimits, drops to an
     unprivileged uid of its own when started as root, and runs main.py as __main__.
The parent waits and exits with the child's code (128 + signal number when it was killed by a signal).
Each step that the machine does not allow is skipped and named in the mode file, so the caller can report
honestly what protected the run (see rewards/sandbox.py for the fallbacks).
"""

import ctypes
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
KEEP_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
              "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
PR_SET_PDEATHSIG, SIGKILL = 1, 9

libc = ctypes.CDLL(None, use_errno=True)


def check(ret: int, what: str):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None):
    enc = (lambda s: None if s is None else s.encode())
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def unescape(path: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mounts():
    """(mount point, per-mount flags) of every mount, parents before children."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            flags = sum(KEEP_FLAGS.get(o, 0) for o in fields[5].split(","))
            out.append((unescape(fields[4]), flags, "ro" in fields[5].split(",")))
    return out


def hidden_ancestors(paths):
    """For each directory Python needs, the topmost ancestor that others cannot enter (e.g. /root with mode 700):
    after the uid drop that ancestor would lock Python out of its own standard library."""
    needs = {}
    real = sorted({os.path.realpath(p) for p in paths})
    # Binding a folder over one bound earlier would hide the first mount: keep only the outermost folders.
    paths = [p for p in real if not any(p != q and p.startswith(q + "/") for q in real)]
    for path in paths:
        parts = os.path.realpath(path).split("/")[1:]
        for k in range(1, len(parts) + 1):
            anc = "/" + "/".join(parts[:k])
            if not os.stat(anc).st_mode & 0o001:
                needs.setdefault(anc, set()).add(os.path.realpath(path))
                break
    return needs


def isolate(cfg, mode):
    """Namespaces + filesystem view. Appends what worked to `mode`."""
    base = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if libc.unshare(base) == 0:
        mode.append("namespaces")
    else:
        uid, gid = os.getuid(), os.getgid()
        check(libc.unshare(base | CLONE_NEWUSER), "unshare (user namespace)")
        # No uid of our own here (the uid drop is skipped). Since Linux 5.14 RLIMIT_NPROC is counted per user
        # namespace, so the limit still counts only the sandbox's processes; older kernels count all of the
        # caller's processes, where the limit errs on the strict side.
        cfg["uid"] = None
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        mode.append("user-namespace")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount here propagates back to the host

    # The Python installation must stay readable after the uid drop even if it lives in a closed home.
    python_dirs = {sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix,
                   os.path.dirname(os.path.realpath(sys.executable))}
    keep_fds = {}
    hidden = hidden_ancestors(python_dirs) if cfg["uid"] is not None else {}
    for anc, needed in hidden.items():
        for path in needed:
            keep_fds[path] = os.open(path, os.O_PATH | os.O_DIRECTORY)
    for anc, needed in hidden.items():
        mount("tmpfs", anc, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
        for path in needed:
            os.makedirs(path, mode=0o755, exist_ok=True)
            mount(f"/proc/self/fd/{keep_fds[path]}", path, None, MS_BIND | MS_REC)
    workdir = cfg["workdir"]
    owner = f",uid={cfg['uid']},gid={cfg['uid']}" if cfg["uid"] is not None else ""
    mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk_mb']}m,mode=700{owner}")

    # Everything but the working directory becomes read-only (a bind remount keeps the per-mount flags that a
    # user namespace locks). A mount we cannot make read-only is fatal unless it is a pseudo file system.
    for point, flags, _ in mounts():
        if point == workdir or point.startswith("/proc/") or point == "/proc":
            continue
        if libc.mount(None, point.encode(), None, ctypes.c_ulong(MS_REMOUNT | MS_BIND | MS_RDONLY | flags), None):
            err = ctypes.get_errno()
            if point.startswith(("/sys", "/dev/pts")) or not os.path.exists(point):
                continue
            raise OSError(err, f"cannot make {point} read-only: {os.strerror(err)}")
    mode.append("read-only-fs")


def set_limits(cfg):
    def limit(res, value):
        resource.setrlimit(res, (value, value))

    cpu = int(cfg["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL a second later
    limit(resource.RLIMIT_AS, cfg["memory_mb"] << 20)
    limit(resource.RLIMIT_FSIZE, cfg["file_mb"] << 20)
    limit(resource.RLIMIT_NOFILE, cfg["nofile"])
    limit(resource.RLIMIT_CORE, 0)
    if cfg["nproc"]:
        limit(resource.RLIMIT_NPROC, cfg["nproc"])


def child(cfg, mode):
    """PID 1 of the sandbox: fresh /proc, limits, uid drop, then the untrusted program."""
    if "namespaces" in mode or "user-namespace" in mode:
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(cfg["workdir"])
    with open("main.py", "w") as f:
        f.write(cfg["program"])
    if cfg["uid"] is not None:
        os.chown("main.py", cfg["uid"], cfg["uid"])
    set_limits(cfg)
    if cfg["uid"] is not None:  # root: become a uid of our own (RLIMIT_NPROC then counts only this sandbox)
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    # Die with the launcher (and so with the caller). Set only now: a credential change clears it.
    check(libc.prctl(PR_SET_PDEATHSIG, SIGKILL), "prctl")
    import select
    if select.select([cfg["alive_fd"]], [], [], 0)[0]:  # EOF: the launcher died before prctl took effect
        os._exit(1)
    os.close(cfg["alive_fd"])
    program = compile(cfg.pop("program"), "main.py", "exec")
    sys.argv = ["main.py"]
    sys.path.insert(0, os.getcwd())
    # Exceptions and SystemExit propagate: the interpreter prints the traceback and sets the exit code as usual.
    exec(program, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})  # noqa: S102


def parse_args(argv):
    """key=value pairs; ints where they look like ints, 'None' for None (json would cost ~10 ms of imports)."""
    cfg = {}
    for arg in argv:
        key, _, value = arg.partition("=")
        cfg[key] = None if value == "None" else int(value) if value.lstrip("-").isdigit() else value
    return cfg


def main():
    cfg = parse_args(sys.argv[1:])
    check(libc.prctl(PR_SET_PDEATHSIG, SIGKILL), "prctl")
    if os.getppid() != cfg["parent"]:
        os._exit(1)
    with open(os.path.join(cfg["workdir"], "main.py")) as f:
        cfg["program"] = f.read()
    mode = []
    if cfg["isolate"] != "no":  # "yes" or "require"
        try:
            isolate(cfg, mode)
        except OSError as e:
            if cfg["isolate"] == "require":
                print(f"sandbox: isolation failed: {e}", file=sys.stderr)
                os._exit(125)
            mode.append(f"no-isolation ({e})")
    if cfg["uid"] is not None and "read-only-fs" not in mode and hidden_ancestors([sys.base_prefix, sys.prefix]):
        cfg["uid"] = None  # no namespace to bind Python back in: it would be unreadable after the uid drop
        mode.append("no-uid-drop")
    if cfg["uid"] is not None:
        mode.append("own-uid")
    os.write(cfg["mode_fd"], ",".join(mode).encode())
    os.close(cfg["mode_fd"])
    sys.stdout.flush()
    alive_r, alive_w = os.pipe()  # the child sees EOF on alive_r once this launcher is gone
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        cfg["alive_fd"] = alive_r
        child(cfg, mode)
        sys.exit(0)
    os.close(alive_r)
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    main()
