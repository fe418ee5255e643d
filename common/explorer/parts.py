"""What an explorer is built of and how its samples become experiences. `Parts` (the engine, the workflows in
flight, the task stream, the reward pool ...) with what every way of running them shares: `score` ended groups,
`package` scored ones. `Explorer` builds the parts and runs rounds with them; its stream (streaming.py) and its
evaluations (evaluation.py) are given the parts, never the explorer, and hold the weights version they run with.

The reward glue between workflows and the reward pool: `ScoreFuture` scores a round's samples of any workflow
through the pool (each sample says what its verifier scores and how the verdict becomes its reward), `turn_credit`
splits a sample's reward over its turns, `rollout_metrics` sums what the samples count.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

from common.envs.boundary import abandoned_threads, late_results
from common.experience import Experience
from common.explorer.engine import RolloutEngine, SamplingConfig
from common.explorer.rollouts import Rollouts
from common.explorer.workflow import Context
from common.runtime.metrics import Timeline, peak_gpu_memory
from common.tasks.stream import TaskStream
from rewards import RewardPool
from rewards.shaping import shape_batch


@dataclass(frozen=True)
class Parts:
    args: object  # the run's config
    index: int  # explorer<index>
    device: object
    engine: RolloutEngine
    sampling: SamplingConfig  # the run's, for training samples
    workflow_ctx: Context  # with the tokenizer
    in_flight: Rollouts  # the tasks' workflows in flight
    train_tasks: TaskStream
    eval_tasks: list[dict]
    rewards: RewardPool
    timeline: Timeline
    group_ids: Iterator[int] = field(default_factory=itertools.count)

    def start_group(self, task: dict) -> int:
        """Start `task`'s workflow in flight (--samples-per-task samples) as the next group; its group id."""
        group_id = next(self.group_ids)
        self.in_flight.start(task, group_id, self.args.samples_per_task)
        return group_id

    def score(self, flat: list) -> ScoreFuture:
        """Score (group, sample) pairs in the reward pool's processes; episodes add their environment's reward."""
        args = self.args
        return ScoreFuture(self.rewards, flat, self.workflow_ctx.tokenizer, args.env_reward, bool(args.reward_fn))

    def package(self, groups: list, scores: list, generated: dict, generated_s: float, reward_s: float,
                version: int):
        """Experiences and metrics of scored groups (scores: one Reward per sample, group by group) made with
        weights `version`; `generated`: what generating them counted (tokens, dropped tasks, continued responses)."""
        args = self.args
        flat = [(g, r) for g in groups for r in g.responses]
        shaped = self.shaped(flat, scores)
        experiences = [Experience(
            prompt_ids=r.prompt_ids, response_ids=r.response_ids, logprobs=r.logprobs,
            loss_mask=r.loss_mask(args.partial_loss), reward=reward, reward_info={**s.info, **parts},
            group_id=g.group_id, task_id=str(g.task["id"]), policy_version=max(r.versions, default=version),
            finish_reason=r.finish_reason, segment_versions=r.versions, turn_ends=r.turn_ends,
            turn_rewards=turn_credit(r.turn_rewards, len(r.turn_ends), reward), images=r.images,
        ) for (g, r), s, (reward, parts) in zip(flat, scores, shaped)]
        start = 0
        for g in groups:  # prioritized task sampling learns each task's success rate from these
            end = start + len(g.responses)  # n samples; an agent's episodes make any number
            self.train_tasks.record(str(g.task["id"]), [s.score >= 1.0 for s in scores[start:end]])
            start = end
        metrics = {
            "time/rollout": generated_s, "time/reward": reward_s,
            "rollout/tokens_per_s": generated["tokens"] / max(generated_s, 1e-9),
            "rollout/truncated_frac": sum(r.finish_reason == "length" for _, r in flat) / max(len(flat), 1),
            "rollout/sampled_tokens_mean": sum(r.sampled_tokens for _, r in flat) / max(len(flat), 1),
            "reward/failed": sum(bool(r.info.get("failed")) for r in scores),
            **rollout_metrics(flat), **generated.get("tasks", {}),
            **peak_gpu_memory(self.device, f"explorer{self.index}"),
            **self.rewards.judge_metrics(),  # reward/judge_*: calls, calls/s, cache hit rate, failures
        }
        modes = sorted({r.info["sandbox"] for r in scores if r.info.get("sandbox")})  # code rewards: isolation in force
        if modes:
            metrics["reward/sandbox_mode"] = " | ".join(modes)
        if args.curriculum:
            metrics["tasks/max_difficulty"] = self.train_tasks.open_levels(version / args.steps)[-1]
        for name in (shaped[0][1] if shaped else {}):  # raw, and each shaping term that is switched on
            metrics[f"reward/{name}_mean"] = sum(parts[name] for _, parts in shaped) / len(shaped)
        if args.rollout_token_budget:  # partial rollouts
            metrics.update({
                "rollout/partial_continued": generated["continued"],  # responses given another segment
                "rollout/partial_saved": len(self.in_flight.unfinished()),  # still unfinished: continued later
                "rollout/partial_finished": sum(r.segments > 1 for _, r in flat),  # ended after 2+ segments
                "rollout/groups_finished": len(groups), "rollout/groups_in_flight": len(self.in_flight.groups),
            })
        return experiences, metrics

    def shaped(self, flat: list, scores: list) -> list[tuple[float, dict]]:
        """ALGO LOGIC: shaping per sample group (--length-penalty, --format-reward, --overlong-buffer) of scored
        (group, response) pairs: (reward, its parts) each; reward_info keeps the parts."""
        args = self.args
        sizes = [sum(1 for g, _ in flat if g is group) for group in {id(g): g for g, _ in flat}.values()]
        return shape_batch(scores, [r.sampled_tokens for _, r in flat], sizes, args.length_penalty,
                           args.format_reward, args.overlong_buffer, args.max_new_tokens)  # episodes: sampled tokens


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
