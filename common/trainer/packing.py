"""Micro-batches of a minibatch: a fixed number of sequences, or whole sequences up to a token budget
(`--max-tokens-per-micro-batch`, run padding-free by `common.model.hidden_states(..., packed=True)`).

Packing changes how the work is cut, not what is computed: each micro-batch's loss is still weighted by its share
of the minibatch's tokens (or sequences), so the summed gradient is the same as with padded micro-batches.
"""

from __future__ import annotations

import torch


def micro_batches(idx: torch.Tensor, lengths: torch.Tensor, micro_batch_size: int,
                  max_tokens: int = 0) -> list[torch.Tensor]:
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


def batch_micro_batches(batch, micro_batch_size: int, max_tokens: int = 0) -> list[torch.Tensor]:
    """`micro_batches` over a whole rollout batch (reference / proximal log-probs, critic values)."""
    return micro_batches(torch.arange(len(batch)), batch.attention_mask.sum(-1).cpu(), micro_batch_size, max_tokens)
