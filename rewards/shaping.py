"""Reward shaping over one sample group (the n responses to one task), as small pure functions.

- Kimi k1.5 length penalty (arXiv 2501.12599, sec. 2.3.3): λ_i = 0.5 − (len_i − min_len) / (max_len − min_len);
  a correct response gets λ_i, a wrong one min(0, λ_i) (short wrong answers are not rewarded for being short).
  All lengths equal → 0 for everyone.
- Format reward: 1 when the response has its final answer in the expected format, else 0.

`shape_group` combines them with config weights (0 switches a term off):
    shaped_i = reward_i + length_penalty_weight * λ'_i + format_weight * format_i
"""

from __future__ import annotations


def length_penalty(lengths: list[int], correct: list[bool]) -> list[float]:
    """Kimi k1.5 length reward of every sample of one group (same order)."""
    if len(lengths) != len(correct):
        raise ValueError(f"{len(lengths)} lengths for {len(correct)} correctness flags")
    if not lengths:
        return []
    lo, hi = min(lengths), max(lengths)
    if hi == lo:
        return [0.0] * len(lengths)
    out = []
    for n, ok in zip(lengths, correct):
        lam = 0.5 - (n - lo) / (hi - lo)
        out.append(lam if ok else min(0.0, lam))
    return out


def format_reward(format_ok: bool) -> float:
    """1 for a response whose final answer is in the expected format, 0 otherwise."""
    return 1.0 if format_ok else 0.0


def shape_group(rewards: list[float], lengths: list[int], correct: list[bool] | None = None,
                length_penalty_weight: float = 0.0, format_weight: float = 0.0,
                format_ok: list[bool] | None = None) -> list[float]:
    """Shaped rewards of one group. `correct` defaults to reward >= 1; `format_ok` is needed when format_weight
    is set (e.g. from Reward.info["format_ok"]). Weights of 0 leave the rewards untouched."""
    n = len(rewards)
    if len(lengths) != n:
        raise ValueError(f"{n} rewards for {len(lengths)} lengths")
    shaped = [float(r) for r in rewards]
    if length_penalty_weight:
        flags = correct if correct is not None else [r >= 1.0 for r in rewards]
        shaped = [s + length_penalty_weight * lam for s, lam in zip(shaped, length_penalty(lengths, flags))]
    if format_weight:
        if format_ok is None or len(format_ok) != n:
            raise ValueError("format_weight is set but format_ok does not have one flag per response")
        shaped = [s + format_weight * format_reward(ok) for s, ok in zip(shaped, format_ok)]
    return shaped
