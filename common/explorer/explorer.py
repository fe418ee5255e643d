"""The explorer side shared by every schedule: sample tasks, generate with the rollout engine, score with the
reward models, and package the results as experiences. Also the held-out evaluation (greedy).

Generation goes through the tasks' workflows (common/explorer/workflow.py: single_turn, or multi_turn for tasks that
name an environment), all advanced together by `Rollouts`, one of the explorer's `Parts` (common/explorer/parts.py:
what it is built of; they also score and package). Two ways to run them:
- in rounds (`rollout`: train_sync.py, train_offpolicy.py): --tasks-per-step groups started and generated to their
  end, then scored together. Single-turn responses are partial rollouts (common/explorer/groups.py): with
  --rollout-token-budget 0 every group ends in the step it started; with a budget, unfinished responses are
  continued in later steps (Kimi k1.5 partial rollouts).
- streaming (`Stream`, common/explorer/streaming.py: train_async.py, given the parts and the weight sync):
  --inflight-groups held at once, a new group started the moment one ends, each scored at once.
"""

from __future__ import annotations

import tempfile
import time
import torch

from common.explorer.engine import (HFEngine, RolloutEngine, SamplingConfig, StaticCacheSize, resolve_engine,
                                    resolve_judge_engine, use_static_cache)
from common.experience import Experience, RolloutBatch, zero_signal_groups
from common.lora import LoraSpec, sync_mode
from common.runtime import cores
from common.runtime.metrics import Timeline
from common.model import DTYPES, chat_prompt_ids, load_model, load_tokenizer, resolve_model, save_servable_tiny
from common.tasks import tasksets_of
from common.explorer.evaluation import Evaluation, eval_due
from common.explorer.parts import Parts
from common.explorer.rollouts import Rollouts
from common.explorer.workflow import Context
from common.tasks.processors import apply_task_processors
from common.vlm import is_vlm, load_processor
from rewards import RewardPool, UserReward, score


def judge_loader(args):
    """What the reward pool's served judge loads: `VLLMJudge` for --judge-engine vllm (auto: the explorers' rule on
    --judge-device, resolved here for explorers built directly), None for its own HF judge."""
    if not args.judge_model or args.judge_url:
        return None
    if args.judge_engine == "auto":  # entry scripts resolve it in prepare_run
        args.judge_engine = resolve_judge_engine(args)[0]
    if args.judge_engine != "vllm":
        return None
    from common.explorer.judge_vllm import VLLMJudge

    return VLLMJudge


def build_engine(args, device) -> tuple[RolloutEngine, object]:
    """The rollout engine for `--engine` (hf: transformers generate, vllm: common/explorer/engine_vllm.py) and its
    tokenizer. vLLM loads folders: `--model tiny` is saved to a temporary folder in out_dir first (the initial
    weight sync replaces whatever it holds)."""
    tokenizer = load_tokenizer(args.model, args.chat_template)
    if args.engine == "auto":  # entry scripts resolve it in prepare_run; this is for explorers built directly
        args.engine = resolve_engine(args.engine, resolve_model(args.model), [str(device)])[0]
    # the explorer gets LoRA adapters (vLLM keeps those within --max-staleness of the newest loaded), or merged weights
    adapters = LoraSpec.from_args(args) if sync_mode(args) == "adapters" else None
    if args.engine == "vllm":
        from common.explorer.engine_vllm import VLLMEngine

        tiny_dir = tempfile.TemporaryDirectory(prefix=".tiny-vllm-", dir=args.out_dir) if args.model == "tiny" else None
        path = save_servable_tiny(tiny_dir.name, seed=args.seed) if tiny_dir else resolve_model(args.model)
        engine = VLLMEngine(path, tokenizer=tokenizer, dtype=args.dtype, device=str(device), seed=args.seed,
                            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                            kv_cache_gb=args.vllm_kv_cache_gb, lora=adapters, lora_versions=args.max_staleness + 1,
                            max_model_len=args.vllm_max_model_len or None, enforce_eager=args.vllm_enforce_eager)
        engine.model_dir = tiny_dir  # removed when the engine goes
        return engine, tokenizer
    model = load_model(args.model, device, DTYPES[args.dtype], seed=args.seed)
    static = None
    if use_static_cache(args.hf_cache, torch.device(device).type, is_vlm(args.model, resolve_model(args.model))):
        # positions: planned by common/memory.py before the run; explorers built directly (tests) guess
        static = StaticCacheSize.plan(args.rollout_batch_size, args.hf_cache_tokens or args.max_new_tokens + 512)
    return HFEngine(model, tokenizer, freeze=args.freeze, static_cache=static, lora=adapters), tokenizer


