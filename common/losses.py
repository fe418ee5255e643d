"""Losses and advantages as small pure functions over tensors (hand-checkable; see tests/test_losses.py).

Shapes: per-token tensors are [B, T] with a 0/1 `mask` of the same shape; padding and prompt tokens have mask 0
and never count.
"""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over positions where mask is 1 (0 where nothing is masked in)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO: reward minus its group's mean, divided by the group's std when `normalize_std` (arXiv:2402.03300).

    One advantage per sample ([B]); samples of one task share a group id. A group whose rewards are all equal
    gets advantage 0 (no signal).
    """
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in group_ids.unique():
        idx = group_ids == g
        r = rewards[idx].float()
        centred = r - r.mean()
        if normalize_std:
            centred = centred / (r.std(unbiased=False) + eps) if r.numel() > 1 else centred * 0
        adv[idx] = centred
    return adv


def clipped_surrogate_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                           mask: torch.Tensor, clip_eps: float = 0.2, clip_eps_high: float | None = None):
    """Token-level PPO clipped surrogate (arXiv:1707.06347), averaged over all response tokens of the batch.

    `old_logprobs` are the behaviour log-probs the explorer recorded; `advantages` are [B] or [B, T].
    Returns (loss, clip_fraction).
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    ratio = torch.exp(logprobs - old_logprobs)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + high) * advantages
    loss = -masked_mean(torch.minimum(unclipped, clipped), mask)
    clip_frac = masked_mean((clipped < unclipped).float(), mask)
    return loss, clip_frac


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from samples of the policy (Schulman, "Approximating KL", 2020).

    k1 = log r', k2 = (log r')^2 / 2, k3 = exp(-log r') - 1 + log r', where log r' = logp - logp_ref.
    k1 is unbiased but noisy and can go negative; k3 is unbiased and always >= 0; k2 is biased, low variance.
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"kl estimator must be k1, k2 or k3, got {kind!r}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution at every position: [..., V] -> [...]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
