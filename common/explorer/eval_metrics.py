"""The evaluation's estimators as small pure functions: mean@n, the unbiased pass@k, maj@k, and bootstrap confidence
intervals over tasks, of one model's score and of the paired difference of two models' scores.

Every task has n samples, each correct (its verifier scored it 1) or not, and each with the final answer its
verifier extracted and normalised (`Reward.info["answer_key"]`, else `["pred"]`; None: no answer).

- mean@n: the share of a task's samples that are correct, averaged over tasks (the pass@1 estimate from n samples).
- pass@k, k <= n: the unbiased estimator of Chen et al. 2021 (arXiv:2107.03374, the Codex paper): with c of the n
  samples correct, 1 - C(n-c, k) / C(n, k), the probability that k samples drawn from the n without replacement hold
  at least one correct one; averaged over tasks. (1 - (1 - c/n)^k, the plug-in, is biased low.)
- maj@k, k <= n: the expected score of a majority vote over k samples drawn from the n without replacement. Samples
  without an answer do not vote (a draw with no answer at all scores 0). A tie between the most-voted answers scores
  the mean correctness of the tied answers: the expected score of picking one of them at random, so the estimate
  does not depend on the order the samples came in. Exact over every k-subset where there are at most
  `MAJ_EXACT_SUBSETS` of them, else the mean over as many seeded draws.
- bootstrap: the percentile interval of the mean over tasks drawn with replacement (`resamples` seeded draws); the
  paired bootstrap draws the same tasks for both models and gives the interval of the difference of their means,
  so what the two share (a task both solve, one neither does) does not widen it.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

MAJ_EXACT_SUBSETS = 512  # maj@k enumerates every k-subset up to this many, else draws this many at random
RESAMPLES = 1000
LEVEL = 0.95


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k of one task with `c` correct samples of `n`: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    # the product form of C(n-c, k) / C(n, k): no huge binomials
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def majority_score(correct: list[bool], answers: list) -> float:
    """The score of a majority vote among these samples: the most common answer's correctness (answers None do not
    vote); a tie scores the mean correctness of the tied answers; no answer at all scores 0. Samples with the same
    answer key are taken as one answer, scored by the share of them that is correct (the same, for a verifier whose
    key decides its verdict)."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [a for a, v in votes.items() if v == top]
    right = {a: sum(ok for ok, b in zip(correct, answers) if b == a) / votes[a] for a in tied}
    return sum(right.values()) / len(tied)


def maj_at_k(correct: list[bool], answers: list, k: int, seed: int = 0) -> float:
    """Expected majority-vote score over k of one task's samples drawn without replacement (module docstring)."""
    n = len(correct)
    if not 1 <= k <= n or len(answers) != n:
        raise ValueError(f"maj@k needs 1 <= k <= n and one answer per sample (n={n}, k={k}, answers={len(answers)})")
    if math.comb(n, k) <= MAJ_EXACT_SUBSETS:
        subsets = list(itertools.combinations(range(n), k))
    else:
        rng = random.Random(seed)
        subsets = [rng.sample(range(n), k) for _ in range(MAJ_EXACT_SUBSETS)]
    return sum(majority_score([correct[i] for i in s], [answers[i] for i in s]) for s in subsets) / len(subsets)


def report_ks(n: int) -> list[int]:
    """The k of pass@k and maj@k reported for n samples a task: 2, 4, 8, ... below n, and n (none for n = 1; pass@1
    is mean@n, and so is maj@1 where the answer decides the verdict)."""
    return [k for k in (2 ** i for i in range(1, n.bit_length())) if k < n] + ([n] if n > 1 else [])


def per_task(correct: list[list[bool]], answers: list[list], ks: list[int], seed: int = 0) -> dict[str, list[float]]:
    """Each metric's value per task: mean@n, pass@k and maj@k for every k in `ks` (n: the fewest samples of a task,
    which is every task's number of samples unless a workflow made a different number)."""
    n = min(len(c) for c in correct)
    out = {f"mean@{n}": [sum(c) / len(c) for c in correct]}
    for k in ks:
        out[f"pass@{k}"] = [pass_at_k(len(c), sum(c), k) for c in correct]
    for k in ks:
        out[f"maj@{k}"] = [maj_at_k(c, a, k, seed + i) for i, (c, a) in enumerate(zip(correct, answers))]
    return out


def bootstrap_interval(values: list[float], seed: int = 0, resamples: int = RESAMPLES,
                       level: float = LEVEL) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-task `values`: `resamples` draws of as many tasks with
    replacement (seeded), the interval between the (1 - level) / 2 and (1 + level) / 2 quantiles of their means."""
    import numpy as np

    if not values:
        raise ValueError("a bootstrap interval needs at least one task")
    rng = np.random.default_rng(seed)
    means = np.asarray(values, dtype=float)[rng.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def paired_bootstrap_interval(a: list[float], b: list[float], seed: int = 0, resamples: int = RESAMPLES,
                              level: float = LEVEL) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(b) - mean(a) over the same tasks (a[i] and b[i] are task i's): each
    draw takes the same tasks for both."""
    if len(a) != len(b):
        raise ValueError(f"a paired comparison needs the same tasks on both sides ({len(a)} vs {len(b)} scores)")
    return bootstrap_interval([y - x for x, y in zip(a, b)], seed, resamples, level)


def summarize(values: dict[str, list[float]], seed: int = 0, resamples: int = RESAMPLES,
              level: float = LEVEL) -> dict[str, dict]:
    """metric -> {"value": mean over tasks, "lo", "hi": its bootstrap interval} of `per_task`'s output."""
    out = {}
    for name, v in values.items():
        lo, hi = bootstrap_interval(v, seed, resamples, level)
        out[name] = {"value": sum(v) / len(v), "lo": lo, "hi": hi}
    return out


def compare(a: dict[str, list[float]], b: dict[str, list[float]], seed: int = 0, resamples: int = RESAMPLES,
            level: float = LEVEL) -> dict[str, dict]:
    """metric -> {"value": B's mean - A's mean, "lo", "hi": the paired bootstrap interval} for the metrics both have."""
    out = {}
    for name in (m for m in a if m in b):
        lo, hi = paired_bootstrap_interval(a[name], b[name], seed, resamples, level)
        out[name] = {"value": sum(b[name]) / len(b[name]) - sum(a[name]) / len(a[name]), "lo": lo, "hi": hi}
    return out


def format_interval(value: float, lo: float, hi: float, digits: int = 3) -> str:
    """'0.250 [0.146, 0.375]'."""
    return f"{value:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"
