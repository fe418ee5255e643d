import os
import subprocess
import sys

import pytest

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
        "--engine", "hf", "--num-threads", "1"]


def run_script(script: str, *args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run an entry script as a user would, in a fresh process."""
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **(env or {})})


def worker_pid(parent: int, rank: int, timeout: float = 120) -> int:
    """The pid of the run's rank `rank` (trainers first, then explorers) among `parent`'s children: torch elastic
    starts each rank with RANK=<rank> in its environment."""
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
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} under {parent}")


def descendants(pid: int) -> list[int]:
    children = [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
    return children + [d for c in children for d in descendants(c)]


def alive(pid: int) -> bool:
    """Running (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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


@pytest.fixture
def run():
    return run_script


# The files whose tests take longest (each starts vLLM or several training runs), longest first.
SLOW_FILES = ["test_readme.py", "test_vllm_runs.py", "test_engine_vllm.py", "test_faults.py", "test_data_parallel.py",
              "test_train_sync.py", "test_schedules.py", "test_workflows_runs.py", "test_algos.py", "test_agents.py",
              "test_vlm.py"]


def pytest_collection_modifyitems(items):
    """Slowest files first: `make test` hands whole files to its two workers (pytest -n 2 --dist loadfile: a
    module's vLLM engine starts once), and starting with the long ones lets both workers end together."""
    def rank(item):
        name = os.path.basename(str(item.fspath))
        return SLOW_FILES.index(name) if name in SLOW_FILES else len(SLOW_FILES)

    items.sort(key=rank)  # stable: the order within a file is kept
