"""The workflow runner (DESIGN.md "Workflows and environments"): `Rollouts` runs the workflows of the tasks in
flight on one explorer (common/explorer/workflow.py: the interface, the registry `WORKFLOWS`, the `Context` they
are given). Every engine call takes the next turn of *every* live sample of every task (single-turn responses and
episodes alike), so multi-turn episodes are batched turn by turn instead of run one after another. With vLLM
(`add` / `step`) there is one engine loop for all turns: an episode's next turn joins the running batch as soon as
its environment has answered, so no episode waits for the slowest of its turn. Environment steps (tool calls,
rendering) run in a thread pool beside the engine loop, never inside it (`--env-workers`).
"""

from __future__ import annotations

import dataclasses
import queue
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout

from common.explorer.engine import RolloutEngine, SamplingConfig
from common.explorer.workflow import Context, workflow_class, workflow_name

STEP_GRACE_S = 0.005  # how long the engine loop waits for an environment step it just handed to the pool


class Rollouts:
    """The workflows (one per task) in flight on one explorer. Environment steps, tool calls and observation
    rendering (`workflow.receive`) run in a thread pool, never inside the engine's decode loop: with vLLM a
    finished turn is handed to the pool and the engine keeps stepping the other requests; the episode's next turn
    joins the running batch when its step is done, so a slow tool delays its own episode only.

    Two ways to drive it: `generate` runs the workflows started so far to their end (a round: train_sync.py,
    train_offpolicy.py, evaluation); `step` advances every live sample by one engine step and returns, so the
    caller can start new workflows, take new weights and collect finished groups in between (the streaming
    explorer of train_async.py)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.workflows: list = []
        self.tokens = 0                 # sampled tokens kept so far
        self._pool: ThreadPoolExecutor | None = None
        self._pool_ctx: Context | None = None
        self._new: list = []            # workflows started since the last step: their first requests are due
        self._ready: list = []          # (workflow, sample, prompt ids, max new tokens) waiting for the engine
        self._decoding: dict = {}       # id(sample) -> (workflow, sample) of requests in the engine
        self._stepping: dict = {}       # id(sample) -> (workflow, sample, submitted at) in the environment pool
        self._answered: queue.Queue = queue.Queue()

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.ctx.env_workers, thread_name_prefix="env-step")
        return self._pool

    @property
    def groups(self) -> list:
        return [w.group for w in self.workflows]

    def start(self, task: dict, group_id: int, n: int) -> None:
        name = "agent" if self.ctx.agent or self.ctx.agent_cmd else workflow_name(task)
        workflow = workflow_class(name)
        if self.ctx.token_budget and not workflow.partial_rollouts:
            raise ValueError(f"task {task.get('id')}: --rollout-token-budget (partial rollouts) works with single-turn "
                             f"tasks only, not with workflow {name!r}")
        ctx = self.ctx
        if self.ctx.env_workers and workflow.env_pool:
            if self._pool_ctx is None:  # one copy, sharing the renderer (and its tokenizer lock) with self.ctx
                self._pool_ctx = dataclasses.replace(self.ctx, env_pool=self.pool, _renderer=self.ctx.renderer)
            ctx = self._pool_ctx
        self.workflows.append(workflow(task, group_id, n, ctx))
        self._new.append(self.workflows[-1])

    def unfinished(self) -> list:
        return [s for w in self.workflows for s in w.group.responses if s.finish_reason is None]

    def generate(self, engine: RolloutEngine, sampling: SamplingConfig, version: int, between_steps=None) -> dict:
        """Engine calls until every workflow has finished (with --rollout-token-budget: one call, one segment per
        unfinished response). Each call carries the next turn of every live sample; an engine that steps (vLLM:
        `add` / `step`) runs all turns in one loop instead, each turn joining the running batch when it is ready.
        `between_steps`, where the engine steps (vLLM, --mid-generation-updates), runs after every engine step:
        newer weights may land there and each token's version is reported."""
        continued = sum(s.segments > 0 for s in self.unfinished())
        tokens = self.tokens
        if engine.streams and not self.ctx.token_budget:
            while self._stepping or any(not w.finished() for w in self.workflows):
                self.step(engine, sampling, version, stepwise=between_steps is not None)
                if between_steps is not None:
                    between_steps()
            return {"continued": continued, "engine_calls": 1, "tokens": self.tokens - tokens}
        deadline = time.monotonic() + self.step_bound_s
        while any(w.starting() for w in self._new):  # a round starts with every environment reset
            if time.monotonic() > deadline:
                raise RuntimeError(f"explorer: waited {self.step_bound_s:g}s (twice --env-step-timeout-s, and 60 s) "
                                   "for environment resets")
            time.sleep(0.005)
        self._new = []
        hook = {"between_steps": between_steps} if between_steps is not None else {}
        calls = 0
        while True:
            todo = [(w, *req) for w in self.workflows for req in [*w.requests(), *w.arrivals()]]
            if not todo:
                if all(w.finished() for w in self.workflows):
                    break
                time.sleep(0.005)  # an agent is between calls
                continue
            generations = self._generate(engine, todo, sampling, **hook)
            calls += 1
            if not self.ctx.env_workers:
                self.tokens += sum(w.receive(s, g, version) for w, s, g in generations)
            else:  # the turn's environment steps run in parallel
                steps = [(s, self.pool.submit(w.receive, s, g, version)) for w, s, g in generations]
                self.tokens += sum(self._wait(s, f) for s, f in steps)
            if self.ctx.token_budget:
                break
        return {"continued": continued, "tokens": self.tokens - tokens, "engine_calls": calls}

    @staticmethod
    def _generate(engine, todo: list, sampling: SamplingConfig, **hook) -> list:
        """One batched engine call over `todo` (workflow, sample, prompt ids, cap): (workflow, sample, Generation)."""
        turn = dataclasses.replace(sampling, n=1, max_new_tokens=max(cap for *_, cap in todo))
        images = [s.images for _, s, _, _ in todo]
        pictures = {"images": images} if any(im is not None for im in images) else {}
        generations = engine.generate([ids for _, _, ids, _ in todo], turn, **hook, **pictures)
        return [(w, s, g) for (w, s, _, _), (g,) in zip(todo, generations)]

    def step(self, engine: RolloutEngine, sampling: SamplingConfig, version: int, wait_s: float = 1.0,
             stepwise: bool = True) -> None:
        """One engine step over every live sample of every workflow in flight. The first requests of workflows
        started since the last step, and the next turns of episodes whose environment has answered, join the
        running batch; a finished turn goes to the environment pool (stepped inline with --env-workers 0), so an
        episode waiting on a tool holds no decode slot. With nothing to decode this waits up to `wait_s` for an
        environment to answer (the only wait here). An engine without `step` (HF generate: no continuous batching)
        makes one batched call over every request ready now, to its end. `stepwise`: the engine reports each
        token's weights version (weights may change between steps)."""
        for workflow in [w for w in self._new if not w.starting()]:  # set up (multi_turn: environments reset)
            self._ready += [(workflow, *request) for request in workflow.requests()]
            self._new.remove(workflow)
        for workflow in self.workflows:  # an agent's calls
            self._ready += [(workflow, *request) for request in workflow.arrivals()]
        stepping = engine.streams
        busy = bool(self._ready) or stepping and engine.running(self) > 0
        if self._stepping:  # a quick environment step rejoins at once; an idle engine waits for one
            newest = max(t for *_, t in self._stepping.values())
            self._collect(max(0.0, newest + STEP_GRACE_S - time.monotonic()) if busy else wait_s)
        elif not busy and (self._new or not all(w.finished() for w in self.workflows)):  # resets, agents: no spin
            time.sleep(min(wait_s, 0.005))
        turn = dataclasses.replace(sampling, n=1)
        if stepping:
            for workflow, sample, ids, cap in self._ready:
                self._decoding[id(sample)] = (workflow, sample)
                engine.add(self, id(sample), ids, cap, turn, stepwise=stepwise)
            self._ready = []
            finished = [(*self._decoding.pop(key), g) for key, g in engine.step(self)] if engine.running(self) else []
        elif self._ready:
            todo, self._ready = self._ready, []
            finished = self._generate(engine, todo, turn)
        else:
            finished = []
        for workflow, sample, generation in finished:
            if not self.ctx.env_workers:  # inline, between engine steps (the reference path)
                self.tokens += workflow.receive(sample, generation, version)
                self._ready += [(workflow, *r) for r in workflow.requests() if r[0] is sample]
            else:
                self._stepping[id(sample)] = (workflow, sample, time.monotonic())
                future = self.pool.submit(workflow.receive, sample, generation, version)
                future.add_done_callback(lambda f, key=id(sample): self._answered.put((key, f)))

    def _collect(self, timeout: float) -> None:
        """Take the answers of environment steps (waiting up to `timeout` for the first): their episodes' next
        requests become ready. Fails, naming the group, once a step is older than `step_bound_s`."""
        deadline = time.monotonic() + timeout
        while self._stepping:
            try:
                remaining = deadline - time.monotonic()
                key, future = self._answered.get(timeout=remaining) if remaining > 0 else self._answered.get_nowait()
            except queue.Empty:
                key, (_, sample, since) = min(self._stepping.items(), key=lambda kv: kv[1][2])
                if time.monotonic() - since > self.step_bound_s:
                    raise RuntimeError(f"explorer: waited {self.step_bound_s:g}s (twice --env-step-timeout-s, and "
                                       f"60 s) for an environment step of group {self._group_of(sample)}") from None
                return
            workflow, sample, _ = self._stepping.pop(key)
            self.tokens += future.result()  # an exception here is a bug of ours (receive catches the env's)
            self._ready += [(workflow, *r) for r in workflow.requests() if r[0] is sample]
            deadline = min(deadline, time.monotonic())  # got one: take the others already there, wait no more

    @property
    def in_engine(self) -> int:
        """Samples whose request is in the engine or waiting for it (the rest wait on an environment)."""
        return len(self._decoding) + len(self._ready)

    def _wait(self, sample, future) -> int:
        try:
            return future.result(timeout=self.step_bound_s)
        except FutureTimeout:
            raise RuntimeError(f"explorer: waited {self.step_bound_s:g}s (twice --env-step-timeout-s, and 60 s) "
                               f"for an environment step of group {self._group_of(sample)}") from None

    @property
    def step_bound_s(self) -> float:
        """How long a `receive` may take: its environment calls (step, then close) are each bounded by
        --env-step-timeout-s and end only their episode, so a longer wait is a bug of ours, not a slow environment."""
        return 2 * self.ctx.env_step_timeout_s + 60

    def _group_of(self, sample) -> str:
        for w in self.workflows:
            if any(s is sample for s in w.group.responses):
                return f"{w.group.group_id} (task {w.group.task.get('id')})"
        return "?"

    def close(self) -> None:
        """Let the environment pool's threads go (a step still running finishes in its thread)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool, self._pool_ctx = None, None

    def pop_finished(self) -> list:
        """The groups whose samples have all ended and whose last environment call returned (removed from here),
        oldest first."""
        stepping = {id(w) for w, *_ in self._stepping.values()}  # a receive still running (closing its env)
        done = [w for w in self.workflows if w.finished() and id(w) not in stepping]
        self.workflows = [w for w in self.workflows if w not in done]
        return [w.group for w in done]


def run_episodes(engine, ctx: Context, tasks: list[dict], sampling: SamplingConfig) -> list:
    """Convenience for evaluation, tests and benchmarks: run every task's workflow to the end; the groups."""
    rollouts = Rollouts(dataclasses.replace(ctx, token_budget=0))
    for i, task in enumerate(tasks):
        rollouts.start(task, i, sampling.n)
    t0 = time.time()
    try:
        counts = rollouts.generate(engine, dataclasses.replace(sampling, n=1), 0)
    finally:
        rollouts.close()
    counts["seconds"] = time.time() - t0
    groups = rollouts.pop_finished()
    return groups, counts
