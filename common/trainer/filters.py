"""Experience processors: small functions applied, in order, to every rollout batch between the explorer and the
trainer's update (the trainer runs them first thing in `train_step`, before collate). Each one takes the batch's
experiences and the run's args and returns (experiences, counts); the counts go into the step's metrics row.
The staleness processor also takes the trainer's version, and runs earlier: where the trainer takes a batch off the
queue (TrainerRun.get), before the replay buffer sees it, so a batch that is too old costs no step.

ALGO LOGIC: a processor of your own is one function + one line in `PROCESSORS` (or, from outside the package,
`--processors my_module:my_fn`, appended after the built-in ones):

    def drop_short(experiences, args):                       # e.g. in common/trainer/filters.py
        kept = [e for e in experiences if len(e.response_ids) >= 4]
        return kept, {"filter/short_dropped": len(experiences) - len(kept)}

    PROCESSORS["short"] = drop_short

A processor must not modify an Experience in place (replay may train it again): use dataclasses.replace.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Callable

import torch

from common.experience import Experience, too_stale, zero_signal_groups
from common.runtime.plugins import load_object
from common.trainer.losses import ALGOS

Processor = Callable[[list[Experience], object], "tuple[list[Experience], dict]"]


# ALGO LOGIC: staleness. The one rule of how old an experience is, for the trainer and the replay buffer alike.
def trained_version(e: Experience) -> int:
    """The oldest weights version among the tokens `e` trains (its per-token versions where the loss mask is 1): a
    partial rollout trained on its last segment only is as old as that segment, one trained whole as its first.
    Without per-token versions or trained tokens: its policy_version."""
    return min((v for v, m in zip(e.segment_versions, e.loss_mask) if m), default=e.policy_version)


def drop_stale(experiences: list[Experience], args, version: int) -> tuple[list[Experience], dict]:
    """--max-staleness: samples whose trained tokens are more than K versions behind `version` (the weights the next
    step updates) are dropped and counted; the kept ones' staleness goes into the metrics, and the dropped ones'
    youngest age."""
    stale = [too_stale(trained_version(e), version, args.max_staleness) for e in experiences]
    ages = [version - trained_version(e) for e in experiences]
    kept = [e for e, s in zip(experiences, stale) if not s]
    counts = {"filter/stale_dropped": len(experiences) - len(kept)}
    if kept:
        kept_ages = [a for a, s in zip(ages, stale) if not s]
        counts.update({"staleness/mean": sum(kept_ages) / len(kept_ages), "staleness/max": max(kept_ages)})
    if len(kept) < len(experiences):
        counts["staleness/dropped_min"] = min(a for a, s in zip(ages, stale) if s)
    return kept, counts


def drop_invalid_rewards(experiences: list[Experience], args) -> tuple[list[Experience], dict]:
    """Non-finite rewards (the sample's, or any turn's credit) are always dropped; failed samples
    (reward_info["failed"]: a verifier's error, timeout or crash, an episode that ended in an environment error,
    timeout or template failure) too when --drop-failed-rewards (instead of training on their floor score), counted per
    reason as filter/failed_dropped/<reason> (an episode's end reason, or "verifier")."""
    kept, failed = [], Counter()
    for e in experiences:
        if args.drop_failed_rewards and e.reward_info.get("failed"):
            failed[e.reward_info.get("failed_reason", "verifier")] += 1
        elif math.isfinite(e.reward) and all(math.isfinite(r) for r in e.turn_rewards):
            kept.append(e)
    return kept, {"filter/invalid_dropped": len(experiences) - len(kept),
                  **{f"filter/failed_dropped/{k}": v for k, v in failed.items()}}


def mask_truncated(experiences: list[Experience], args) -> tuple[list[Experience], dict]:
    """--mask-truncated (DAPO's overlong filtering): responses cut at --max-new-tokens keep their place in the group
    (their reward counts in the group mean) but get loss mask 0."""
    if not args.mask_truncated:
        return experiences, {"filter/truncated_masked": 0}
    out = [dataclasses.replace(e, loss_mask=[0] * len(e.loss_mask)) if e.finish_reason == "length" else e
           for e in experiences]
    return out, {"filter/truncated_masked": sum(e.finish_reason == "length" for e in experiences)}


def drop_zero_signal_groups(experiences: list[Experience], args) -> tuple[list[Experience], dict]:
    """--drop-zero-signal-groups (DAPO's dynamic sampling; --refill-rounds has the explorer replace them): a group
    whose rewards are all equal has group advantage 0 and no policy gradient, so it is left out of the update (a
    batch with no signal at all costs no backward pass). Judged on the rewards as scored (a --kl-mode reward
    penalty comes later, in the advantages). Never for algorithms with a critic or a teacher: they give such
    samples an advantage."""
    if not args.drop_zero_signal_groups or not ALGOS[args.algo].group_signal or not experiences:
        return experiences, {"filter/zero_signal_frac": 0.0}
    zero = zero_signal_groups(experiences)
    kept = [e for e in experiences if e.group_id not in zero]
    return kept, {"filter/zero_signal_frac": 1 - len(kept) / len(experiences)}


class NonFinite(RuntimeError):
    """A non-finite value the update would have trained on."""


def check_finite(step: int, **values) -> None:
    """Stop the run, with one line naming the step and the source, where any of `values` (tensors or numbers:
    advantages, returns, the loss, the gradient norm; None is skipped) is not finite. Non-finite rewards were
    dropped before (drop_invalid_rewards), so one here is a numerical fault, and no update may train on it."""
    for name, value in values.items():
        if value is None:
            continue
        bad = (~torch.isfinite(torch.as_tensor(value).detach())).sum().item()
        if bad:
            raise NonFinite(f"step {step}: {bad} non-finite value(s) in the {name}: the update was not applied")


PROCESSORS: dict[str, Processor] = {
    "invalid_rewards": drop_invalid_rewards,
    "truncated": mask_truncated,
    "zero_signal": drop_zero_signal_groups,
}


def build_processors(extra: tuple[str, ...] | list[str] = ()) -> list[Processor]:
    """The built-in processors in registry order, then the --processors references (module:function)."""
    return list(PROCESSORS.values()) + [load_object(spec, "--processors") for spec in extra]


def process(experiences: list[Experience], args, processors: list[Processor]) -> tuple[list[Experience], dict]:
    """Run `processors` in order; returns the experiences that remain and every processor's counts."""
    counts: dict = {}
    for fn in processors:
        experiences, c = fn(experiences, args)
        counts.update(c)
    return experiences, counts
