"""The critic of `--algo ppo`: a causal LM's body with a Linear value head on the last hidden state, its own
optimizer, its update, and its part of a checkpoint (the critic/ subfolder).
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch
from safetensors.torch import load_file, save_file

from common.experience import Batch
from common.trainer.losses import clipped_value_loss, masked_mean
from common.trainer.fsdp import full_state_dict, load_full_state_dict, load_optimizer_state, optimizer_state, prepare_model
from common.model import load_model
from common.trainer.forward import hidden_states, micro_batches
from common.trainer.lr_schedule import build_optimizer
from common.trainer.parallel import DataParallel
from common.weight_sync import full_tensor


class ValueModel(torch.nn.Module):
    """V(s_t) for every prefix: body(input_ids) -> Linear(hidden, 1), aligned with `sequence_logprobs`' [B, T-1]
    (position t holds the value of the state that predicts token t+1)."""

    def __init__(self, name: str, device, dtype: torch.dtype, seed: int, flag: str = "--model"):
        super().__init__()
        lm = load_model(name, device, dtype, seed=seed, flag=flag)
        self.vocab_size = lm.config.vocab_size
        self.body = lm.base_model  # the LM head is dropped: only hidden states are needed
        self.body.config.use_cache = False
        # Zero init: every value starts at 0, so the first advantages are the plain (shaped) rewards.
        self.value_head = torch.nn.Linear(lm.config.hidden_size, 1, device=device, dtype=dtype)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, packed: bool = False) -> torch.Tensor:
        hidden = hidden_states(self.body, input_ids, attention_mask, packed)[:, :-1]  # as sequence_logprobs
        return self.value_head(hidden).squeeze(-1).to(torch.float32, copy=True)  # not a view (FSDP2's hooks)


class Critic:
    def __init__(self, args, device, dtype: torch.dtype, policy_vocab_size: int, dp: DataParallel | None = None):
        self.args = args
        self.dp = dp or DataParallel()  # data-parallel trainers: each updates on its slice, gradients summed
        name = args.critic_model or args.model
        self.model = ValueModel(name, device, dtype, args.seed, "--critic-model" if args.critic_model else "--model")
        self.model.train()
        self.model = prepare_model(self.model, args, self.dp, value_body=self.model.body)  # common/trainer/fsdp.py
        if self.model.vocab_size != policy_vocab_size:
            raise SystemExit(f"error: --critic-model {name}: vocabulary size {self.model.vocab_size} differs from the "
                             f"policy's {policy_vocab_size} (the critic must share the policy's tokenizer)")
        self.optimizer = build_optimizer(self.model, args.critic_lr, args.weight_decay)

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        """V before this step's update at every position ([B, T-1]; 0 where the response mask is 0): the baseline of
        GAE and the anchor of value clipping."""
        out = torch.zeros_like(batch.response_mask)
        for rows, mb in micro_batches(batch, torch.arange(len(batch)), self.args):
            out[rows] = self.model(mb.input_ids, mb.attention_mask, self.args.max_tokens_per_micro_batch > 0)
        return out * batch.response_mask

    # ALGO LOGIC: one critic optimizer step on a minibatch, micro-batched like the actor's (token-mean weighting).
    def update(self, batch: Batch, idx: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor) -> dict:
        """One optimizer step on minibatch `idx`; returns its metrics, a list of values each (one per micro-batch)."""
        args, stats = self.args, defaultdict(list)
        total_tokens = batch.response_mask[idx].sum().clamp(min=1)
        self.optimizer.zero_grad(set_to_none=True)
        for rows, mb in micro_batches(batch, idx, args, self.dp):  # this trainer's share (forward.py)
            values = self.model(mb.input_ids, mb.attention_mask, args.max_tokens_per_micro_batch > 0)
            if rows is None:  # sharded: an idle pass joins the busier trainers' collectives, adds zero
                (values.sum() * 0).backward()
                continue
            loss, clip_frac = clipped_value_loss(values, old_values[rows], returns[rows], mb.response_mask,
                                                 args.value_clip_eps)
            (loss * mb.response_mask.sum() / total_tokens).backward()
            stats["value_loss"].append(loss.item())
            stats["value_clip_frac"].append(clip_frac.item())
            stats["value/mean"].append(masked_mean(values.detach(), mb.response_mask).item())
        self.dp.all_reduce_gradients(list(self.model.parameters()), args.sync_bucket_mb)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.max_grad_norm)
        stats["value_grad_norm"].append(full_tensor(grad_norm).item())
        self.optimizer.step()
        return stats

    @torch.no_grad()
    def metrics(self, returns: torch.Tensor, old_values: torch.Tensor, mask: torch.Tensor, actor_updated: bool) -> dict:
        """The step's critic figures: mean return, explained variance of the returns by the values before the
        update (1: perfect, 0: no better than a constant), and whether the actor was frozen (warm-up)."""
        residual_var = masked_mean((returns - old_values - masked_mean(returns - old_values, mask)) ** 2, mask)
        returns_var = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
        return {"returns/mean": masked_mean(returns, mask).item(), "actor_frozen": float(not actor_updated),
                "value/explained_var": (1 - residual_var / returns_var).item() if returns_var > 0 else 0.0}

    # ---------------------------------------------------------------- checkpoint part: <checkpoint>/critic/
    def state(self) -> tuple[dict, dict]:
        """(whole weights, optimizer state) to save; a collective when sharded (common/trainer/fsdp.py)."""
        return full_state_dict(self.model), optimizer_state(self.model, self.optimizer)

    def save(self, checkpoint_dir: str, state: tuple[dict, dict] | None = None):
        weights, optimizer = state or self.state()
        folder = os.path.join(checkpoint_dir, "critic")
        os.makedirs(folder, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in weights.items()}, os.path.join(folder, "model.safetensors"))
        torch.save(optimizer, os.path.join(folder, "optimizer.pt"))

    def load(self, checkpoint_dir: str):
        folder = os.path.join(checkpoint_dir, "critic")
        if not os.path.exists(os.path.join(folder, "model.safetensors")):
            raise SystemExit(f"error: --resume {checkpoint_dir}: no critic/ in the checkpoint (not an --algo ppo run?)")
        device = "cpu" if self.dp.sharded else next(self.model.parameters()).device
        try:
            load_full_state_dict(self.model, load_file(os.path.join(folder, "model.safetensors"), device=str(device)))
        except RuntimeError as e:
            raise SystemExit(f"error: --resume {folder}: critic weights do not match the critic model "
                             f"({str(e).splitlines()[0]})") from None
        load_optimizer_state(self.model, self.optimizer, torch.load(os.path.join(folder, "optimizer.pt"),
                                                                    map_location="cpu"))
