"""The trainer side shared by every schedule: policy + reference model (+ the critic of algorithms that have one,
common/trainer/critic.py), one train step over a rollout batch, and the run's bookkeeping around it (TrainerRun).
Entry scripts decide *when* it trains and syncs; this decides *how*. *What* is optimised is --algo's entry in
common/trainer/losses.py ALGOS (a loss function and an advantage estimator); the experience filters are
common/trainer/filters.py, the forward and its micro-batches common/trainer/forward.py, checkpoints
common/trainer/checkpoints.py.

`Trainer.train_step` reads top to bottom. Its simplifications, on purpose:
- advantages are computed once per step, before any update (also with several epochs, as PPO does);
- the reference model never trains (reset to the policy every --ref-reset-every steps, no EMA);
- data-parallel gradients are summed after the backward, not overlapped with it (common/trainer/parallel.py);
- a minibatch is one optimizer step; no gradient accumulation across rollout batches;
- the critic and the policy are updated on the same minibatches, each with its own optimizer; no shared body.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter, defaultdict
import os
import sys
import time
import warnings

import numpy as np
import torch

from common.trainer import checkpoints as ckpt
from common.trainer.critic import Critic
from common.experience import Experience, collate
from common.runtime import cores
from common.runtime.worker import in_step, stop_requested
from common.runtime.metrics import MetricsLogger, Timeline, peak_gpu_memory
from common.trainer.losses import (ALGOS, MicroBatch, behaviour_weights, config_kwargs, kl_estimate,
                                   kl_penalized_rewards, masked_mean, mismatch_stats)
from common.trainer.fsdp import prepare_model
from common.lora import adapter_tensors, merge_lost_share, merged_named_weights, sync_mode
from common.model import DTYPES, load_model, load_tokenizer
from common.trainer.forward import batch_logprobs, micro_batches, sequence_logprobs
from common.trainer.filters import build_processors, check_finite, drop_stale, process
from common.trainer.lr_schedule import build_lr_scheduler, build_optimizer
from common.trainer.parallel import DataParallel
from common.trainer.replay import ReplayBuffer
from common.trainer.teacher import load_teacher, teacher_logprobs
from common.trainer.samples import SamplesLog, sample_rows, samples_due
from common.tasks.stream import TrainedPositions
from common.weight_sync import full_tensor, weights_hash
from common.runtime.plugins import load_object
from common.vlm import is_frozen

class Trainer:
    def __init__(self, args, device: torch.device, dp: DataParallel | None = None):
        self.args, self.device = args, device
        self.dp = dp or DataParallel()  # one trainer unless --trainer-devices lists several
        self.dp.sharded = args.trainer_shard == "fsdp"
        self.tokenizer = load_tokenizer(args.model, args.chat_template)
        self.model = load_model(args.model, device, DTYPES[args.dtype], seed=args.seed)
        self.model.config.use_cache = False
        self.model.train()
        self.model = prepare_model(self.model, args, self.dp)  # checkpointing, LoRA, FSDP2 (common/trainer/fsdp.py)
        # The reference model only exists when something uses it (KL term): saves memory and a forward pass.
        self.ref_model = None
        if args.kl_coef > 0:
            self.ref_model = load_model(args.model, device, DTYPES[args.dtype], seed=args.seed).eval()
            self.ref_model.requires_grad_(False)
            self.ref_model = prepare_model(self.ref_model, args, self.dp, trainable=False)
        self.algo = resolve_algo(args)  # ALGO LOGIC: the loss and the advantage estimator, chosen once
        self.processors = build_processors(args.processors)
        self.critic = None
        if self.algo.critic:
            self.critic = Critic(args, device, DTYPES[args.dtype], self.model.config.vocab_size, self.dp)
        self.teacher = load_teacher(args, device, self.dp)  # --algo distill (common/trainer/teacher.py), else None
        self.loss_kwargs = config_kwargs(self.algo.loss, args, skip=1)
        self.advantage_kwargs = config_kwargs(self.algo.advantages, args, skip=2, critic=self.critic,
                                              teacher_logprobs=lambda b: teacher_logprobs(self.teacher, b, args))
        self.optimizer = build_optimizer(self.model, args.lr, args.weight_decay)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, args.lr_scheduler, args.warmup_steps, args.steps)
        self.step = 0        # trainer steps done
        self.version = 0     # version of the weights in self.model (one per optimizer-updating step)
        self._sync_bytes: int | None = None  # `sync_metrics`

    # ---------------------------------------------------------------- ALGO LOGIC: one step over a rollout batch
    def train_step(self, experiences: list[Experience]) -> dict:
        """filters -> collate -> proximal and reference log-probs -> advantages -> per epoch and minibatch: the
        critic's update, then the policy's (per micro-batch: forward, loss, backward; then one optimizer step).
        Returns the step's metrics."""
        args, model, dp = self.args, self.model, self.dp
        metrics = incoming_metrics(experiences)  # what the explorers sent, before any filter
        experiences, counts = process(experiences, args, self.processors)  # common/trainer/filters.py
        metrics |= counts
        if not experiences:  # every sample was filtered out: nothing to learn from, the step still counts
            return {**self.skip_step(), **metrics}
        batch = collate(experiences, self.tokenizer.pad_token_id).to(self.device)
        n, mask, packed = len(batch), batch.response_mask, args.max_tokens_per_micro_batch > 0
        stats = defaultdict(list)  # metric -> a value per micro-batch (floats, or device tensors: `step_means`)

        update_actor = self.step >= args.critic_warmup_steps  # critic warm-up: the policy waits
        # Off-policy correction: the proximal policy is this model before the update (AReaL / verl TIS). With one
        # epoch of one minibatch no sample is seen after an update, so the detached current log-probs are exactly
        # the proximal ones and the extra forward pass is skipped.
        correcting = args.off_policy_correction not in ("none", "bypass")  # bypass: the behaviour log-probs are
        # the proximal policy, as with none
        single_update = args.ppo_epochs == 1 and n <= args.minibatch_size
        prox_logprobs = (batch_logprobs(model, batch, args) if correcting and not single_update and update_actor
                         else None)
        ref_logprobs = batch_logprobs(self.ref_model, batch, args) if self.ref_model is not None else None
        rewards = batch.rewards  # [B], or [B, T] per token once the KL is subtracted from the reward
        if ref_logprobs is not None and args.kl_mode == "reward":
            kl = kl_estimate(batch.old_logprobs, ref_logprobs, args.kl_estimator) * mask
            rewards = kl_penalized_rewards(batch.rewards, kl, mask, args.kl_coef)
            stats["kl"].append(masked_mean(kl, mask).item())
            ref_logprobs = None  # no KL loss term
        adv = self.algo.advantages(batch, rewards, **self.advantage_kwargs)  # group-normalised, GAE, the teacher's
        check_finite(self.step + 1, advantages=adv.advantages, returns=adv.returns)  # never a silent NaN update
        stats |= {k: [v] for k, v in adv.metrics.items()}
        per_token = adv.advantages if adv.advantages.dim() == 2 else adv.advantages[:, None]
        # what the policy gradient has to work with (0: only the entropy and KL terms could move the weights)
        stats["advantage/abs_mean"].append(masked_mean(per_token.abs().expand_as(mask), mask).item())
        # Train-inference mismatch, before any update: over the whole batch where the proximal pass ran, else over
        # the first minibatch (a random share, measured from its own forward passes at no extra cost).
        if prox_logprobs is not None:
            stats |= {k: [v] for k, v in mismatch_stats(prox_logprobs, batch.old_logprobs, mask).items()}
        before_update = [] if prox_logprobs is None else None  # (rows, log-probs) of the first minibatch
        # the critic's figures before its update (explained variance of the returns by the values GAE used)
        critic_metrics = {} if self.critic is None else self.critic.metrics(adv.returns, adv.values, mask, update_actor)
        # Seeded by step: every data-parallel trainer walks the same order, and a resumed run the same as before.
        shuffle = torch.Generator().manual_seed(args.seed * 1_000_003 + self.step)
        for _ in range(args.ppo_epochs):
            order = torch.randperm(n, generator=shuffle)
            for idx in order.split(args.minibatch_size):
                if self.critic is not None:
                    for k, v in self.critic.update(batch, idx, adv.values, adv.returns).items():
                        stats[k] += v
                if not update_actor:
                    continue
                minibatch_tokens = mask[idx].sum().clamp(min=1)  # each micro-batch's loss is its share of these
                self.optimizer.zero_grad(set_to_none=True)
                total = 0.0
                for rows, mb in micro_batches(batch, idx, args, dp):  # this trainer's share (forward.py)
                    logprobs, entropy = sequence_logprobs(model, mb.input_ids, mb.attention_mask, args.temperature,
                                                          mb.response_mask, with_entropy=True, packed=packed,
                                                          entropy_grad=args.entropy_coef > 0, images=mb.images)
                    if rows is None:  # sharded: an idle pass joins the busier trainers' collectives, adds zero
                        (logprobs.sum() * 0).backward()
                        continue
                    if before_update is not None:
                        before_update.append((rows, logprobs.detach()))
                    old, weights = mb.old_logprobs, None
                    if correcting:
                        old = prox_logprobs[rows] if prox_logprobs is not None else logprobs.detach()
                        weights = behaviour_weights(old, mb.old_logprobs, args.off_policy_correction,
                                                    args.correction_cap, mb.response_mask, args.correction_floor,
                                                    args.correction_k3_max)
                        stats["correction/weight_mean"].append(masked_mean(weights, mb.response_mask))
                    loss, algo_stats = self.algo.loss(MicroBatch(logprobs, old, adv.advantages[rows],
                                                                 mb.response_mask, weights, minibatch_tokens,
                                                                 len(idx)), **self.loss_kwargs)
                    token_share = lambda x: (x * mb.response_mask).sum() / minibatch_tokens  # noqa: E731
                    loss = loss - args.entropy_coef * token_share(entropy)
                    if ref_logprobs is not None:
                        kl = kl_estimate(logprobs, ref_logprobs[rows], args.kl_estimator)
                        loss = loss + args.kl_coef * token_share(kl)
                        stats["kl"].append(masked_mean(kl, mb.response_mask).detach())
                    if loss.requires_grad:  # --freeze language: a micro-batch without images has nothing to train
                        loss.backward()
                    total = total + loss.detach()
                    with torch.no_grad():  # kept on the device: read once per step (no host sync per micro-batch)
                        for k, v in algo_stats.items():
                            stats[k].append(v.detach() if torch.is_tensor(v) else float(v))
                        stats["entropy"].append(masked_mean(entropy, mb.response_mask))
                        ratio = torch.exp(logprobs - mb.old_logprobs)
                        stats["ratio/mean"].append(masked_mean(ratio, mb.response_mask))
                if before_update:  # the first minibatch, on the weights before the update (a data-parallel
                    rows = torch.cat([r for r, _ in before_update])  # trainer may have had no rows in it)
                    stats |= {k: [v] for k, v in mismatch_stats(torch.cat([lp for _, lp in before_update]),
                                                                batch.old_logprobs[rows], mask[rows]).items()}
                before_update = None
                stats["loss"].append(dp.sum_scalar(total))  # the minibatch's loss, all trainers
                dp.all_reduce_gradients(list(model.parameters()), args.sync_bucket_mb)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                stats["grad_norm"].append(full_tensor(grad_norm).detach())
                check_finite(self.step + 1, loss=stats["loss"][-1], grad_norm=stats["grad_norm"][-1])
                self.optimizer.step()

        lr = self._next_step()
        if args.ref_reset_every and self.step % args.ref_reset_every == 0:  # Kimi k1.5 / ProRL reference reset
            self.ref_model.load_state_dict(model.state_dict())  # sharded: shard to shard, same layout
            stats["ref_reset"].append(1.0)
        out = {"loss": 0.0, "grad_norm": 0.0, "clip_frac": 0.0, "lr": lr, **metrics}  # a step without an update
        out |= step_means(stats) | critic_metrics
        out["response/tokens_mean"] = mask.sum().item() / n
        out |= peak_gpu_memory(self.device, "trainer")
        return out

    def skip_step(self) -> dict:
        """A step with nothing to train (partial rollouts: no group has finished yet; every sample filtered out). It
        still counts, as a step and a version, so every schedule keeps one version per trainer step."""
        lr = self._next_step()
        return {"loss": 0.0, "grad_norm": 0.0, "clip_frac": 0.0, "lr": lr}

    def _next_step(self) -> float:
        """The end of every step, trained or skipped: one step and one weights version more (the one place either
        moves), and the learning-rate schedule moved on. Returns the learning rate the step used."""
        lr = self.optimizer.param_groups[0]["lr"]
        with warnings.catch_warnings():  # torch warns when the schedule moves before any update: a skip does by design
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.lr_scheduler.step()
        self.step += 1
        self.version += 1
        return lr

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """What the explorers get, in HF names: the parameters (DTensor shards when sharded: the sync gathers
        them); with LoRA the adapters (common/lora.py), or with --lora-sync merged the base weights with the
        adapters merged in."""
        mode = sync_mode(self.args)
        if mode == "adapters":
            return adapter_tensors(self.model)
        named = merged_named_weights(self.model) if mode == "merged" else self.model.named_parameters()
        return [(n, t) for n, t in named if not is_frozen(n, self.args.freeze)]  # --freeze: the explorers have them

    def sync_metrics(self) -> dict:
        """sync/bytes: what one weight sync sends (the adapters alone with LoRA); lora/merge_lost: with merged
        LoRA sync, the share of the adapters' update the merge onto --dtype loses (common/lora.py)."""
        if self._sync_bytes is None:
            self._sync_bytes = sum(t.numel() * t.element_size() for _, t in self.named_weights())
        out = {"sync/bytes": float(self._sync_bytes)}
        if sync_mode(self.args) == "merged" and self.args.dtype != "float32":  # fp32: nothing, said at the start
            out["lora/merge_lost"] = merge_lost_share(self.model)
        return out


