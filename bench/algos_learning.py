"""The learning table of docs/USAGE.md "Algorithms and recipes": grpo (the default), DAPO, GSPO, CISPO and on-policy
distillation on the README's learning budget (default model, arith, seed 0, 40 steps x 32 trained samples, greedy
held-out accuracy every 10 steps), one after another through bench/curves.py (its JSON table and PNG go to
bench/results/, named algos_learning). The teacher of the distillation run is the grpo run's final model (what
`make demo` trains), which is why grpo runs first.
About 15-30 minutes a run on a 2-core CPU; flags after `--` go to every run.

    python bench/algos_learning.py
    python bench/algos_learning.py -- --explorer-devices cuda:0 --trainer-devices cuda:0   # one GPU
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {"grpo": "", "dapo": "--config configs/dapo.yaml", "gspo": "--config configs/gspo.yaml",
        "cispo": "--config configs/cispo.yaml",
        "distill": "--config configs/distill.yaml --teacher bench/out/algos_learning/grpo/final"}


def main():
    shared = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    runs = [arg for label, flags in RUNS.items() for arg in ("--run", f"{label}=train_sync.py {flags}".strip())]
    subprocess.run([sys.executable, "bench/curves.py", "--name", "algos_learning", *runs, "--", "--eval-every", "10",
                    *shared], cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
