"""The reward glue between workflows and the reward pool: `ScoreFuture` scores a round's samples of any workflow
through the pool (each sample says what its verifier scores and how the verdict becomes its reward), `turn_credit`
splits a sample's reward over its turns, `rollout_metrics` sums what the samples count.
"""

from __future__ import annotations

from collections import Counter

from common.envs.boundary import abandoned_threads, late_results


class ScoreFuture:
    """RewardPool.submit for a round of samples of any workflow: each sample says what its verifier scores
    (Sample.verifier_input; None: no verifier) and turns the verdict into its reward (Sample.reward). With
    `whole_episodes` (--reward-fn) every sample goes to the function, its task as the sample presents it."""

    def __init__(self, pool, flat: list, tokenizer, env_reward: str, whole_episodes: bool = False):
        self.flat, self.env_reward = flat, env_reward
        inputs = [s.verifier_input(g.task, tokenizer, whole_episodes) for g, s in flat]
        self.scored = [i for i, text in enumerate(inputs) if text is not None]
        self.future = pool.submit([inputs[i] for i in self.scored],
                                  [flat[i][1].verifier_task(flat[i][0].task, whole_episodes) for i in self.scored],
                                  groups=[id(flat[i][0]) for i in self.scored])  # judge_group: a group's together
        self.submitted_at = self.future.submitted_at

    @property
    def done_at(self):
        return self.future.done_at

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> list:
        verified = dict(zip(self.scored, self.future.result(timeout)))
        return [s.reward(verified.get(i), self.env_reward) for i, (_, s) in enumerate(self.flat)]


def turn_credit(env_turn_rewards: list[float], turns: int, reward: float) -> list[float]:
    """ALGO LOGIC: the reward credited at the end of each turn (for turn-level advantages): the environment's
    step rewards, and the last turn gets the rest of the sample's (shaped) reward, so they add up to it."""
    if turns == 0:
        return []
    early = [float(r) for r in env_turn_rewards[:turns - 1]] + [0.0] * max(0, turns - 1 - len(env_turn_rewards))
    return early + [float(reward) - sum(early)]


def rollout_metrics(flat: list) -> dict:
    """rollout/turns_mean, and every sample's own counts summed (Sample.counts: episodes, tool calls, end
    reasons...); rollout/episode_truncated_frac is the truncated episodes' share."""
    if not flat:
        return {}
    out = {"rollout/turns_mean": sum(s.turns for _, s in flat) / len(flat)}
    images = [s.images for _, s in flat]
    if any(im is not None for im in images):  # what images cost: placeholder tokens per sample
        out["rollout/image_tokens_mean"] = sum(im.tokens for im in images if im is not None) / len(flat)
    counts = Counter()
    for _, s in flat:
        counts.update(s.counts())
    if "rollout/episode_truncated" in counts:
        counts["rollout/episode_truncated_frac"] = counts.pop("rollout/episode_truncated") / counts["rollout/episodes"]
        counts["rollout/env_threads_abandoned"] = abandoned_threads()  # timed-out env/tool calls still running
        counts["rollout/env_late_results"] = late_results()  # results that came past their limit (discarded)
    return {**out, **counts}