def incoming_metrics(experiences: list[Experience]) -> dict:
    """Reward (finite ones) of a rollout batch, before any filter."""
    rewards = [e.reward for e in experiences if np.isfinite(e.reward)]
    return {"reward/mean": float(np.mean(rewards)), "reward/std": float(np.std(rewards))} if rewards else {}


def step_means(stats: dict[str, list]) -> dict[str, float]:
    """Each metric's mean over the step: the device tensors among the values come to the host in one transfer per
    device, so the hot loop never waits for the GPU to report a number."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for values in stats.values():
        for v in values:
            if torch.is_tensor(v):
                by_device.setdefault(v.device, []).append(v)
    host = {}
    for tensors in by_device.values():
        for t, x in zip(tensors, torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist()):
            host[id(t)] = x
    return {k: float(np.mean([host[id(v)] if torch.is_tensor(v) else v for v in values]))
            for k, values in stats.items()}


def resolve_algo(args):
    """--algo's entry in common/trainer/losses.py ALGOS; --loss-fn module:function replaces its loss."""
    algo = ALGOS[args.algo]
    if args.loss_fn:
        algo = dataclasses.replace(algo, loss=load_object(args.loss_fn, "--loss-fn"))
    return algo


def accuracy_interval(metrics: dict) -> list[float] | None:
    """An evaluation's [low, high] bootstrap interval of its accuracy (common/explorer/evaluation.py), if it has one."""
    return [metrics["eval/accuracy_lo"], metrics["eval/accuracy_hi"]] if "eval/accuracy_lo" in metrics else None


