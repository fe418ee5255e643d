"""The trainer side shared by every schedule: policy + reference model (+ the critic of --algo ppo, common/critic.py),
experience filters, one train step over a rollout batch, checkpoints (atomic) and resume. Entry scripts decide
*when* it trains and syncs; this decides *how*.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import random
import shutil
import time

import numpy as np
import torch

from common.critic import Critic
from common.experience import Batch, Experience, collate
from common.metrics import MetricsLogger, Timeline
from common.losses import (behaviour_weights, clipped_surrogate_loss, dr_grpo_loss, gae_advantages, group_advantages,
                           kl_estimate, kl_penalized_rewards, masked_mean, masked_whiten, opmd_loss)
from common.fsdp import (full_state_dict, load_full_state_dict, load_optimizer_state, merged_named_weights,
                         optimizer_state, prepare_model, save_hf_folder)
from common.model import load_model, load_tokenizer, sequence_logprobs
from common.packing import batch_micro_batches, micro_batches
from common.parallel import DataParallel
from common.replay import ReplayBuffer
from common.weight_sync import full_tensor, weights_hash

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def filter_experiences(experiences: list[Experience], mask_truncated: bool,
                       drop_failed: bool) -> tuple[list[Experience], dict]:
    """ALGO LOGIC: experience filters before collate, each counted in the step's metrics. Non-finite rewards are
    always dropped, failed verifiers (reward_info["failed"]) when `drop_failed`; truncated responses (finish reason
    'length') keep their place in the group but get loss mask 0 when `mask_truncated`."""
    kept, invalid, truncated = [], 0, 0
    for e in experiences:
        if not math.isfinite(e.reward) or (drop_failed and e.reward_info.get("failed")):
            invalid += 1
            continue
        if mask_truncated and e.finish_reason == "length":
            e = dataclasses.replace(e, loss_mask=[0] * len(e.loss_mask))
            truncated += 1
        kept.append(e)
    return kept, {"filter/invalid_dropped": invalid, "filter/truncated_masked": truncated}


class Trainer:
    def __init__(self, args, device: torch.device, dp: DataParallel | None = None):
        self.args, self.device = args, device
        self.dp = dp or DataParallel()  # one trainer unless --trainer-devices lists several
        self.dp.sharded = args.trainer_shard == "fsdp"
        self.tokenizer = load_tokenizer(args.model)
        self.model = load_model(args.model, device, DTYPES[args.dtype], seed=args.seed)
        self.model.config.use_cache = False
        self.model.train()
        self.model = prepare_model(self.model, args, self.dp)  # checkpointing, LoRA, FSDP2 (common/fsdp.py)
        # The reference model only exists when something uses it (KL term): saves memory and a forward pass.
        self.ref_model = None
        if args.kl_coef > 0:
            self.ref_model = load_model(args.model, device, DTYPES[args.dtype], seed=args.seed).eval()
            self.ref_model.requires_grad_(False)
            self.ref_model = prepare_model(self.ref_model, args, self.dp, trainable=False)
        self.critic = None
        if args.algo == "ppo":
            self.critic = Critic(args, device, DTYPES[args.dtype], self.model.config.vocab_size, self.dp)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        self.step = 0        # trainer steps done
        self.version = 0     # version of the weights in self.model (one per optimizer-updating step)

    # ---------------------------------------------------------------- ALGO LOGIC: one step over a rollout batch
    def train_step(self, experiences: list[Experience]) -> dict:
        args = self.args
        experiences, filtered = filter_experiences(experiences, args.mask_truncated, args.drop_failed_rewards)
        if not experiences:  # every sample was invalid: nothing to learn from, the step still counts
            return {**self.skip_step(), **filtered}
        batch = collate(experiences, self.tokenizer.pad_token_id).to(self.device)
        ref_logprobs = self._logprobs(self.ref_model, batch) if self.ref_model is not None else None
        stats: dict[str, list[float]] = {}
        rewards = batch.rewards  # [B], or [B, T] per token once the KL is subtracted from the reward
        if ref_logprobs is not None and args.kl_mode == "reward":
            kl = kl_estimate(batch.old_logprobs, ref_logprobs, args.kl_estimator) * batch.response_mask
            rewards = kl_penalized_rewards(batch.rewards, kl, batch.response_mask, args.kl_coef)
            stats["kl"] = [masked_mean(kl, batch.response_mask).item()]
            ref_logprobs = None  # no KL loss term
        if self.critic is not None:  # ppo: per-token GAE advantages from the critic's values before this update
            old_values = self.critic.values(batch)
            advantages, returns = gae_advantages(rewards, old_values, batch.response_mask, args.gamma, args.lam)
            if args.normalize_std:
                advantages = masked_whiten(advantages, batch.response_mask)
        else:
            advantages = group_advantages(rewards if rewards.dim() == 1 else rewards.sum(-1), batch.group_ids,
                                          normalize_std=args.normalize_std and args.algo == "grpo")
        n = len(batch)
        trained = torch.arange(n)
        if args.drop_zero_signal_groups and self.critic is None:
            trained = trained[(advantages != 0).cpu()]
        update_actor = self.critic is None or self.step >= args.critic_warmup_steps
        # Off-policy correction: the proximal policy is this model before the update (AReaL / verl TIS). With one
        # epoch of one minibatch no sample is seen after an update, so the detached current log-probs are exactly
        # the proximal ones and the extra forward pass is skipped.
        correcting = args.off_policy_correction != "none"
        single_update = args.ppo_epochs == 1 and len(trained) <= args.minibatch_size
        prox_logprobs = (self._logprobs(self.model, batch)
                         if correcting and not single_update and update_actor else None)
        # Seeded by step: every data-parallel trainer walks the same order, and a resumed run the same as before.
        shuffle = torch.Generator().manual_seed(args.seed * 1_000_003 + self.step)
        for _ in range(args.ppo_epochs if len(trained) else 0):
            order = trained[torch.randperm(len(trained), generator=shuffle)]
            for start in range(0, len(order), args.minibatch_size):
                idx = order[start: start + args.minibatch_size]
                if update_actor:
                    self._minibatch_update(batch, advantages, ref_logprobs, correcting, prox_logprobs, idx, stats)
                if self.critic is not None:
                    self.critic.update(batch, idx, old_values, returns, stats)
        self.step += 1
        self.version += 1
        if args.ref_reset_every and self.step % args.ref_reset_every == 0:  # Kimi k1.5 / ProRL reference reset
            self.ref_model.load_state_dict(self.model.state_dict())  # sharded: shard to shard, same layout
            stats["ref_reset"] = [1.0]
        tokens = batch.response_mask.sum().item()
        out = {"loss": 0.0, "grad_norm": 0.0, "clip_frac": 0.0, **filtered}  # what a step without an update reports
        out.update({k: float(np.mean(v)) for k, v in stats.items()})
        if self.critic is not None:
            mask = batch.response_mask
            residual_var = masked_mean((returns - old_values - masked_mean(returns - old_values, mask)) ** 2, mask)
            returns_var = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
            out.update({"returns/mean": masked_mean(returns, mask).item(), "actor_frozen": float(not update_actor),
                        "value/explained_var": (1 - residual_var / returns_var).item() if returns_var > 0 else 0.0})
        out.update({
            "reward/mean": batch.rewards.mean().item(), "reward/std": batch.rewards.std(unbiased=False).item(),
            "response/tokens_mean": tokens / n, "filter/zero_signal_frac": 1 - len(trained) / n,
            "staleness/mean": (self.version - 1 - batch.versions.float()).mean().item(),
            "staleness/max": (self.version - 1 - batch.versions).max().item(),
        })
        return out

    def skip_step(self) -> dict:
        """A step with nothing to train (partial rollouts: no group has finished yet; every sample filtered out). It
        still counts, as a step and a version, so every schedule keeps one version per trainer step."""
        self.step += 1
        self.version += 1
        return {"loss": 0.0, "grad_norm": 0.0, "clip_frac": 0.0}

    def drop_stale(self, experiences: list[Experience], max_staleness: int) -> tuple[list[Experience], int]:
        """Keep samples at most `max_staleness` versions behind the weights about to be updated."""
        kept = [e for e in experiences if self.version - e.policy_version <= max_staleness]
        return kept, len(experiences) - len(kept)

    def _minibatch_update(self, batch: Batch, advantages, ref_logprobs, correcting, prox_logprobs, idx, stats):
        args = self.args
        # grpo averages over tokens; dr_grpo and opmd over sequences: micro-batches are weighted by their share.
        per_token = args.algo in ("grpo", "ppo")
        total_units = batch.response_mask[idx].sum().clamp(min=1) if per_token else len(idx)
        self.optimizer.zero_grad(set_to_none=True)
        local = self.dp.local_slice(idx)  # data parallel: this trainer's share; normalised by the whole minibatch
        for mb_idx in self.dp.even_out(micro_batches(local, batch.attention_mask.sum(-1), args.micro_batch_size,
                                                     args.max_tokens_per_micro_batch)):
            if mb_idx is None:  # sharded: another trainer has a micro-batch more; join its collectives, add zero
                (sequence_logprobs(self.model, batch.input_ids[:1], batch.attention_mask[:1]).sum() * 0).backward()
                continue
            mb = batch.select(mb_idx)
            logprobs, entropy = sequence_logprobs(self.model, mb.input_ids, mb.attention_mask, args.temperature,
                                                  mb.response_mask, with_entropy=True,
                                                  entropy_grad=args.entropy_coef > 0,
                                                  packed=args.max_tokens_per_micro_batch > 0)
            old, weights = mb.old_logprobs, None
            if correcting:
                old = prox_logprobs[mb_idx] if prox_logprobs is not None else logprobs.detach()
                weights = behaviour_weights(old, mb.old_logprobs, args.off_policy_correction, args.correction_cap)
                stats.setdefault("correction/weight_mean", []).append(masked_mean(weights, mb.response_mask).item())
            if args.algo in ("grpo", "ppo"):  # ppo: advantages are per token ([B, T], GAE)
                pg_loss, clip_frac = clipped_surrogate_loss(logprobs, old, advantages[mb_idx], mb.response_mask,
                                                            args.clip_eps, token_weights=weights)
            elif args.algo == "dr_grpo":
                pg_loss, clip_frac = dr_grpo_loss(logprobs, old, advantages[mb_idx], mb.response_mask,
                                                  args.max_new_tokens, args.clip_eps, token_weights=weights)
            else:  # opmd: advantages are the centred rewards r - mean_r (no std normalisation)
                pg_loss, clip_frac = opmd_loss(logprobs, old, advantages[mb_idx], mb.response_mask, args.opmd_tau), 0.0
            loss = pg_loss - args.entropy_coef * masked_mean(entropy, mb.response_mask)
            if ref_logprobs is not None:
                kl = masked_mean(kl_estimate(logprobs, ref_logprobs[mb_idx], args.kl_estimator), mb.response_mask)
                loss = loss + args.kl_coef * kl
                stats.setdefault("kl", []).append(kl.item())
            # Weight each micro-batch by its share of tokens: the sum equals a token mean over the minibatch.
            (loss * (mb.response_mask.sum() if per_token else len(mb_idx)) / total_units).backward()
            with torch.no_grad():
                stats.setdefault("loss", []).append(loss.item())
                stats.setdefault("clip_frac", []).append(float(clip_frac))
                stats.setdefault("entropy", []).append(masked_mean(entropy, mb.response_mask).item())
                ratio = torch.exp(logprobs - mb.old_logprobs)
                stats.setdefault("ratio/mean", []).append(masked_mean(ratio, mb.response_mask).item())
        self.dp.all_reduce_gradients(list(self.model.parameters()), args.sync_bucket_mb)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.max_grad_norm)
        stats.setdefault("grad_norm", []).append(full_tensor(grad_norm).item())
        self.optimizer.step()

    @torch.no_grad()
    def _logprobs(self, model, batch: Batch) -> torch.Tensor:
        args, out = self.args, torch.zeros_like(batch.response_mask)
        for idx in batch_micro_batches(batch, args.micro_batch_size, args.max_tokens_per_micro_batch):
            out[idx] = sequence_logprobs(model, batch.input_ids[idx], batch.attention_mask[idx], args.temperature,
                                         batch.response_mask[idx], packed=args.max_tokens_per_micro_batch > 0)
        return out

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """What the explorers get, in HF names: the parameters (DTensor shards when sharded: the sync gathers
        them), or with LoRA the base weights with the adapters merged in."""
        if self.args.lora_rank:
            return merged_named_weights(self.model)
        return list(self.model.named_parameters())

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, out_dir: str, name: str | None = None, extra_state: dict | None = None) -> str | None:
        """HF folder + trainer_state.pt, written to a temp folder and renamed: a checkpoint is whole or absent.
        Sharded trainers all call it (the full state is gathered onto trainer 0, common/fsdp.py); trainer 0 writes."""
        sharded = self.dp.sharded
        weights = full_state_dict(self.model) if sharded else None
        optimizer = optimizer_state(self.model, self.optimizer)
        critic = self.critic.state() if self.critic is not None else None
        reference = full_state_dict(self.ref_model) if self.args.ref_reset_every else None
        if self.dp.rank != 0:
            return None
        name = name or f"step_{self.step}"
        parent = os.path.join(out_dir, "checkpoints") if name.startswith("step_") else out_dir
        os.makedirs(parent, exist_ok=True)
        final, tmp = os.path.join(parent, name), os.path.join(parent, f".tmp-{name}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        if sharded:
            save_hf_folder(self.model, weights, tmp)
        elif self.args.lora_rank:  # a plain HF folder of the merged weights, plus the adapter to resume from
            save_hf_folder(self.model.get_base_model(), dict(merged_named_weights(self.model)), tmp)
            self.model.save_pretrained(os.path.join(tmp, "adapter"))
        else:
            self.model.save_pretrained(tmp)
        self.tokenizer.save_pretrained(tmp)
        if self.critic is not None:
            self.critic.save(tmp, critic)
        if self.args.ref_reset_every:  # the reference is no longer the initial model: keep it
            save_hf_folder(self.ref_model, reference, os.path.join(tmp, "reference"))
        torch.save({
            "step": self.step, "version": self.version, "optimizer": optimizer, "sharded_optimizer": sharded,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
            **(extra_state or {}),
        }, os.path.join(tmp, "trainer_state.pt"))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        return final

    def resume(self, out_dir: str) -> dict:
        """Load the newest complete checkpoint; returns its extra state ({} when there is none)."""
        path = latest_checkpoint(out_dir)
        if path is None:
            return {}
        if self.args.lora_rank:
            self._load_adapter(path)
        else:
            self._load_weights(self.model, path)
        if self.critic is not None:
            self.critic.load(path)
        if self.ref_model is not None and os.path.isdir(os.path.join(path, "reference")):
            self._load_weights(self.ref_model, os.path.join(path, "reference"))  # else: never reset, the initial one
        state = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=False)
        if state.get("sharded_optimizer", False) != self.dp.sharded:  # keyed by name vs by index
            raise SystemExit(f"error: --resume {path}: optimizer state saved with --trainer-shard "
                             f"{'fsdp' if state.get('sharded_optimizer') else 'none'}; resume with the same")
        load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.step, self.version = state["step"], state["version"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        return state

    def _load_adapter(self, path: str):
        """LoRA: the base stays the initial model; the trained adapter comes back from <checkpoint>/adapter."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        file = os.path.join(path, "adapter", "adapter_model.safetensors")
        if not os.path.exists(file):
            raise SystemExit(f"error: --resume {path}: no LoRA adapter in the checkpoint (saved without --lora-rank?)")
        result = set_peft_model_state_dict(self.model, load_file(file, device=str(self.device)))
        if result.unexpected_keys:
            raise SystemExit(f"error: --resume {file}: adapter does not match --lora-* ({result.unexpected_keys[:3]})")

    def _load_weights(self, model, path: str):
        from safetensors.torch import load_file

        weights = {}
        for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            weights.update(load_file(f, device="cpu" if self.dp.sharded else str(self.device)))
        missing, unexpected = load_full_state_dict(model, weights, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise SystemExit(f"error: --resume {path}: weights do not match the model ({missing[:3]} {unexpected[:3]})")


def latest_checkpoint(out_dir: str) -> str | None:
    steps = []
    for path in glob.glob(os.path.join(out_dir, "checkpoints", "step_*")):
        if os.path.exists(os.path.join(path, "trainer_state.pt")):
            steps.append((int(path.rsplit("_", 1)[1]), path))
    return max(steps)[1] if steps else None


class TrainerRun:
    """The trainer process's bookkeeping around `Trainer`, the same in every schedule: resume, the metrics row per
    step, periodic checkpoints, Ctrl-C -> checkpoint, and final/ + summary.json at the end."""

    def __init__(self, ctx, args):
        self.ctx, self.args = ctx, args
        self.timeline = Timeline(args.out_dir, ctx.name)
        self.trainer = Trainer(args, ctx.device, DataParallel.from_context(ctx))
        self.is_main = ctx.index == 0  # trainer rank 0: the queue, the weight sync, metrics and checkpoints
        state = self.trainer.resume(args.out_dir) if args.resume else {}
        self.summary = {"eval_before": state.get("eval_before"), "dropped_stale": state.get("dropped_stale", 0)}
        self.start_time = time.time() - state.get("elapsed", 0.0)
        self.replay = None  # Kimi k1.5 replay: groups trained up to --max-reuse times (in memory: not resumed)
        if args.max_reuse > 1:
            self.replay = ReplayBuffer(args.max_reuse, args.replay_groups,
                                       capacity=(args.replay_groups or args.tasks_per_step) * args.max_reuse,
                                       max_staleness=getattr(args, "max_staleness", None),
                                       skip_uniform=args.drop_zero_signal_groups)
        self.logger = MetricsLogger(args.out_dir, vars(args), args.steps, self.trainer.step, args.track,
                                    args.wandb_project) if self.is_main else None

    @property
    def step(self) -> int:
        return self.trainer.step

    def get(self, queue):
        start = time.time()
        batch = self.trainer.dp.share_batch(queue.get(self.args.timeout_s) if self.is_main else None)
        key = f"{batch.explorer}-{'final' if batch.final else batch.step}"  # the final message carries only the eval
        self.timeline.record("wait", start, time.time(), get=key)
        return batch

    def train(self, batch, step: int) -> dict:
        experiences, replay_metrics = batch.experiences, {}
        if self.replay is not None:
            experiences, replay_metrics = self.replay.mix(experiences, self.trainer.version)
        with self.timeline.phase("train", step=step) as event:
            metrics = self.trainer.train_step(experiences) if experiences else self.trainer.skip_step()
            if self.args.verify_sync:  # data-parallel replicas must stay bit-identical
                event["hash"] = weights_hash(self.trainer.named_weights())
        return {**metrics, **replay_metrics}

    def log(self, batch, metrics: dict, **extra):
        step = self.trainer.step
        if self.summary["eval_before"] is None and "eval/accuracy" in batch.metrics:
            self.summary["eval_before"] = batch.metrics["eval/accuracy"]
        times = {f"time/{k}": v for k, v in self.timeline.take_totals().items()}
        if self.logger:
            self.logger.log({"step": step, **metrics, **batch.metrics, **times, **extra,
                             "time/elapsed": time.time() - self.start_time,
                             "samples": step * self.args.rollout_batch_size})
        if self.args.checkpoint_every and step % self.args.checkpoint_every == 0 and step < self.args.steps:
            self.checkpoint()

    def checkpoint(self, name: str | None = None):
        if not self.is_main and not self.trainer.dp.sharded:  # the replicas are identical: one writer
            return None
        with self.timeline.phase("checkpoint", step=self.trainer.step):
            return self.trainer.save_checkpoint(self.args.out_dir, name, {**self.summary,
                                                                          "elapsed": time.time() - self.start_time})

    def finish(self, final_eval: dict):
        if not self.is_main:
            if self.trainer.dp.sharded:  # the gathers of trainer 0's checkpoints need every shard
                self.checkpoint()
                self.checkpoint("final")
            return
        self.checkpoint()
        self.checkpoint("final")
        self.summary.update(eval_after=final_eval.get("eval/accuracy"), elapsed=time.time() - self.start_time,
                            steps=self.trainer.step)
        with open(os.path.join(self.args.out_dir, "summary.json"), "w") as f:
            json.dump(self.summary, f, indent=2)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is KeyboardInterrupt:
            self.checkpoint()  # Ctrl-C: keep what was learned
        if self.logger:
            self.logger.close()
        return False
