"""The held-out evaluation: every evaluation task once, greedy, scored as training samples are; its accuracy is the
share of scores of 1. `Evaluation` runs either to its end at once (`run`: train_sync.py, train_offpolicy.py) or one
engine step at a time beside the streaming explorer's groups (`step`: train_async.py), its requests then sharing
the engine's running batch with theirs, so the trainer's first batch is not held back by the evaluation before it.
Both measure the weights the explorer held when it started: the explorer takes no new weights meanwhile
(`Explorer.poll`).
"""

from __future__ import annotations

import dataclasses
import time

from common.explorer.engine import SamplingConfig
from common.explorer.rollouts import Rollouts
from common.explorer.scoring import ScoreFuture, rollout_metrics
from common.tasks.processors import apply_task_processors


class Evaluation:
    """One held-out evaluation of the weights `explorer` holds now, the one before trainer step `step`."""

    def __init__(self, explorer, step: int):
        args = explorer.args
        self.explorer, self.step_number, self.version = explorer, step, explorer.version
        self.sampling = SamplingConfig(temperature=0, max_new_tokens=args.max_new_tokens, n=1)
        tasks, _ = apply_task_processors(explorer.eval_tasks, args.task_processors, args)
        self.rollouts = Rollouts(dataclasses.replace(explorer.workflow_ctx, token_budget=0))
        for i, task in enumerate(tasks):
            self.rollouts.start(task, i, 1)
        self.groups: list = []
        self.future: ScoreFuture | None = None
        self.started = time.time()

    def run(self) -> dict:
        """Generate to the end now, score, and return the metrics."""
        try:
            self.rollouts.generate(self.explorer.engine, self.sampling, self.version)
        finally:
            self.rollouts.close()  # the environment pool's threads, after an error too
        self._score()
        return self.result()

    def step(self, wait_s: float) -> None:
        """One engine step of the evaluation's episodes (with whatever else the engine runs); once every episode has
        ended, their scoring starts. `wait_s`: how long to wait for an environment when nothing of it decodes."""
        if self.future is None:
            self.rollouts.step(self.explorer.engine, self.sampling, self.version, wait_s=wait_s, stepwise=False)
            self.groups += self.rollouts.pop_finished()
            if not self.rollouts.workflows:
                self._score()

    def done(self) -> bool:
        """Generated and scored: `result` returns without waiting."""
        return self.future is not None and self.future.done()

    def result(self) -> dict:
        """eval/accuracy, eval/reward_mean, eval/version, eval/turns_mean; waits for the scores (up to --timeout-s)."""
        args = self.explorer.args
        flat = [(g, r) for g in self.groups for r in g.responses]
        scores = self.future.result(args.timeout_s)
        self.explorer.timeline.record("eval", self.started, time.time(), step=self.step_number, version=self.version)
        return {"eval/accuracy": sum(r.score >= 1.0 for r in scores) / len(scores), "eval/version": self.version,
                "eval/reward_mean": sum(r.score for r in scores) / len(scores),  # graded rewards (judge, rm)
                "eval/turns_mean": rollout_metrics(flat).get("rollout/turns_mean", 0.0)}

    def _score(self) -> None:
        ex, args = self.explorer, self.explorer.args
        self.groups += self.rollouts.pop_finished()
        self.rollouts.close()
        flat = [(g, r) for g in self.groups for r in g.responses]
        self.future = ScoreFuture(ex.rewards, flat, ex.tokenizer, args.env_reward, bool(args.reward_fn))
