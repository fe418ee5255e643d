"""Reward shaping over one sample group (the n responses to one task), as small pure functions.

- Kimi k1.5 length penalty (arXiv 2501.12599, sec. 2.3.3): λ_i = 0.5 − (len_i − min_len) / (max_len − min_len);
  a correct response gets λ_i, a wrong one min(0, λ_i) (short wrong answers are not rewarded for being short).
  All lengths equal → 0 for everyone.
- Format reward: 1 when the response has its final answer in the expected format, else 0.
- DAPO's soft overlong punishment (arXiv:2503.14476 eq. 13): 0 up to max_len - buffer tokens, then falling linearly
  to -1 at max_len (per response, not per group).

`shape_batch` combines them with config weights (0 switches a term off), group by group over a rollout batch:
    shaped_i = reward_i + length_penalty_weight * λ'_i + format_weight * format_i + overlong_i
and keeps each term (`--length-penalty`, `--format-reward`, `--overlong-buffer` in common/config.py); a failed sample
(info["failed"]) is capped at its group's lowest legitimate shaped reward.
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


def overlong_penalty(length: int, max_len: int, buffer: int) -> float:
    """DAPO's soft overlong punishment of one response of `length` tokens, generated with at most `max_len`."""
    start = max_len - buffer
    if length <= start:
        return 0.0
    return max(-1.0, (start - length) / buffer)


def format_reward(format_ok: bool) -> float:
    """1 for a response whose final answer is in the expected format, 0 otherwise."""
    return 1.0 if format_ok else 0.0


# ALGO LOGIC: the shaping terms and how they add up
def shaping_terms(rewards: list[float], lengths: list[int], length_penalty_weight: float = 0.0,
                  format_weight: float = 0.0, format_ok: list[bool] | None = None, overlong_buffer: int = 0,
                  max_len: int = 0) -> dict[str, list[float]]:
    """The weighted terms of one group that are switched on, by name ("length_penalty", "format", "overlong").
    A correct response is one of reward >= 1; `format_ok` is needed when format_weight is set (e.g.
    Reward.info["format_ok"]); `max_len` (the generation limit) when overlong_buffer is set."""
    n = len(rewards)
    if len(lengths) != n:
        raise ValueError(f"{n} rewards for {len(lengths)} lengths")
    terms = {}
    if length_penalty_weight:
        correct = [r >= 1.0 for r in rewards]
        terms["length_penalty"] = [length_penalty_weight * lam for lam in length_penalty(lengths, correct)]
    if format_weight:
        if format_ok is None or len(format_ok) != n:
            raise ValueError("format_weight is set but format_ok does not have one flag per response")
        terms["format"] = [format_weight * format_reward(ok) for ok in format_ok]
    if overlong_buffer:
        terms["overlong"] = [overlong_penalty(n, max_len, overlong_buffer) for n in lengths]
    return terms


def shape_batch(rewards, lengths: list[int], group_size: int | list[int], length_penalty_weight: float = 0.0,
                format_weight: float = 0.0, overlong_buffer: int = 0, max_len: int = 0) -> list[tuple[float, dict]]:
    """(shaped reward, breakdown) per response of a rollout batch whose consecutive `group_size` responses answer
    one task (a list: each group's size, where they differ: agent episodes make any number of samples).
    `rewards` are `rewards.Reward`s (score, info["format_ok"]); `lengths` are response token counts.
    The breakdown is {"raw": score, <term>: value, ...} with the terms switched on."""
    sizes = group_size if isinstance(group_size, list) else [group_size] * (len(rewards) // group_size)
    if len(rewards) != len(lengths) or len(rewards) != sum(sizes):
        raise ValueError(f"{len(rewards)} rewards, {len(lengths)} lengths: not whole groups of {group_size}")
    out, starts = [], [sum(sizes[:k]) for k in range(len(sizes))]
    for start, size in zip(starts, sizes):
        group = rewards[start: start + size]
        raw = [float(r.score) for r in group]
        terms = shaping_terms(raw, lengths[start: start + size], length_penalty_weight=length_penalty_weight,
                              format_weight=format_weight, format_ok=[bool(r.info.get("format_ok")) for r in group],
                              overlong_buffer=overlong_buffer, max_len=max_len)
        shaped = [score + sum(values[i] for values in terms.values()) for i, score in enumerate(raw)]
        legit = [v for v, r in zip(shaped, group) if not r.info.get("failed")]
        for i, score in enumerate(raw):
            parts = {name: values[i] for name, values in terms.items()}
            if group[i].info.get("failed") and legit and shaped[i] > min(legit):
                # a failed sample never out-scores its group's worst legitimate one (a short crash would otherwise
                # beat a long loss under the length penalty): rewards/THREATS.md
                parts["failed_floor"] = min(legit) - shaped[i]
            out.append((score + sum(parts.values()), {"raw": score, **parts}))
    return out
