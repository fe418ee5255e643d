"""Micro-batches: which rows one forward/backward pass runs. `micro_batches` is the one place that decides it, for
the policy, the reference model and the critic alike:

- a group's samples sit together, so rows that share a prompt run it once (common/trainer/forward.py
  shared_prompt_layout);
- data parallel: each trainer runs its own contiguous share of the minibatch (`DataParallel.local_slice`);
- a fixed number of sequences (`--micro-batch-size`), or whole sequences up to a token budget
  (`--max-tokens-per-micro-batch`, run padding-free by `common.trainer.forward.hidden_states(..., packed=True)`);
- FSDP: every pass is a collective, so each trainer runs as many as the busiest one (`DataParallel.even_out`); the
  extra ones are idle passes.

Packing changes how the work is cut, not what is computed: each micro-batch's loss is still weighted by its share
of the minibatch's tokens (or sequences), so the summed gradient is the same as with padded micro-batches.
"""

from __future__ import annotations

from typing import Iterator

import torch

from common.experience import Batch


def cut(idx: torch.Tensor, lengths: torch.Tensor, micro_batch_size: int, max_tokens: int = 0) -> list[torch.Tensor]:
    """Index tensors, in order, covering `idx`: `micro_batch_size` sequences each, or (max_tokens > 0) as many
    consecutive sequences as fit in `max_tokens` real tokens (`lengths[i]`; a longer sequence goes alone)."""
    if max_tokens <= 0:
        return [idx[start: start + micro_batch_size] for start in range(0, len(idx), micro_batch_size)]
    out, current, used = [], [], 0
    for i in idx.tolist():
        n = int(lengths[i])
        if current and used + n > max_tokens:
            out.append(torch.tensor(current, dtype=idx.dtype))
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        out.append(torch.tensor(current, dtype=idx.dtype))
    return out


def micro_batches(batch: Batch, rows: torch.Tensor, args, dp=None) -> Iterator[tuple[torch.Tensor | None, Batch]]:
    """(rows, the micro-batch of those rows) for each pass this trainer runs over `rows` of `batch`. With `dp` (a
    minibatch's update) only this trainer's share; an idle pass of a sharded trainer comes as (None, row 0 of the
    batch): run it, scale its loss by 0. Without `dp` (a whole-batch pass, the same on every trainer) every row."""
    rows = rows[torch.argsort(batch.group_ids[rows].cpu(), stable=True)]  # index lists stay on the CPU
    if dp is not None:
        rows = dp.local_slice(rows)
    parts = cut(rows, batch.attention_mask.sum(-1).cpu(), args.micro_batch_size, args.max_tokens_per_micro_batch)
    if dp is not None:
        parts = dp.even_out(parts)
    for part in parts:
        yield part, batch.select(torch.zeros(1, dtype=torch.long) if part is None else part)
