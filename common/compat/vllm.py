"""vLLM's internals tandem uses. On the CPU only: its multiprocess executor's `_init_executor` (to fork the worker
from the engine core and bound the queues' spin before they are made) and `SpinCondition`'s default spin (the module
docstring of common/explorer/vllm_worker.py says why both pay). With LoRA: the worker's LoRA model manager (adapters
built from in-memory tensors, common/explorer/vllm_worker.py) and the model registry's class lookup (whether an
architecture takes adapters, common/lora.py)."""

from __future__ import annotations

import inspect
import os

from vllm import ModelRegistry
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.lora.worker_manager import WorkerLoRAManager
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from common.compat import missing

CHECKED = "0.32.0"
SPIN_S = 0.01  # how long a reader of the engine core <-> worker queues spins before it sleeps


def check() -> list[str]:
    """The internals this module uses that this vLLM lacks or changed (empty: all there)."""
    moved = missing(MultiprocExecutor, ("_init_executor",), "MultiprocExecutor")
    moved += missing(ModelRegistry, ("_try_load_model_cls",), "ModelRegistry")
    if "_adapter_manager" not in inspect.getsource(WorkerLoRAManager.create_lora_manager):
        moved.append("WorkerLoRAManager._adapter_manager")
    parameters = list(inspect.signature(SpinCondition.__init__).parameters)
    if parameters[-1:] != ["busy_loop_s"] or len(SpinCondition.__init__.__defaults__ or ()) != 1:
        moved.append("SpinCondition.__init__(..., busy_loop_s=1.0)")
    return moved


def lora_model_manager(worker):
    """The LoRA model manager inside a worker's (LRU) WorkerLoRAManager: it adds, lists and removes adapters built
    from tensors, and holds the stacked buffers vLLM computes with."""
    return worker.model_runner.lora_manager._adapter_manager


def model_class(arch: str):
    """vLLM's implementation of architecture `arch` (None: vLLM has none)."""
    return ModelRegistry._try_load_model_cls(arch)


def bound_spin(seconds: float = SPIN_S) -> None:
    """Make vLLM's shared-memory queue readers created from now on in this process (and the processes it forks)
    spin at most `seconds` after a message (vLLM: 1 s), then wait for the writer's notification."""
    if check():
        raise RuntimeError(f"vLLM {CHECKED}'s internals moved ({'; '.join(check())}): update common/compat/vllm.py")
    SpinCondition.__init__.__defaults__ = (seconds,)


class ForkedExecutor(MultiprocExecutor):
    """vLLM's multiprocess executor whose worker is forked from the engine core."""

    spin_s: float | None = None  # how long its queues' readers spin (None: vLLM's own second)

    def _init_executor(self) -> None:
        # The engine core inherited tandem's VLLM_WORKER_MULTIPROC_METHOD=spawn (common/explorer/engine_vllm.py),
        # meant for the engine core only; this process has no gloo/NCCL threads, and vLLM forces spawn again where
        # CUDA is initialised.
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        if self.spin_s is not None:
            bound_spin(self.spin_s)  # before the queues (and the worker, which inherits it) are made
        super()._init_executor()


class TandemExecutor(ForkedExecutor):
    """The same, its queues spinning briefly: the CPU tuning's (common/runtime/cpu_tuning.py)."""

    spin_s = SPIN_S
