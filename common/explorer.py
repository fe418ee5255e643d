"""The explorer side shared by every schedule: sample tasks, generate with the rollout engine, score with the
reward models, and package the results as experiences. Also the held-out evaluation (greedy).
"""

from __future__ import annotations

import time

import torch

from common.engine import HFEngine, RolloutEngine, SamplingConfig
from common.experience import Experience
from common.metrics import Timeline
from common.model import chat_prompt_ids, load_model, load_tokenizer
from common.tasks import build_tasksets
from common.trainer import DTYPES
from rewards import RewardFuture, RewardPool
from rewards.shaping import shape_batch


def build_engine(args, device) -> tuple[RolloutEngine, object]:
    """The rollout engine for `--engine` (HF generate for now) and its tokenizer."""
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, device, DTYPES[args.dtype], seed=args.seed)
    return HFEngine(model, tokenizer), tokenizer


def task_chunks(n_tasks: int, n_chunks: int) -> list[range]:
    """Task indices split into `n_chunks` contiguous, near-equal parts (--rollout-chunks)."""
    return [range(k * n_tasks // n_chunks, (k + 1) * n_tasks // n_chunks) for k in range(n_chunks)]


class Explorer:
    def __init__(self, args, device, timeline: Timeline, index: int = 0):
        self.args, self.timeline, self.index = args, timeline, index
        torch.manual_seed(args.seed + 1000 * index)  # explorers sample differently, reproducibly
        self.engine, self.tokenizer = build_engine(args, device)
        self.train_tasks, self.eval_tasks = build_tasksets(args.taskset, args.eval_taskset, args.difficulty,
                                                           args.eval_size, args.seed + 1000 * index)
        self.rewards = RewardPool(num_workers=args.reward_workers, timeout_s=args.reward_timeout_s,
                                  rm_model=args.rm_model, judge_model=args.judge_model)
        self.sampling = SamplingConfig(args.temperature, args.top_p, args.max_new_tokens, args.samples_per_task)
        self.version = 0
        self.next_group = 0
        self.first_step = 1

    def skip_to(self, step: int):
        """On resume: continue the task stream where the trainer's step count says it was."""
        self.train_tasks.position = step * self.args.tasks_per_step
        self.first_step = step + 1

    def rollout(self, step: int) -> tuple[list[Experience], dict]:
        """One rollout batch with the current weights: tasks_per_step tasks x samples_per_task responses."""
        tasks = self.train_tasks.next_batch(self.args.tasks_per_step)
        prompts = [chat_prompt_ids(self.tokenizer, t) for t in tasks]
        t0 = time.time()
        generations, futures = [], []
        with self.timeline.phase("rollout", step=step, version=self.version):
            for chunk in task_chunks(len(tasks), self.args.rollout_chunks):  # chunk k is scored while k+1 generates
                chunk_generations = self.engine.generate([prompts[i] for i in chunk], self.sampling)
                generations += chunk_generations
                futures.append(self.submit_rewards([tasks[i] for i in chunk], chunk_generations))
        t1 = time.time()
        flat = [(task, g) for task, gs in zip(tasks, generations) for g in gs]
        with self.timeline.phase("reward", step=step):
            scores = [r for future in futures for r in future.result(timeout=self.args.timeout_s)]
        t2 = time.time()
        hidden = self.record_reward_overlap(futures, t1, step)
        # ALGO LOGIC: shaping per sample group (--length-penalty, --format-reward); reward_info keeps the parts
        shaped = shape_batch(scores, [len(g.response_ids) for _, g in flat], self.args.samples_per_task,
                             self.args.length_penalty, self.args.format_reward)
        experiences = []
        for k, ((task, g), r, (reward, parts)) in enumerate(zip(flat, scores, shaped)):
            experiences.append(Experience(
                prompt_ids=g.prompt_ids, response_ids=g.response_ids, logprobs=g.logprobs,
                loss_mask=[1] * len(g.response_ids), reward=reward, reward_info={**r.info, **parts},
                group_id=self.next_group + k // self.args.samples_per_task, task_id=str(task["id"]),
                policy_version=self.version, finish_reason=g.finish_reason,
                timings={"rollout": t1 - t0, "reward": t2 - t1},
            ))
        self.next_group += len(tasks)
        n_tokens = sum(len(g.response_ids) for _, g in flat)
        metrics = {
            "time/rollout": t1 - t0, "time/reward": t2 - t1, "rollout/tokens_per_s": n_tokens / max(t1 - t0, 1e-9),
            "rollout/truncated_frac": sum(g.finish_reason == "length" for _, g in flat) / len(flat),
            "reward/failed": sum(bool(r.info.get("failed")) for r in scores),
            "reward/hidden_s": hidden, "reward/hidden_frac": hidden / max(hidden + t2 - t1, 1e-9),
        }
        for name in shaped[0][1]:  # raw, and each shaping term that is switched on
            metrics[f"reward/{name}_mean"] = sum(parts[name] for _, parts in shaped) / len(shaped)
        return experiences, metrics

    def submit_rewards(self, tasks: list[dict], generations: list[list]) -> RewardFuture:
        """Queue the responses of these tasks for scoring in the RewardPool; returns at once."""
        texts = [self.tokenizer.decode(g.response_ids, skip_special_tokens=True) for gs in generations for g in gs]
        return self.rewards.submit(texts, [task for task, gs in zip(tasks, generations) for _ in gs])

    def record_reward_overlap(self, futures: list[RewardFuture], generation_end: float, step: int) -> float:
        """Timeline strips for the scoring of each chunk; returns the seconds of scoring that ran during
        generation (hidden behind it), i.e. the union of the chunks' scoring spans before generation ended."""
        hidden, covered_to = 0.0, 0.0
        for f in sorted(futures, key=lambda f: f.submitted_at):
            self.timeline.record("reward-in-flight", f.submitted_at, f.done_at, step=step)
            start, end = max(f.submitted_at, covered_to), min(f.done_at, generation_end)
            hidden += max(0.0, end - start)
            covered_to = max(covered_to, f.done_at)
        return hidden

    def eval_due(self, step: int) -> bool:
        """Before the first step of a run and every --eval-every steps (the last one comes after training)."""
        return step == self.first_step or bool(self.args.eval_every and (step - 1) % self.args.eval_every == 0)

    def evaluate(self, step: int) -> dict:
        """Greedy accuracy on the held-out tasks (a score of 1 counts as correct)."""
        with self.timeline.phase("eval", step=step, version=self.version):
            prompts = [chat_prompt_ids(self.tokenizer, t) for t in self.eval_tasks]
            greedy = SamplingConfig(temperature=0, max_new_tokens=self.args.max_new_tokens, n=1)
            generations = [gs[0] for gs in self.engine.generate(prompts, greedy)]
            texts = [self.tokenizer.decode(g.response_ids, skip_special_tokens=True) for g in generations]
            scores = self.rewards.score_batch(texts, self.eval_tasks)
        return {"eval/accuracy": sum(r.score >= 1.0 for r in scores) / len(scores), "eval/version": self.version}

    def close(self):
        self.rewards.close()
