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


def build_engine(args, device) -> tuple[RolloutEngine, object]:
    """The rollout engine for `--engine` (hf: transformers generate, vllm: common/engine_vllm.py) and its tokenizer."""
    tokenizer = load_tokenizer(args.model)
    if args.engine == "vllm":
        return build_vllm_engine(args, device, tokenizer), tokenizer
    model = load_model(args.model, device, DTYPES[args.dtype], seed=args.seed)
    return HFEngine(model, tokenizer), tokenizer


def build_vllm_engine(args, device, tokenizer):
    """VLLMEngine on this explorer's device; `--model tiny` is saved to a temporary folder in out_dir first (vLLM
    loads folders). The initial weight sync replaces whatever the folder holds."""
    import tempfile

    from common.engine_vllm import VLLMEngine, save_servable_tiny
    from common.model import resolve_model

    tiny_dir = tempfile.TemporaryDirectory(prefix=".tiny-vllm-", dir=args.out_dir) if args.model == "tiny" else None
    path = save_servable_tiny(tiny_dir.name, seed=args.seed) if tiny_dir else resolve_model(args.model)
    engine = VLLMEngine(path, tokenizer=tokenizer, dtype=args.dtype, device=str(device), seed=args.seed,
                        gpu_memory_utilization=args.vllm_gpu_memory_utilization, kv_cache_gb=args.vllm_kv_cache_gb)
    engine.model_dir = tiny_dir  # removed when the engine goes
    return engine


class Explorer:
    def __init__(self, args, device, timeline: Timeline, index: int = 0):
        from rewards import RewardPool

        self.args, self.timeline, self.index = args, timeline, index
        torch.manual_seed(args.seed + 1000 * index)  # explorers sample differently, reproducibly
        self.engine, self.tokenizer = build_engine(args, device)
        self.train_tasks, self.eval_tasks = build_tasksets(args.taskset, args.eval_taskset, args.difficulty,
                                                           args.eval_size, args.seed + 1000 * index)
        self.rewards = RewardPool(num_workers=1)
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
        with self.timeline.phase("rollout", step=step, version=self.version):
            generations = self.engine.generate(prompts, self.sampling)
        t1 = time.time()
        flat = [(task, g) for task, gs in zip(tasks, generations) for g in gs]
        with self.timeline.phase("reward", step=step):
            texts = [self.tokenizer.decode(g.response_ids, skip_special_tokens=True) for _, g in flat]
            scores = self.rewards.score_batch(texts, [task for task, _ in flat])
        t2 = time.time()
        experiences = []
        for k, ((task, g), r) in enumerate(zip(flat, scores)):
            experiences.append(Experience(
                prompt_ids=g.prompt_ids, response_ids=g.response_ids, logprobs=g.logprobs,
                loss_mask=[1] * len(g.response_ids), reward=float(r.score), reward_info=r.info,
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
        }
        return experiences, metrics

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
        self.engine.close()
