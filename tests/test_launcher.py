"""The launcher with real processes: a failing worker stops everything, fast, with its traceback, leaving nothing."""

import os
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import os, subprocess, sys, time
    from common.runtime.launcher import WorkerSpec, launch

    def sleeper(ctx, pid_dir):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # a grandchild
        open(os.path.join(pid_dir, f"{ctx.name}.pid"), "w").write(f"{os.getpid()} {child.pid}")
        time.sleep(300)

    def failer(ctx, pid_dir):
        open(os.path.join(pid_dir, f"{ctx.name}.pid"), "w").write(str(os.getpid()))
        time.sleep(2)
        open(os.path.join(pid_dir, "failed_at"), "w").write(repr(time.time()))
        raise ValueError("boom from the failing worker")

    if __name__ == "__main__":
        pid_dir = sys.argv[1]
        launch([WorkerSpec("trainer0", "trainer", "cpu", sleeper, (pid_dir,)),
                WorkerSpec("explorer0", "explorer", "cpu", failer, (pid_dir,))])
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"  # a zombie has exited


def test_failing_worker_stops_run_with_traceback_and_no_leftovers(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    elapsed = time.time() - float((tmp_path / "failed_at").read_text())
    assert proc.returncode != 0
    assert "ValueError: boom from the failing worker" in proc.stderr
    assert "Traceback" in proc.stderr and "failer" in proc.stderr  # the worker's own traceback
    assert proc.stderr.strip().splitlines()[-1].startswith("error: worker explorer0 failed")
    assert elapsed < 10, f"the launcher exited {elapsed:.1f}s after the failure"
    pids = [int(p) for f in ("trainer0.pid", "explorer0.pid") for p in (tmp_path / f).read_text().split()]
    time.sleep(0.5)
    assert len(pids) == 3 and not [p for p in pids if _alive(p)]
