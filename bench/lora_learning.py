"""The LoRA learning table of docs/BENCHMARKS.md: full fine-tuning against LoRA rank 1, 8 and 32, each in fp32 and
bf16, on `make demo`'s budget (default model, arith, seed 0, 40 steps x 32 trained samples, greedy held-out accuracy
every 10 steps), one after another through bench/curves.py (its JSON table and PNG go to bench/results/, named
lora_learning). LoRA runs take the recipe `--lora-rank R` alone gives (common/lora.py: every linear layer, alpha 32,
10x the learning rate), the adapters sent in fp32 too (where `auto` merges on a CPU); one more bf16 rank-8 run sends
merged weights (`--lora-sync merged`), the failure mode the adapter sync removes. Does bf16 LoRA learn as fp32 LoRA does?
About 15-30 minutes a run on a 2-core CPU (9 runs); flags after `--` go to every run.

    python bench/lora_learning.py
    python bench/lora_learning.py --only lora-r8 -- --explorer-devices cuda:0 --trainer-devices cuda:0   # one GPU
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {f"{name}, {dtype}": f"{flags} --dtype {dtype}".strip()
        for name, flags in (("full", ""), ("lora-r8", "--lora-rank 8 --lora-sync adapters"),
                            ("lora-r1", "--lora-rank 1 --lora-sync adapters"),
                            ("lora-r32", "--lora-rank 32 --lora-sync adapters"))
        for dtype in ("float32", "bfloat16")}
RUNS["lora-r8 merged sync, bfloat16"] = "--lora-rank 8 --dtype bfloat16 --lora-sync merged"


def main():
    shared = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    own = sys.argv[1:sys.argv.index("--")] if "--" in sys.argv else sys.argv[1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, help="run only the runs whose label contains one of these")
    parser.add_argument("--name", default="lora_learning", help="bench/results/<name>.png and .json")
    parser.add_argument("--reuse", action="store_true", help="keep runs already finished in bench/out/<name>/")
    opts = parser.parse_args(own)
    chosen = {label: flags for label, flags in RUNS.items()
              if opts.only is None or any(o in label for o in opts.only)}
    runs = [arg for label, flags in chosen.items()
            for arg in ("--run", f"{label}=train_sync.py --config configs/sync_default.yaml {flags}")]
    subprocess.run([sys.executable, "bench/curves.py", "--name", opts.name, *(["--reuse"] if opts.reuse else []),
                    *runs, "--", "--eval-every", "10",
                    *shared], cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
