import os
import subprocess
import sys
import time
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Small settings so an end-to-end run of the tiny model takes seconds on 2 cores. `--taskset parity` (the built-in
# smoke task, rewards/parity.py) rewards the share of characters with a given code-point parity, so even the random
# tiny model gets mixed rewards: every group has a signal and every step computes a real policy gradient.
# Two epochs per batch: the first epoch's surrogate is ~0 by construction on-policy (group-centred advantages over
# equally long responses cancel), the second is taken after an update, so `loss` != 0 says the loss is computed.
TINY = ["--model", "tiny", "--taskset", "parity", "--tasks-per-step", "4", "--samples-per-task", "2",
        "--max-new-tokens", "12", "--ppo-epochs", "2", "--minibatch-size", "8", "--micro-batch-size", "4",
        "--eval-size", "4", "--eval-every", "0", "--lr", "1e-3",
        # Explicitly HF: the default (--engine auto) starts vLLM where it imports, ~25 s per run on 2 cores; the
        # vLLM tests append --engine vllm (the last flag wins). One torch thread per worker: `make test` runs two
        # tests at a time on 2 cores, and the tiny model gains nothing from more (3 runs at once: 15 % faster).
        # No core binding: with two runs at once, each run's plan would put both trainers on one core and both
        # explorers on the other (tests/test_cores.py binds on purpose).
        "--engine", "hf", "--num-threads", "1", "--no-bind-cores",
        # No timeline.png / reward.png (~0.5 CPU-s of matplotlib a run): the tests of the outputs draw them.
        "--no-plots"]


def run_script(script: str, *args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run an entry script as a user would, in a fresh process."""
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **(env or {})})


def run_in_process(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python script *args` as run_script runs it (cwd the repository, `env` added to the environment, a None
    value unsetting the variable, stdout and stderr read back, the exit code), but by this process: the entry
    script's `main()` as common/run.py's `run_entry` runs it, its workers forked from a forkserver forked from this
    process, which has torch and transformers imported already (a fresh interpreter's imports are ~4 CPU-s of a tiny
    run's ~6). The output is taken at the descriptors, which the forkserver and so the workers inherit. For tests of
    what the run computes; tests of a process's own behaviour (signals, kill -9, its exit, what it reads when it
    starts) use run_script. Bounded by the test's timeout (pytest.ini)."""
    import importlib
    import io
    import signal
    import tempfile

    from common.run import exit_code

    saved = dict(os.environ), os.getcwd(), sys.argv, sys.stdout, sys.stderr, torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    fds = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True)
                                  for fd in (1, 2))
        try:
            for name, value in (env or {}).items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            os.chdir(ROOT)
            sys.argv = [os.path.join(ROOT, script), *args]
            try:
                code = exit_code(importlib.import_module(script.removesuffix(".py")).main)
            except Exception:  # what the interpreter would print, and its exit code
                traceback.print_exc()
                code = 1
        finally:
            for fd, saved_fd in ((1, fds[0]), (2, fds[1])):
                os.dup2(saved_fd, fd)
                os.close(saved_fd)
            os.environ.clear()
            os.environ.update(saved[0])
            os.chdir(saved[1])
            sys.argv, sys.stdout, sys.stderr = saved[2:5]
            torch.set_num_threads(saved[5])
            for number, handler in handlers.items():  # torch elastic's agent installed its own
                signal.signal(number, handler)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([script, *args], code, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


def worker_pid(parent: int, rank: int, timeout: float = 120) -> int:
    """The pid of the run's rank `rank` (trainers first, then explorers) under `parent`: torch elastic starts each
    rank with RANK=<rank> in its environment; under `python train_X.py` on the CPU the ranks are the children of
    the launcher's forkserver instead, a fork of the launcher (rank order is start order: torch elastic starts them
    one after another)."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        for pid in subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if f"\0RANK={rank}\0".encode() in b"\0" + f.read():
                        return int(pid)
            except OSError:
                continue
            if _command(int(pid)) == _command(parent):  # the forkserver (common/runtime/launcher.py)
                try:
                    children = subprocess.run(["pgrep", "-P", pid], capture_output=True, text=True).stdout.split()
                    if any(int(_stat(p)[3]) != int(p) for p in children):
                        continue  # one just forked: a rank leads a session of its own once started (_forked_rank)
                    ranks = sorted(children, key=lambda p: (int(_stat(p)[19]), int(p)))
                except OSError:  # one ended while we looked
                    continue
                if rank < len(ranks):
                    return int(ranks[rank])
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} under {parent}")


def _stat(pid) -> list[str]:
    """/proc/<pid>/stat after the command name: [state, ppid, pgrp, session, ..., starttime at 19, ...]."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _processes() -> dict[int, list[str]]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                table[int(name)] = _stat(name)
            except OSError:  # ended while we looked
                continue
    return table


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def process_tree(root: int) -> dict[int, tuple[str, int, str]]:
    """Every running descendant of `root`: children, grandchildren (a worker's vLLM engine, reward workers), ...:
    pid -> (start time, session id, command line)."""
    table = _processes()
    children: dict[int, list[int]] = {}
    for pid, stat in table.items():
        children.setdefault(int(stat[1]), []).append(pid)
    tree, todo = {}, [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            if table[pid][0] != "Z":
                tree[pid] = (table[pid][19], int(table[pid][3]), _command(pid))
            todo.append(pid)
    return tree


def left_of(tree: dict[int, tuple[str, int, str]], timeout: float = 10) -> dict[int, str]:
    """What still runs, after at most `timeout` seconds, of the processes in `tree` (a process_tree snapshot): those
    processes (same pid and start time) and every process in a session one of them led (the workers: torch elastic
    starts each in a session of its own). A process keeps its session when its parent dies, so a worker's orphans,
    re-parented to init, are found wherever they went."""
    sessions = {pid for pid, (_, session, _) in tree.items() if session == pid}
    deadline = time.time() + timeout
    while True:
        left = {pid: _command(pid) for pid, stat in _processes().items()
                if stat[0] != "Z" and (tree.get(pid, ("",))[0] == stat[19] or int(stat[3]) in sessions)}
        if not left or time.time() > deadline:
            return left
        time.sleep(0.2)


def shm_files(tree: dict) -> set[str]:
    """The files under /dev/shm that the processes of `tree` map (vLLM's message queues, the weight buffers,
    semaphores): memory that stays taken while the files exist."""
    files = set()
    for pid in tree:
        try:
            with open(f"/proc/{pid}/maps") as f:
                files |= {line.split(maxsplit=5)[5].rstrip("\n") for line in f if " /dev/shm/" in line}
        except OSError:
            continue
    # Shared-memory objects are /dev/shm's own entries; files in folders below it are test files (make test's
    # TMPDIR may be /dev/shm) that a process maps, such as a model's safetensors.
    return {f for f in files if not f.endswith(" (deleted)") and os.path.dirname(f) == "/dev/shm"}


def files_left(files: set[str], timeout: float = 5) -> list[str]:
    """Those of `files` that still exist after at most `timeout` seconds."""
    deadline = time.time() + timeout
    while [f for f in files if os.path.exists(f)] and time.time() < deadline:
        time.sleep(0.2)
    return sorted(f for f in files if os.path.exists(f))


def engines(processes: dict) -> list[int]:
    """The vLLM engine cores among `processes` (process_tree's or left_of's)."""
    return [pid for pid, value in processes.items()
            if (value[-1] if isinstance(value, tuple) else value).startswith("VLLM::EngineCore")]


def alive(pid: int) -> bool:
    """Running (a zombie has exited)."""
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False


def wait_running(root: int, out_dir, timeout: float = 240) -> dict[int, tuple[str, int, str]]:
    """Once the run under `root` has logged a step and runs a vLLM engine core: its process_tree."""
    from common.runtime.metrics import read_metrics

    deadline = time.time() + timeout
    while time.time() < deadline:
        tree = process_tree(root)
        if engines(tree) and read_metrics(str(out_dir)):
            return tree
        time.sleep(0.2)
    raise AssertionError(f"no step with a vLLM engine within {timeout:.0f}s; running: {process_tree(root)}")


def kill_all(processes: dict) -> None:
    """SIGKILL what a failed test leaves (left_of's answer), so one failure does not load the next tests."""
    import signal

    for pid in processes:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class MaxTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution at every position: [..., V] -> [...] (the oracle for the chunked pass)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                          enable_gqa=False):
    """`torch.nn.attention.varlen.varlen_attn`'s contract (causal: window_size (-1, 0)), computed by sdpa per
    sequence: it stands in for the flash kernel, which runs on CUDA only, so a CPU test checks the call around it
    (layouts, offsets, and that the offsets sit on the tokens' device)."""
    assert window_size == (-1, 0) and torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
    assert cu_seq_q.device == query.device and cu_seq_q.dtype == torch.int32, (cu_seq_q.device, query.device)
    bounds = cu_seq_q.tolist()
    assert bounds[0] == 0 and bounds[-1] == query.shape[0] and max_q == max(b - a for a, b in zip(bounds, bounds[1:]))
    return torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(t[a:b].transpose(0, 1) for t in (query, key, value)), is_causal=True, scale=scale,
        enable_gqa=query.shape[1] != key.shape[1]).transpose(0, 1) for a, b in zip(bounds, bounds[1:])])