def build_processor(args, tokenizer):
    """A VLM policy's processor (common/vlm.py), None for a text-only model."""
    path = resolve_model(args.model)
    return load_processor(args.model, path, tokenizer) if is_vlm(args.model, path) else None


class Explorer:
    def __init__(self, args, device, timeline: Timeline, index: int = 0):
        self.args, self.timeline, self.index = args, timeline, index
        cores.record_to(timeline)
        cores.widen()  # no trainer computes before the first batch: their cores too, for what this builds and starts
        torch.manual_seed(args.seed + 1000 * index)  # explorers sample differently, reproducibly
        self.engine, tokenizer = build_engine(args, device)
        if self.engine.describe():
            print(f"[tandem] explorer{index}: {self.engine.describe()}", flush=True)
        start = time.time()  # compiles the decode step, where there is one to compile, before the first rollout
        if self.engine.warm_up(chat_prompt_ids(tokenizer, {"prompt": "warm up"})):
            self.timeline.record("warm-up", start, time.time())
            print(f"[tandem] explorer{index}: decode step compiled and captured in {time.time() - start:.0f} s",
                  flush=True)
        train_tasks, eval_tasks = tasksets_of(args, index)
        workflow_ctx = Context.from_args(tokenizer, args, build_processor(args, tokenizer))
        rewards = RewardPool(num_workers=args.reward_workers, timeout_s=args.reward_timeout_s,
                             score_fn=UserReward(args.reward_fn) if args.reward_fn else score,
                             rm_model=args.rm_model, judge_model=args.judge_model, memory_mb=args.reward_memory_mb,
                             judge_url=args.judge_url, judge_api_key_env=args.judge_api_key_env,
                             judge_device=args.judge_device, judge_timeout_s=args.judge_timeout_s,
                             judge_concurrency=args.judge_concurrency, judge_loader=judge_loader(args),
                             judge_max_model_len=args.judge_max_model_len)
        sampling = SamplingConfig(args.temperature, args.top_p, args.max_new_tokens, args.samples_per_task)
        self.parts = Parts(args, index, device, self.engine, sampling, workflow_ctx, Rollouts(workflow_ctx),
                           train_tasks, eval_tasks, rewards, timeline)  # what its stream and evaluations are given
        self.version = 0  # of the weights the engine holds: set by `pull` / `take_final` (a Stream keeps its own)
        self.weights = None  # the weight sync (`connect`)
        self.first_step = 1

    # ------------------------------------------------------------------ weights: the explorer's version is its sync's
    def connect(self, weights) -> None:
        """Take weights through `weights` (common/weight_sync: make_weight_sync for this explorer's engine)."""
        self.weights = weights

    def pull(self, step: int) -> int:
        """Wait for the next weights the trainer sends (common/weight_sync `pull`); returns their version."""
        self.version = self.weights.pull(step)
        return self.version

    def take_final(self, step: int) -> int:
        """At the end of the run: every send still owed, up to the trainer's final weights."""
        self.version = self.weights.take_final(step)
        return self.version

    def skip_to(self, step: int):
        """On resume: continue the task stream where the trainer's step count says it was."""
        self.parts.train_tasks.position = step * self.args.tasks_per_step
        self.first_step = step + 1

    def rollout(self, step: int) -> tuple[list[Experience], dict]:
        """One generation round with the current weights over tasks_per_step new tasks x samples_per_task responses
        and every response still unfinished from earlier steps; returns the experiences of the groups that ended
        (every group, when partial rollouts are off; possibly none while long responses are still in flight).
        With --refill-rounds, zero-signal groups are replaced by extra rounds (`refill`)."""
        experiences, metrics = self._round(step, self.args.tasks_per_step)
        return self.refill(step, experiences, metrics) if self.args.refill_rounds else (experiences, metrics)

    def refill(self, step: int, experiences: list[Experience], metrics: dict) -> tuple[list[Experience], dict]:
        """ALGO LOGIC: DAPO's dynamic sampling with refill (arXiv:2503.14476 sec. 3.2): groups whose rewards are all
        equal are dropped, and as many new tasks as are missing are rolled out again, at most --refill-rounds extra
        rounds, until --tasks-per-step groups carry a signal (fewer when the rounds run out). The row gets the
        share of zero-signal groups among all generated and the extra rounds; its times add up every round."""
        n, zero = self.args.tasks_per_step, zero_signal_groups(experiences)
        generated, uniform, rounds = len({e.group_id for e in experiences}), len(zero), 0
        kept = [e for e in experiences if e.group_id not in zero]
        while len({e.group_id for e in kept}) < n and rounds < self.args.refill_rounds:
            rounds += 1
            more, extra = self._round(step, n - len({e.group_id for e in kept}))
            zero = zero_signal_groups(more)
            generated, uniform = generated + len({e.group_id for e in more}), uniform + len(zero)
            kept += [e for e in more if e.group_id not in zero]
            for key in ("time/rollout", "time/reward"):
                metrics[key] += extra[key]
        metrics.update({"rollout/zero_signal_frac": uniform / max(generated, 1), "rollout/refill_rounds": rounds})
        return kept, metrics

    def _round(self, step: int, num_tasks: int) -> tuple[list[Experience], dict]:
        """`rollout`'s generation round over `num_tasks` new tasks."""
        args, p = self.args, self.parts
        tasks = p.train_tasks.next_batch(num_tasks, progress=self.version / args.steps)
        tasks, task_counts = apply_task_processors(tasks, args.task_processors, args)
        for task in tasks:
            p.start_group(task)
        t0 = time.time()
        with self.timeline.phase("rollout", step=step, version=self.version):
            generated = p.in_flight.generate(self.engine, p.sampling, self.version)
        generated_s = time.time() - t0
        groups = p.in_flight.pop_finished()
        future = p.score([(g, r) for g in groups for r in g.responses])
        t1 = time.time()
        with self.timeline.phase("reward", step=step):
            scores = future.result(timeout=args.timeout_s)
        t2 = time.time()
        self.timeline.record("reward-in-flight", future.submitted_at, future.done_at, step=step)
        generated["tasks"] = task_counts
        return p.package(groups, scores, generated, generated_s, t2 - t1, self.version)

    def eval_due(self, step: int) -> bool:
        """Before the first step of a run and every --eval-every steps (the last one comes after training); never
        with --eval-every 0."""
        return eval_due(step, self.first_step, self.args.eval_every)

    def hand_over(self, queue, batch: RolloutBatch) -> None:
        """Put a round's batch in the queue (it waits while the queue is full), the trainers' cores given back first:
        they compute as soon as they have it."""
        cores.narrow(self.engine)
        with self.timeline.phase("wait", put=f"{self.index}-{batch.step}"):
            queue.put(batch, self.args.timeout_s)

    def final_evaluation(self, step: int) -> dict:
        """The evaluation after the last step ({} with --eval-every 0: no evaluation at all), on the trainers' cores
        too: they have finished."""
        cores.widen(self.engine)
        return self.evaluate(step) if self.args.eval_every else {}

    def evaluate(self, step: int) -> dict:
        """Greedy accuracy on the held-out tasks (common/explorer/evaluation.py), generated to the end now."""
        return Evaluation(self.parts, self.version, step).run()

    def close(self):
        self.parts.in_flight.close()
        self.parts.rewards.close()
        self.engine.close()
