"""The streaming explorer of train_async.py: --inflight-groups groups held at once, a new group started the moment
one ends, each ended group scored at once, the first --tasks-per-step scored sent as a batch. A group starts only
within --max-staleness versions of the explorer's weights (AReaL's admission rule).

`Stream` holds the streaming state of one explorer: it is given the explorer's parts (common/explorer/parts.py:
engine, workflows in flight, task stream, reward pool) and its weight sync, and keeps the weights version it
generates with; the rounds of train_sync.py and train_offpolicy.py are `Explorer.rollout`. Its stream positions are
common/tasks/stream.py's `StreamPositions`. A held-out evaluation runs inside the stream
(`start_evaluation`): its greedy requests join the groups' running batch instead of stopping them. What happens at a
hand-over is the stream's too (`hand_over`): the trainers' cores given back, the put that takes pending weights
while the queue is full.
"""

from __future__ import annotations

import time

from common.experience import RolloutBatch, zero_signal_groups
from common.explorer.evaluation import Evaluation, eval_due
from common.explorer.parts import Parts
from common.runtime import cores
from common.tasks.processors import apply_task_processors
from common.tasks.stream import StreamPositions


class Stream:
    def __init__(self, parts: Parts, weights=None, positions: StreamPositions | None = None, store=None,
                 control=None):
        """`weights`: the explorer's weight sync (common/weight_sync), after its first `pull`; `positions`: where
        the stream starts (default: a fresh run's); `store`: the run's (the trainers lend their cores while they
        wait, common/runtime/cores.py); `control`: evaluations go to the trainer there (explorer 0 only: one
        measures held-out accuracy for the run)."""
        self.parts, self.args, self.weights = parts, parts.args, weights
        self.positions, self.store, self.control = positions or StreamPositions(self.args), store, control
        parts.train_tasks.position = self.positions.start
        self.version = weights.version if weights is not None else 0  # of the weights the engine holds (`poll`)
        # tasks drawn and not started, groups being scored and scored, the stream position and start time of every
        # group in flight, what happened since the last batch
        self.drawn: list[tuple[int, dict]] = []
        self.scoring: list = []
        self.scored: list = []
        self.position_of: dict[int, tuple[int, float]] = {}
        self.task_counts: dict = {}
        self.groups_seen: list[int] = []
        self.busy_span: tuple[float, float] | None = None
        self.batch_started: float | None = None  # the clock of rollout/engine_busy_frac starts with the stream
        self.batch_tokens, self.batch_busy = 0, 0.0
        self.batch_replaced = 0  # zero-signal groups replaced (--refill-rounds) for this batch
        self.evaluation: Evaluation | None = None  # the held-out evaluation in flight
        self.first_step = self.version + 1  # the stream's first trainer step (an evaluation may come before it)
        self.undecided = self.first_step  # the first trainer step whose evaluation is not decided yet
        self.sent = 0  # batches handed over

    def evaluate_when_due(self) -> None:
        """With the control channel: start the held-out evaluation due before a trainer step these weights may
        reach (--eval-every)."""
        due = (eval_due(s, self.first_step, self.args.eval_every) for s in range(self.undecided, self.version + 2))
        if self.control is not None and any(due):
            self.start_evaluation(self.sent)
        self.undecided = self.version + 2

    def start_evaluation(self, step: int) -> None:
        """Start the held-out evaluation before trainer step `step`; it advances with every `step` from now on,
        and the stream takes no new weights until `take_evaluation` has returned its result."""
        self.evaluation = Evaluation(self.parts, self.version, step)

    def take_evaluation(self, wait: bool = False) -> dict | None:
        """The evaluation's metrics once it is generated and scored (then it is over; with the control channel they
        go to the trainer); None before, or without one. `wait`: step until it is generated (the groups in flight
        step along), then wait for its scores."""
        while wait and self.evaluation is not None and self.evaluation.future is None:
            self._advance()
        if self.evaluation is None or not (wait or self.evaluation.done()):
            return None
        result, self.evaluation = self.evaluation.result(), None
        if self.control is not None:
            self.control.send("eval", result, self.parts.index)
        return result

    def poll(self) -> None:
        """New weights, if some are waiting; none while the held-out evaluation runs (it measures the weights it
        started with)."""
        if self.evaluation is None:
            self.weights.poll(self.sent)
            self.version = self.weights.version

    def idle(self) -> bool:
        """No group generating or being scored: nothing that new weights would interrupt."""
        return not (self.parts.in_flight.workflows or self.scoring)

    def start_groups(self) -> None:
        """Start new groups until --inflight-groups are generating or scored and not yet sent. Tasks are drawn from the stream
        --tasks-per-step at a time (the draws a round would make) and started one by one; stream positions already
        trained before a resume (`StreamPositions.skip`) are skipped; a task a processor drops counts as used. A group
        starts only where `StreamPositions.admits`: scored groups not yet in the queue count too, so while the
        queue is full the explorer does not run ahead (it would only make what it holds older)."""
        args, p = self.args, self.parts
        if self.batch_started is None:
            self.batch_started, self.batch_tokens, self.batch_busy = time.time(), p.in_flight.tokens, p.engine.busy_s
        while len(p.in_flight.workflows) + len(self.scoring) + len(self.scored) < args.inflight_groups \
                and self.positions.admits(self.next_position(), self.version):
            if not self.drawn:
                start = p.train_tasks.position
                tasks = p.train_tasks.next_batch(args.tasks_per_step, progress=self.version / args.steps)
                self.drawn = [(start + i, t) for i, t in enumerate(tasks) if start + i not in self.positions.skip]
                continue
            position, task = self.drawn.pop(0)
            kept, counts = apply_task_processors([task], args.task_processors, args)
            for name, dropped in counts.items():
                self.task_counts[name] = self.task_counts.get(name, 0) + dropped
            if not kept:
                self.positions.spend(position, replaced=False)
                continue
            self.position_of[p.start_group(kept[0])] = (position, time.time())

    def next_position(self) -> int:
        """The task stream position of the next group to start."""
        return self.drawn[0][0] if self.drawn else self.parts.train_tasks.position

    def step(self) -> None:
        """One engine step over every group in flight (Rollouts.step: waits only while no request is ready,
        at most a second, for an environment); the groups that ended go to the reward pool at once, and groups
        whose scoring is done join `scored`; with the control channel, an evaluation that is over goes to the
        trainer. First, the cores: the trainers' too while every trainer waits (common/runtime/cores.py `follow`)."""
        self._advance()
        if self.control is not None:
            self.take_evaluation()

    def _advance(self) -> None:
        p = self.parts
        cores.follow(self.store, p.engine)
        busy = p.engine.busy_s
        t0 = time.time()
        evaluating = self.evaluation.rollouts if self.evaluation is not None else None  # its workflows in flight
        # With an evaluation in flight neither side waits long for its environments while the other decodes.
        p.in_flight.step(p.engine, p.sampling, self.version,
                         wait_s=1.0 if evaluating is None else 0.0 if evaluating.in_engine else 0.05)
        if evaluating is not None:  # its own requests, in the same running batch
            self.evaluation.step(wait_s=0.0 if p.in_flight.in_engine else 0.005)
        if p.engine.busy_s > busy:  # the timeline's generate spans: consecutive busy steps merged
            self.busy_span = (self.busy_span[0], time.time()) if self.busy_span and t0 - self.busy_span[1] < 0.05 \
                else self._flush_busy_span() or (t0, time.time())
        self.groups_seen.append(len(p.in_flight.workflows))
        for group in p.in_flight.pop_finished():
            self.scoring.append((group, p.score([(group, r) for r in group.responses])))
        generating = p.in_flight.workflows or evaluating is not None and evaluating.workflows
        if not generating and not any(f.done() for _, f in self.scoring):
            time.sleep(0.005)  # nothing to generate, no score to collect (verifiers busy, or waiting for weights or
            # the run's end): do not spin
        for group, future in [gf for gf in self.scoring if gf[1].done()]:
            self.scoring.remove((group, future))
            scores = future.result(timeout=self.args.timeout_s)
            position, started = self.position_of[group.group_id]
            p.timeline.record("group", started, time.time(), group=group.group_id, task=position)
            if self._replace_zero_signal(group, scores):
                continue
            self.scored.append((group, scores, future))

    def _replace_zero_signal(self, group, scores: list) -> bool:
        """ALGO LOGIC: --refill-rounds in the stream: a scored group whose shaped rewards are all equal is left out
        (its position counted as used) and another is admitted in its place, at most --refill-rounds x
        --tasks-per-step per batch; beyond that it joins the batch (and the trainer's filter drops it)."""
        args = self.args
        if self.batch_replaced >= args.refill_rounds * args.tasks_per_step:
            return False
        if len({reward for reward, _ in self.parts.shaped([(group, r) for r in group.responses], scores)}) > 1:
            return False
        self.positions.spend(self.position_of.pop(group.group_id)[0], replaced=True)
        self.batch_replaced += 1
        return True

    def _flush_busy_span(self) -> None:
        if self.busy_span:
            self.parts.timeline.record("generate", *self.busy_span)
        self.busy_span = None

    def take_batch(self) -> RolloutBatch | None:
        """The first --tasks-per-step scored groups (in the order their scoring finished) as the next batch: their
        experiences, the metrics since the last batch, and the stream positions they used (tasks dropped by a
        processor and groups replaced included); None while fewer are scored."""
        p, n = self.parts, self.args.tasks_per_step
        if len(self.scored) < n:
            return None
        self._flush_busy_span()
        taken, self.scored = self.scored[:n], self.scored[n:]
        groups = [g for g, _, _ in taken]
        now, seconds = time.time(), time.time() - self.batch_started
        reward_s = sum(f.done_at - f.submitted_at for _, _, f in taken) / n
        # partial rollouts in the stream: a response's segments follow each other
        generated = {"tokens": p.in_flight.tokens - self.batch_tokens, "tasks": self.task_counts,
                     "continued": sum(max(r.segments - 1, 0) for g in groups for r in g.responses)}
        experiences, metrics = p.package(groups, [r for _, scores, _ in taken for r in scores], generated,
                                         seconds, reward_s, self.version)
        metrics["rollout/groups_in_flight"] = sum(self.groups_seen) / max(len(self.groups_seen), 1)
        metrics["rollout/engine_busy_frac"] = (p.engine.busy_s - self.batch_busy) / max(seconds, 1e-9)
        if self.args.refill_rounds:  # replaced groups, and those past the bound that came in anyway
            uniform = self.batch_replaced + len(zero_signal_groups(experiences))
            metrics.update({"rollout/zero_signal_frac": uniform / (self.batch_replaced + n),
                            "rollout/refill_rounds": self.batch_replaced / n})
            self.batch_replaced = 0
        positions = [self.position_of.pop(g.group_id)[0] for g in groups] + self.positions.take_used()
        self.task_counts, self.groups_seen = {}, []
        self.batch_started, self.batch_tokens, self.batch_busy = now, p.in_flight.tokens, p.engine.busy_s
        self.sent += 1
        return RolloutBatch(self.sent, experiences, metrics, p.index, positions)

    def hand_over(self, queue, batch: RolloutBatch, stop) -> None:
        """Put `batch` in the queue, with backpressure; the trainers' cores go back first (they compute as soon as
        they have it). While the queue is full the trainer may be waiting for this explorer to join a weight
        broadcast (one collective for all explorers), so a pending one is taken meanwhile, once an evaluation in
        flight (which holds the weights) has ended; the batch keeps the versions it was made with. Given up once
        the trainer has finished (`stop`): it would never be trained."""
        cores.handing_over(self.store, self.parts.engine)
        with self.parts.timeline.phase("wait", put=f"{batch.explorer}-{batch.step}"):
            for _ in range(int(self.args.timeout_s / 0.5)):
                if stop.is_set():
                    return
                try:
                    return queue.put(batch, timeout=0.5)
                except TimeoutError:
                    self.take_evaluation(wait=True)
                    self.poll()
        raise TimeoutError(f"explorer: experience queue stayed full for {self.args.timeout_s:.0f}s (trainer stalled?)")

    def stop(self) -> None:
        """Give up the groups in flight (their requests leave the engine; a resumed run starts them again); an
        evaluation in flight ends with the weights it started with."""
        if self.parts.engine.streams:
            self.parts.engine.abort(self.parts.in_flight)
        self.take_evaluation(wait=True)
