"""torch's private functions tandem calls: the thread count that vLLM's CPU worker no longer lets
`torch.set_num_threads` set (common/explorer/vllm_worker.py `tandem_use_cores`)."""

from __future__ import annotations

import torch

from common.compat import missing

CHECKED = "2.13"  # read on this release; TORCH_MIN (common/run.py) too


def check() -> list[str]:
    """The private names this module uses that this torch lacks (empty: all there)."""
    return missing(torch._C, ("set_num_threads",), "torch._C")


def set_threads_below_vllm(threads: int) -> None:
    """What vLLM's disabled `torch.set_num_threads` calls: the intra-op pool's size."""
    torch._C.set_num_threads(threads)
