"""CPU-machine tuning behind one switch: what pays on a small CPU machine and does nothing on a GPU, on where every
worker of the run computes on the CPU (--cpu-tuning, the default; --no-cpu-tuning to compare):
- forkserver: `python train_X.py` forks its workers from a server that imported torch and transformers once
  (common/runtime/launcher.py `start_forkserver`) instead of each importing them again;
- fast exit: the launcher ends with os._exit once the exit handlers ran, without tearing down torch's and
  transformers' modules (~1 s of CPU; common/run.py `run_entry`);
- spin bound: vLLM's engine core and worker sleep 10 ms after a message instead of spinning for 1 s
  (common/compat/vllm.py `TandemExecutor`);
- core lending: an explorer computes on the trainers' cores while they wait for a batch, the trainers on the
  explorers' for their last step (common/runtime/cores.py `CoreShare.wide`).
The launcher decides once (`decide`); every worker and vLLM's engine core read it from the environment."""

from __future__ import annotations

import os

ENV = "TANDEM_CPU_TUNING"


def decide(wanted: bool, devices: list[str]) -> bool:
    """On when `wanted` (--cpu-tuning) and every device is the CPU; this process and what it starts know it."""
    on = wanted and all(d == "cpu" for d in devices)
    os.environ[ENV] = "1" if on else "0"
    return on


def enabled() -> bool:
    """As decided (on where nothing decided: a CPU process started without the launcher, as the tests start one)."""
    return os.environ.get(ENV) != "0"
