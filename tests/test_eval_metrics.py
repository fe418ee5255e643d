"""The evaluation's estimators (common/explorer/eval_metrics.py) against values computed by hand."""

import itertools
import math

import pytest

from common.explorer.eval_metrics import (bootstrap_interval, compare, maj_at_k, majority_score,
                                          paired_bootstrap_interval, pass_at_k, per_task, report_ks, summarize)


def test_pass_at_k_is_chen_et_al_unbiased_estimator():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5) = 0.9167, not 1 - 0.7^5 = 0.832
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # pass@1 is the share correct
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(6, 2, 5) == 1.0  # only 4 wrong samples: every 5 of them hold a correct one
    # unbiased: the share of k-subsets of the n samples that hold a correct one, counted
    samples = [1, 0, 0, 1, 0, 0, 0]
    for k in range(1, 8):
        subsets = list(itertools.combinations(samples, k))
        assert pass_at_k(7, 2, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_majority_vote_ties_and_missing_answers():
    assert majority_score([True, True, False], ["7", "7", "8"]) == 1.0
    assert majority_score([False, False, True], ["8", "8", "7"]) == 0.0
    assert majority_score([True, False], ["7", "8"]) == 0.5  # a tie: the mean correctness of the tied answers
    assert majority_score([True, False, False, True], ["7", "8", "9", "7"]) == 1.0  # 7 has two votes
    assert majority_score([True, False, False], ["7", None, None]) == 1.0  # no answer does not vote
    assert majority_score([False, False], [None, None]) == 0.0


def test_maj_at_k_averages_the_vote_over_every_k_subset():
    correct, answers = [True, True, False], ["a", "a", "b"]
    assert maj_at_k(correct, answers, 3) == 1.0
    assert maj_at_k(correct, answers, 2) == pytest.approx((1 + 0.5 + 0.5) / 3)  # {a,a}: 1; {a,b} twice: a tie
    assert maj_at_k(correct, answers, 1) == pytest.approx(2 / 3)  # maj@1 is mean@n for a key-decided verdict
    # the order of the samples does not matter, ties included
    assert maj_at_k([False, True], ["b", "a"], 2) == maj_at_k([True, False], ["a", "b"], 2) == 0.5
    # more subsets than enumerated: seeded draws, close to the exact value
    correct, answers = [True] * 6 + [False] * 10, ["a"] * 6 + [f"w{i}" for i in range(10)]
    assert math.comb(16, 8) > 512
    drawn = maj_at_k(correct, answers, 8, seed=3)
    assert drawn == maj_at_k(correct, answers, 8, seed=3)
    exact = sum(1.0 if s.count(True) >= 2 else (1 / (8 - s.count(True) + 1) if s.count(True) == 1 else 0.0)
                for s in itertools.combinations(correct, 8)) / math.comb(16, 8)
    assert drawn == pytest.approx(exact, abs=0.03)


def test_bootstrap_interval_of_a_known_distribution():
    values = [1.0] * 50 + [0.0] * 50  # mean 0.5, standard error sqrt(0.25 / 100) = 0.05
    lo, hi = bootstrap_interval(values, seed=0, resamples=4000)
    assert lo == pytest.approx(0.5 - 1.96 * 0.05, abs=0.012) and hi == pytest.approx(0.5 + 1.96 * 0.05, abs=0.012)
    assert bootstrap_interval(values, seed=7) == bootstrap_interval(values, seed=7)  # seeded
    assert bootstrap_interval([0.25] * 20) == (0.25, 0.25)  # no spread, no width
    narrow = bootstrap_interval([1.0] * 500 + [0.0] * 500, seed=0)
    assert narrow[1] - narrow[0] < (hi - lo) / 2.5  # ten times the tasks: about a third of the width


def test_paired_bootstrap_sees_a_gain_the_unpaired_intervals_hide():
    base = [0.0, 1.0] * 25  # the tasks differ a lot from each other ...
    better = [v + 0.1 for v in base]  # ... and the second model gains 0.1 on every one of them
    lo_a, hi_a = bootstrap_interval(base)
    assert hi_a - lo_a > 0.2  # alone, each mean is uncertain by more than the gain
    assert paired_bootstrap_interval(base, better) == pytest.approx((0.1, 0.1))  # paired: the gain, certain
    result = compare({"mean@4": base}, {"mean@4": better})
    assert result["mean@4"]["value"] == pytest.approx(0.1)
    with pytest.raises(ValueError):
        paired_bootstrap_interval([1.0], [1.0, 0.0])


def test_per_task_and_summary():
    correct = [[True, True, False, False], [False, False, False, False]]
    answers = [["4", "4", "5", None], ["1", "2", "2", None]]
    assert report_ks(4) == [2, 4] and report_ks(8) == [2, 4, 8] and report_ks(6) == [2, 4, 6] and report_ks(1) == []
    values = per_task(correct, answers, report_ks(4))
    assert values["mean@4"] == [0.5, 0.0]
    assert values["pass@2"] == pytest.approx([1 - 1 / 6, 0.0])  # 1 - C(2,2)/C(4,2)
    assert values["maj@4"] == [1.0, 0.0]
    summary = summarize(values)
    assert summary["mean@4"]["value"] == 0.25 and summary["mean@4"]["lo"] == 0.0 and summary["mean@4"]["hi"] == 0.5


def test_math_verifier_normalises_answers_for_the_vote():
    from rewards.math import score

    task = {"answer": "7.5", "reward": "math"}
    replies = ["so \\boxed{7.50}", "Answer: 7.5", "Answer: 15/2", "Answer: 8"]
    rewards = [score(r, task) for r in replies]
    keys = [r.info["answer_key"] for r in rewards]
    assert keys[0] == keys[1] == "7.5" and keys[2] != keys[0]  # 15/2 is right, but votes on its own
    correct = [r.score == 1.0 for r in rewards]
    assert correct == [True, True, True, False]
    assert majority_score(correct, keys) == 1.0