class TrainerRun:
    """The trainer process's bookkeeping around `Trainer`, the same in every schedule: resume, the metrics row per
    step, periodic checkpoints, Ctrl-C -> checkpoint, and final/ + summary.json at the end."""

    def __init__(self, ctx, args, control=None):
        self.ctx, self.args = ctx, args
        self.control = control  # ControlChannel (common/runtime/control.py): evaluations and the end of the run
        self.timeline = Timeline(args.out_dir, ctx.name)
        cores.record_to(self.timeline)
        self.trainer = Trainer(args, ctx.device, DataParallel.from_context(ctx))
        self.is_main = ctx.index == 0  # trainer rank 0: the queue, the weight sync, metrics and checkpoints
        self.last_batch: dict[int, tuple[float, int]] = {}  # explorer -> (time, step) of its newest batch
        self.taken = 0  # batches taken from the queue (`get`)
        state = ckpt.resume(self.trainer, args.out_dir) if args.resume else {}
        self.summary = {"eval_before": state.get("eval_before"),
                        "eval_before_interval": state.get("eval_before_interval"),  # its 95% bootstrap interval
                        "dropped_stale": state.get("dropped_stale", 0),
                        "evals": state.get("evals", []),  # every evaluation's metrics, in the order they came
                        "trained_tasks": state.get("trained_tasks", {})}  # train_async.py: explorer -> ledger
        # the streams' positions, published before the first weights (common/tasks/stream.py)
        self.positions = TrainedPositions(self.summary["trained_tasks"], ctx.store, self.is_main)
        self.start_time = time.time() - state.get("elapsed", 0.0)
        self.logged_step = self.trainer.step
        self.stale_counts: dict = {}  # the staleness processor's counts since the last metrics row
        self.failed_steps = 0  # steps in a row with --max-failed-frac of their samples failed
        self.replay = None  # Kimi k1.5 replay: groups trained up to --max-reuse times (in memory: not resumed)
        if args.max_reuse > 1:
            self.replay = ReplayBuffer(args.max_reuse, args.replay_groups,
                                       capacity=(args.replay_groups or args.tasks_per_step) * args.max_reuse,
                                       max_staleness=args.max_staleness,
                                       skip_uniform=args.drop_zero_signal_groups and ALGOS[args.algo].group_signal)
        self.logger = MetricsLogger(args.out_dir, vars(args), args.steps, self.trainer.step, args.track,
                                    args.wandb_project, run_name=args.run_name or os.path.basename(
                                        os.path.normpath(args.out_dir)), entity=args.wandb_entity,
                                    tags=args.wandb_tags, resumed=args.resume) if self.is_main else None
        self.samples = SamplesLog(args.out_dir, self.logger.wandb) if self.is_main else None

    @property
    def step(self) -> int:
        return self.trainer.step

    def log_stall(self, since: float, waited: float) -> None:
        """No experience for --stall-log-s seconds (and every as many after): say whom the trainer waits for."""
        clock = lambda t: time.strftime("%H:%M:%S", time.localtime(t))  # noqa: E731
        heard = "; ".join(f"explorer{i}: " + (f"last batch (step {self.last_batch[i][1]}) at "
                                              f"{clock(self.last_batch[i][0])}" if i in self.last_batch else
                                              "no batch yet") for i in range(len(self.ctx.explorer_ranks)))
        silent = sorted(range(len(self.ctx.explorer_ranks)), key=lambda i: self.last_batch.get(i, (0, 0))[0])
        print(f"[tandem] {self.ctx.name} at step {self.step}: no experience for {waited:.0f}s (since {clock(since)}); "
              f"waiting for explorer{silent[0] if silent else '?'} ({heard}); giving up at --timeout-s "
              f"{self.args.timeout_s:.0f}s", file=sys.stderr, flush=True)

    def get(self, queue):
        """The next batch, after the staleness rule; meanwhile this trainer's cores are the explorers' (they
        compute while it waits: common/runtime/cores.py). Its stream positions are used, trained or not."""
        start = time.time()
        with cores.lending(self.ctx.store, self.taken):
            batch = self.trainer.dp.share_batch(queue.get(self.args.timeout_s, on_stall=lambda waited: self.log_stall(
                start, waited), stall_every=self.args.stall_log_s) if self.is_main else None)
        self.last_batch[batch.explorer] = (time.time(), batch.step)
        self.taken += 1
        self.timeline.record("wait", start, time.time(), get=f"{batch.explorer}-{batch.step}")
        # ALGO LOGIC: staleness (common/trainer/filters.py): what is too old is dropped and counted here, before the
        # replay buffer sees it; a batch with nothing left costs no step (the loop takes the next one).
        batch.experiences, counts = drop_stale(batch.experiences, self.args, self.trainer.version)
        self.summary["dropped_stale"] += counts["filter/stale_dropped"]
        since = self.stale_counts  # what batches dropped whole since the last row also counts there
        counts["filter/stale_dropped"] += since.get("filter/stale_dropped", 0)
        if "staleness/dropped_min" in since:
            counts["staleness/dropped_min"] = min(since["staleness/dropped_min"],
                                                  counts.get("staleness/dropped_min", since["staleness/dropped_min"]))
        self.stale_counts = counts
        self.positions.record(batch)
        return batch

    def train(self, batch, step: int) -> dict:
        in_step.set()  # from here to the end of `log`, a stop signal waits for the step to finish
        if step == self.args.steps:  # every batch is handed over: the explorers' cores are ours (they wait)
            cores.widen()
        experiences, replay_metrics = batch.experiences, {}
        if self.replay is not None:
            experiences, replay_metrics = self.replay.mix(experiences, self.trainer.version)
        with self.timeline.phase("train", step=step) as event:
            metrics = self.trainer.train_step(experiences) if experiences else self.trainer.skip_step()
            metrics |= self.trainer.sync_metrics()
            if self.args.verify_sync:  # data-parallel replicas must stay bit-identical
                event["hash"] = weights_hash(self.trainer.named_weights())
        return {**metrics, **replay_metrics}

    def log(self, batch, metrics: dict, **extra):
        step = self.trainer.step
        evals = self._evaluations()
        times = {f"time/{k}": v for k, v in self.timeline.take_totals().items()}
        if self.logger:
            self.logger.log({"step": step, **self.stale_counts, **metrics, **batch.metrics, **evals, **times, **extra,
                             "dropped_stale": self.summary["dropped_stale"],
                             "time/elapsed": time.time() - self.start_time,
                             "samples": step * self.args.rollout_batch_size})
        if self.samples and samples_due(step, self.args.log_samples_every):  # what the policy wrote, readable
            self.samples.log(sample_rows(batch.experiences, self.trainer.tokenizer, step, self.args.log_samples))
        if self.args.checkpoint_every and step % self.args.checkpoint_every == 0 and step < self.args.steps:
            self.checkpoint()
        self.logged_step, self.stale_counts = step, {}
        in_step.clear()
        self._check_failures(batch.experiences, step)
        if stop_requested.is_set():  # SIGTERM (preemption) or Ctrl-C during the step: checkpoint now, then stop
            raise KeyboardInterrupt

    def _check_failures(self, experiences: list, step: int) -> None:
        """A step where every sample failed prints a warning naming the most common error; --max-failed-steps
        steps in a row with at least --max-failed-frac failed stop the run with one line (every trainer rank sees
        the same batch, so all stop together), not after training on nothing for an hour."""
        if not experiences:
            return
        failed = [e.reward_info for e in experiences if e.reward_info.get("failed")]
        errors = Counter(" | ".join((info.get("error") or info.get("failed_reason") or "failed").splitlines())[:300]
                         for info in failed)
        worst = f"{errors.most_common(1)[0][0]!r} ({errors.most_common(1)[0][1]} of {len(failed)})" if failed else ""
        if len(failed) == len(experiences) and self.is_main:
            print(f"[tandem] step {step}: every sample failed; most common error: {worst}", file=sys.stderr,
                  flush=True)
        self.failed_steps = self.failed_steps + 1 if len(failed) >= self.args.max_failed_frac * len(experiences) \
            else 0
        if self.failed_steps >= self.args.max_failed_steps:
            raise SystemExit(f"error: {len(failed)} of {len(experiences)} samples failed at step {step}, and "
                             f"{self.args.max_failed_frac:.0%} or more in each of the last {self.failed_steps} steps "
                             f"(--max-failed-frac, --max-failed-steps): the most common error is {worst}")

    def checkpoint(self, name: str | None = None):
        if not self.is_main and not self.trainer.dp.sharded:  # the replicas are identical: one writer
            return None
        with self.timeline.phase("checkpoint", step=self.trainer.step):
            return ckpt.save(self.trainer, self.args.out_dir, name,
                             {**self.summary, "elapsed": time.time() - self.start_time})

    def _final_checkpoints(self):
        every = self.args.checkpoint_every
        if not every or self.trainer.step % every == 0:  # the last step on the --checkpoint-every grid (as TRL)
            self.checkpoint()
        self.checkpoint("final")  # model + tokenizer (hard links to the step checkpoint's when there is one)

    def _evaluations(self, messages=None) -> dict:
        """The evaluation results that arrived on the control channel since the last row. The row shows the newest;
        every one is kept in summary["evals"] (two can arrive between rows: the control queue is not ordered with
        the experience queue), and the one of the initial weights is eval_before."""
        if not (self.is_main and self.control):
            return {}
        out = {}
        for msg in self.control.poll() if messages is None else messages:
            out.update(msg.metrics)
            self.summary["evals"].append(msg.metrics)
            if msg.metrics.get("eval/version") == 0 and self.summary["eval_before"] is None:
                self.summary["eval_before"] = msg.metrics["eval/accuracy"]
                self.summary["eval_before_interval"] = accuracy_interval(msg.metrics)
        return out

    def finish(self):
        """Wait for the final evaluation on the control channel, then final/, the last checkpoint, summary.json."""
        if not self.is_main:
            if self.trainer.dp.sharded:  # the gathers of trainer 0's checkpoints need every shard
                self._final_checkpoints()
            return
        final_eval, late = self.control.wait_final(self.args.timeout_s)
        self._evaluations(late)  # evaluations that came after the last row: kept in summary["evals"]
        if final_eval:
            self.summary["evals"].append(final_eval)
        self._final_checkpoints()  # model + tokenizer (hard links to the step checkpoint's when there is one)
        self.summary.update(eval_after=final_eval.get("eval/accuracy"),
                            eval_after_interval=accuracy_interval(final_eval),
                            elapsed=time.time() - self.start_time, steps=self.trainer.step)
        if not self.args.eval_every:
            self.summary["evaluation"] = "off (--eval-every 0)"
        with open(os.path.join(self.args.out_dir, "summary.json"), "w") as f:
            json.dump(self.summary, f, indent=2)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        # Ctrl-C, SIGTERM, or peers gone while stopping: keep what was learned, if its metrics row is written (a
        # step cut before its row would be missing from metrics.jsonl after resuming; the previous one is kept)
        if (exc_type is KeyboardInterrupt or stop_requested.is_set()) and self.trainer.step == self.logged_step:
            self.checkpoint()
        if self.logger:
            self.logger.close()
        return False