def assert_trained(out_dir, steps: int | None = None, weights_changed: bool = True, skipped=(),
                   model: str = "tiny") -> list[dict]:
    """The end-to-end check that a run learned through its policy-gradient term: the run has no entropy bonus (which
    alone makes loss and gradient non-zero whatever the rewards), and every step's row has non-zero advantages,
    loss != 0 and grad_norm > 0 (steps listed in `skipped` are exempt: e.g. partial rollouts where no group had
    finished), and final/ differs from the initial tiny model. Returns the metrics rows."""
    import json

    import torch

    from common.runtime.metrics import read_metrics

    config = json.load(open(os.path.join(str(out_dir), "config.json")))
    assert config["entropy_coef"] == 0, "an entropy bonus trains without any reward signal: give the run a signal"
    rows = read_metrics(str(out_dir))
    assert rows, f"no metrics in {out_dir}"
    if steps is not None:
        assert [r["step"] for r in rows] == list(range(1, steps + 1)), [r["step"] for r in rows]
    for r in rows:
        if r["step"] in skipped:
            continue
        assert r.get("advantage/abs_mean", 0) > 0, f"step {r['step']} had no advantage to learn from: {r}"
        assert r["loss"] != 0 and r["grad_norm"] > 0, f"step {r['step']} did not train: {r}"
    if weights_changed:
        from common.model import load_model

        final = load_model(os.path.join(str(out_dir), "final"))
        initial = load_model(model, seed=0)  # the run's --model (tiny or tiny-vlm), as it started
        changed = [n for n, p in final.state_dict().items() if not torch.equal(p, initial.state_dict()[n])]
        assert changed, "final/ holds the initial weights: nothing was learned"
    return rows


