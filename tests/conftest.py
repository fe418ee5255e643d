import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Small settings so an end-to-end run of the tiny model takes seconds on 2 cores.
TINY = ["--model", "tiny", "--tasks-per-step", "4", "--samples-per-task", "2", "--max-new-tokens", "12",
        "--minibatch-size", "8", "--micro-batch-size", "4", "--eval-size", "4", "--eval-every", "0", "--lr", "1e-3",
        # A random tiny model earns reward 0 everywhere; an entropy bonus makes every step change the weights.
        "--entropy-coef", "0.01", "--no-drop-zero-signal-groups",
        # Explicitly HF: the default (--engine auto) starts vLLM where it imports, ~25 s per run on 2 cores; the
        # vLLM tests append --engine vllm (the last flag wins).
        "--engine", "hf"]


def run_script(script: str, *args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run an entry script as a user would, in a fresh process."""
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **(env or {})})


@pytest.fixture
def run():
    return run_script
