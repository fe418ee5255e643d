"""The held-out evaluation: every evaluation task once, greedy, scored as training samples are; its accuracy is the
share of scores of 1, with a bootstrap interval over the tasks. With --eval-samples N > 1 every task gets N samples
at the run's sampling and the accuracy is mean@N, next to pass@N and maj@N (common/explorer/eval_metrics.py).
`Evaluation` runs either to its end at once (`run`: train_sync.py, train_offpolicy.py) or one
engine step at a time beside the streaming explorer's groups (`step`: train_async.py), its requests then sharing
the engine's running batch with theirs, so the trainer's first batch is not held back by the evaluation before it.
Both measure the weights the explorer held when it started: it is given the explorer's parts
(common/explorer/parts.py) and that version, and the stream takes no new weights meanwhile (`Stream.poll`).
"""

from __future__ import annotations

import dataclasses
import time

from common.explorer import eval_metrics
from common.explorer.engine import SamplingConfig
from common.explorer.parts import Parts, ScoreFuture, rollout_metrics
from common.explorer.rollouts import Rollouts
from common.tasks.processors import apply_task_processors


def eval_due(step: int, first_step: int, every: int) -> bool:
    """Whether an evaluation comes before trainer step `step`: before the first step of a run (`first_step`) and
    every --eval-every steps (the last one comes after training); never with --eval-every 0."""
    return bool(every) and (step == first_step or (step - 1) % every == 0)


class Evaluation:
    """One held-out evaluation of weights `version` (the ones `parts.engine` holds now), the one before trainer
    step `step`, on `tasks` (default: the explorer's held-out tasks)."""

    def __init__(self, parts: Parts, version: int, step: int, tasks: list[dict] | None = None):
        args = parts.args
        self.parts, self.step_number, self.version = parts, step, version
        self.samples = args.eval_samples
        self.sampling = (SamplingConfig(temperature=0, max_new_tokens=args.max_new_tokens, n=1) if self.samples == 1
                         else SamplingConfig(args.temperature, args.top_p, args.max_new_tokens, n=1))
        tasks, _ = apply_task_processors(parts.eval_tasks if tasks is None else tasks, args.task_processors, args)
        self.rollouts = Rollouts(dataclasses.replace(parts.workflow_ctx, token_budget=0))
        for i, task in enumerate(tasks):
            self.rollouts.start(task, i, self.samples)
        self.groups: list = []
        self.future: ScoreFuture | None = None
        self._outcomes: tuple[list, list] | None = None
        self.started = time.time()

    def run(self) -> dict:
        """Generate to the end now, score, and return the metrics."""
        self.generate()
        return self.result()

    def generate(self) -> None:
        """Generate to the end now and start the scoring (`outcomes`, `result` wait for it)."""
        try:
            self.rollouts.generate(self.parts.engine, self.sampling, self.version)
        finally:
            self.rollouts.close()  # the environment pool's threads, after an error too
        self._score()

    def step(self, wait_s: float) -> None:
        """One engine step of the evaluation's episodes (with whatever else the engine runs); once every episode has
        ended, their scoring starts. `wait_s`: how long to wait for an environment when nothing of it decodes."""
        if self.future is None:
            self.rollouts.step(self.parts.engine, self.sampling, self.version, wait_s=wait_s, stepwise=False)
            self.groups += self.rollouts.pop_finished()
            if not self.rollouts.workflows:
                self._score()

    def done(self) -> bool:
        """Generated and scored: `result` returns without waiting."""
        return self.future is not None and self.future.done()

    def outcomes(self) -> tuple[list[list[bool]], list[list]]:
        """Per task, in the order of the tasks: whether each sample scored 1, and the answer its verifier extracted
        (Reward.info "answer_key", else "pred"; None: none). Waits for the scores (up to --timeout-s)."""
        if self._outcomes is None:
            scores = iter(self.future.result(self.parts.args.timeout_s))
            rewards = [[next(scores) for _ in g.responses] for g in self.groups]
            self._outcomes = ([[r.score >= 1.0 for r in rs] for rs in rewards],
                              [[r.info.get("answer_key", r.info.get("pred")) for r in rs] for rs in rewards])
            self.reward_mean = sum(r.score for rs in rewards for r in rs) / max(1, sum(map(len, rewards)))
        return self._outcomes

    def result(self) -> dict:
        """eval/accuracy (mean@N with N samples a task) and its interval (eval/accuracy_lo, _hi), with N > 1
        eval/pass@N and eval/maj@N with theirs; eval/reward_mean (graded rewards: judge, rm), eval/samples,
        eval/version, eval/turns_mean. Waits for the scores."""
        args = self.parts.args
        correct, answers = self.outcomes()
        self.parts.timeline.record("eval", self.started, time.time(), step=self.step_number, version=self.version)
        values = eval_metrics.per_task(correct, answers, [self.samples] if self.samples > 1 else [], args.seed)
        values["accuracy"] = values.pop(f"mean@{min(map(len, correct))}")
        flat = [(g, r) for g in self.groups for r in g.responses]
        out = {"eval/samples": self.samples, "eval/version": self.version, "eval/reward_mean": self.reward_mean,
               "eval/turns_mean": rollout_metrics(flat).get("rollout/turns_mean", 0.0)}
        for name, s in eval_metrics.summarize(values, args.seed).items():
            out.update({f"eval/{name}": s["value"], f"eval/{name}_lo": s["lo"], f"eval/{name}_hi": s["hi"]})
        return out

    def _score(self) -> None:
        self.groups += self.rollouts.pop_finished()
        self.groups.sort(key=lambda g: g.group_id)  # the order of the tasks (they finish in any order)
        self.rollouts.close()
        self.future = self.parts.score([(g, r) for g in self.groups for r in g.responses])