# The files whose tests take longest (vLLM, torchrun, processes killed and restarted), longest first, by the sum of
# their tests' durations in a full `make test` (pytest --durations): the files not listed take a few seconds each.
SLOW_FILES = ["test_multinode.py", "test_vllm_runs.py", "test_readme.py", "test_faults.py", "test_engine_vllm.py",
              "test_launcher.py", "test_schedules.py", "test_standard_envs.py", "test_reward_hacking.py",
              "test_env_boundary.py", "test_agent_endpoint.py", "test_vlm.py", "test_recipes.py", "test_researcher_day.py",
              "test_fsdp.py", "test_agents.py", "test_workflows_runs.py", "test_weight_sync_methods.py",
              "test_train_sync.py", "test_data_parallel.py", "test_rewards_rm.py", "test_sandbox.py", "test_engine_hf.py",
              "test_rewards_wiring.py", "test_algos.py", "test_bad_inputs.py", "test_fake_device.py", "test_cores.py",
              "test_http_env.py", "test_lora.py"]


def pytest_collection_modifyitems(items):
    """Slowest files first: `make test` hands whole files to its two workers (pytest -n 2 --dist loadfile: a
    module's vLLM engine starts once), and starting with the long ones lets the workers end together."""
    def rank(item):
        name = os.path.basename(str(item.fspath))
        return SLOW_FILES.index(name) if name in SLOW_FILES else len(SLOW_FILES)

    items.sort(key=rank)  # stable: the order within a file is kept


@pytest.fixture(autouse=True)
def _no_torchrun_variables(monkeypatch):
    """Each test starts as a user's `python` does, outside torchrun: the variables torch elastic gives its workers
    (which decide placement and the memory plan's nodes) never reach a test from an earlier test's in-process run."""
    for name in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
