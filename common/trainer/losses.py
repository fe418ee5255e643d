"""Losses and advantages as small pure functions over tensors (hand-checkable; see tests/test_losses.py), and the
registry of algorithms, `ALGOS` (at the end): each `--algo` is one loss function plus one advantage estimator.

Shapes: per-token tensors are [B, T] with a 0/1 `mask` of the same shape; padding and prompt tokens have mask 0
and never count.

Adding an algorithm = one loss function with the signature `loss(mb: MicroBatch, args) -> (loss, stats)` + one
line in `ALGOS` (and its name in config.py's `--algo` Literal). A loss from outside the package: `--loss-fn
module:function` or `--loss-fn path/to/file.py:function` (same signature; the advantages stay --algo's).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution at every position: [..., V] -> [...]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over positions where mask is 1 (0 where nothing is masked in)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO: reward minus its group's mean, divided by the group's std when `normalize_std` (arXiv:2402.03300).

    One advantage per sample ([B]); samples of one task share a group id. A group whose rewards are all equal
    gets advantage 0 (no signal).
    """
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in group_ids.unique():
        idx = group_ids == g
        r = rewards[idx].float()
        centred = r - r.mean()
        if normalize_std:
            centred = centred / (r.std(unbiased=False) + eps) if r.numel() > 1 else centred * 0
        adv[idx] = centred
    return adv


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from samples of the policy (Schulman, "Approximating KL", 2020).

    k1 = log r', k2 = (log r')^2 / 2, k3 = exp(-log r') - 1 + log r', where log r' = logp - logp_ref.
    k1 is unbiased but noisy and can go negative; k3 is unbiased and always >= 0; k2 is biased, low variance.
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"kl estimator must be k1, k2 or k3, got {kind!r}")


# ---------------------------------------------------------------- ALGO LOGIC: PPO with a critic, KL in the reward
def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Outcome rewards [B] placed on each row's last trained token: [B, T] (rows with no trained token get none)."""
    has_token = mask.sum(-1) > 0
    last = mask.shape[-1] - 1 - mask.flip(-1).float().argmax(-1)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    out[has_token, last[has_token]] = rewards[has_token].float()
    return out


def kl_penalized_rewards(rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """PPO-RLHF reward shaping (Ziegler et al. arXiv:1909.08593): -kl_coef * KL on every trained token plus the outcome
    reward on the last one: [B, T]. Summed over tokens it is the sequence reward r - kl_coef * sum_t KL_t."""
    return last_token_rewards(rewards, mask) - kl_coef * kl.detach() * mask


@torch.no_grad()
def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                   lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (arXiv:1506.02438) over the trained tokens of each row.

    `rewards` is [B] (outcome reward, placed on the last trained token) or [B, T] per-token rewards; `values` [B, T]
    are the critic's V(s_t) at the same positions. Untrained positions (mask 0: prompt, padding, env tokens) are
    skipped: the recursion runs over the trained tokens only, the value after the last one is 0 (terminal).
    Returns (advantages, returns = advantages + values), both 0 where mask is 0.
    """
    if rewards.dim() == 1:
        rewards = last_token_rewards(rewards, mask)
    mask = mask.float()
    values = values.float() * mask
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = m * (delta + gamma * lam * running) + (1 - m) * running
        next_value = m * values[:, t] + (1 - m) * next_value
        advantages[:, t] = running * m
    return advantages, (advantages + values) * mask


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """x minus its mean over masked positions, divided by their std (PPO's advantage normalisation); 0 elsewhere."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) / (var.sqrt() + eps) * mask


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       clip_eps: float = 0.2):
    """PPO value loss with value clipping (arXiv:1707.06347; as in OpenAI baselines ppo2): 0.5 * max((V - R)^2,
    (V_clip - R)^2) with V_clip = V_old + clamp(V - V_old, -eps, eps), token mean. clip_eps 0: no clipping.
    Returns (loss, fraction of tokens where the clipped term was the larger one)."""
    unclipped = (values - returns) ** 2
    if clip_eps <= 0:
        return 0.5 * masked_mean(unclipped, mask), torch.zeros((), device=values.device)
    clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask), masked_mean((clipped > unclipped).float(), mask)


# ====================================================================================== ALGO LOGIC: the algorithms
@dataclass
class MicroBatch:
    """What an algorithm's loss sees: one micro-batch of the minibatch being optimised (b sequences, T positions).
    The loss returns its share of the minibatch loss (normalised by `minibatch_tokens` or `minibatch_seqs`), so the
    trainer can sum micro-batches and data-parallel trainers without knowing which algorithm runs."""
    logprobs: torch.Tensor              # [b, T] log-probs of the policy being trained (with gradient)
    old_logprobs: torch.Tensor          # [b, T] the ratio's denominator: behaviour log-probs, or the proximal
                                        #        policy's under --off-policy-correction
    advantages: torch.Tensor            # [b] one per sequence (group estimators) or [b, T] per token (GAE)
    mask: torch.Tensor                  # [b, T] 1 on trained response tokens
    token_weights: torch.Tensor | None  # [b, T] importance weights pi_prox / mu (no gradient), or None
    minibatch_tokens: torch.Tensor      # trained tokens in the whole minibatch (all data-parallel trainers)
    minibatch_seqs: int                 # sequences in the whole minibatch


def clipped_objective(mb: MicroBatch, clip_eps_low: float, clip_eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token clipped objective min(r A, clip(r, 1-eps_low, 1+eps_high) A) (arXiv:1707.06347; DAPO's
    clip-higher, arXiv:2503.14476 eq. 10, when eps_high > eps_low), times the importance weights when given:
    ([b, T] objective, [b, T] 1.0 where the clipped term won)."""
    advantages = mb.advantages[:, None].expand_as(mb.logprobs) if mb.advantages.dim() == 1 else mb.advantages
    ratio = torch.exp(mb.logprobs - mb.old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high) * advantages
    objective = torch.minimum(unclipped, clipped)
    if mb.token_weights is not None:
        objective = objective * mb.token_weights.detach()
    return objective, (clipped < unclipped).float()


def ppo_clip_loss(mb: MicroBatch, clip_eps_low: float, clip_eps_high: float) -> tuple[torch.Tensor, dict]:
    """grpo and ppo: the clipped surrogate averaged over every trained token of the minibatch (GRPO,
    arXiv:2402.03300, with group advantages; PPO with GAE advantages from the critic). Summing over all tokens of
    all samples before dividing is DAPO's token-level aggregation (arXiv:2503.14476 eq. 12): a long response weighs
    in proportion to its tokens, not as one sample."""
    objective, clipped = clipped_objective(mb, clip_eps_low, clip_eps_high)
    loss = -(objective * mb.mask).sum() / mb.minibatch_tokens
    return loss, {"clip_frac": masked_mean(clipped, mb.mask).item()}


def dr_grpo_loss(mb: MicroBatch, clip_eps_low: float, clip_eps_high: float,
                 max_new_tokens: int) -> tuple[torch.Tensor, dict]:
    """Dr. GRPO (arXiv:2503.20783): the clipped surrogate summed over tokens and divided by a constant
    (--max-new-tokens per sequence) instead of each response's length, so long wrong answers are not favoured;
    a mean over the minibatch's sequences. Used with unnormalised group advantages."""
    objective, clipped = clipped_objective(mb, clip_eps_low, clip_eps_high)
    loss = -(objective * mb.mask).sum() / (max_new_tokens * mb.minibatch_seqs)
    return loss, {"clip_frac": masked_mean(clipped, mb.mask).item()}


def gspo_loss(mb: MicroBatch, clip_eps_low: float, clip_eps_high: float) -> tuple[torch.Tensor, dict]:
    """GSPO (arXiv:2507.18071 eq. 5-7): one importance ratio per sequence, length-normalised,
    s = (pi(y|x) / pi_old(y|x))^(1/|y|) = exp(mean_t log r_t), clipped per sequence:
    min(s A, clip(s, 1-eps_low, 1+eps_high) A), averaged over the minibatch's sequences. The paper's ranges are
    tiny (3e-4, 4e-4: configs/gspo.yaml) because s is a geometric mean. Importance weights, when given, enter as
    each sequence's mean weight."""
    lengths = mb.mask.sum(-1)
    seq_log_ratio = ((mb.logprobs - mb.old_logprobs) * mb.mask).sum(-1) / lengths.clamp(min=1)  # [b]
    s = torch.exp(seq_log_ratio)
    unclipped = s * mb.advantages
    clipped = s.clamp(1 - clip_eps_low, 1 + clip_eps_high) * mb.advantages
    objective = torch.minimum(unclipped, clipped) * (lengths > 0)  # a row with no trained token adds nothing
    if mb.token_weights is not None:
        objective = objective * masked_mean(mb.token_weights.detach(), mb.mask, dim=-1)
    loss = -objective.sum() / mb.minibatch_seqs
    trained = lengths > 0
    if not bool(trained.any()):
        return loss, {"clip_frac": 0.0, "gspo/seq_ratio_mean": 1.0}
    return loss, {"clip_frac": (clipped < unclipped)[trained].float().mean().item(),
                  "gspo/seq_ratio_mean": s[trained].mean().item()}


def cispo_loss(mb: MicroBatch, clip_eps_low: float, clip_eps_high: float) -> tuple[torch.Tensor, dict]:
    """CISPO (MiniMax-M1, arXiv:2506.13585 eq. 4): the REINFORCE term A log pi on every token, weighted by the
    token's importance ratio clipped to [1-eps_low, 1+eps_high] and detached (stop-gradient). Unlike PPO's clip,
    no token's gradient is dropped: clipping bounds the weight only. Token-level aggregation over the minibatch."""
    advantages = mb.advantages[:, None].expand_as(mb.logprobs) if mb.advantages.dim() == 1 else mb.advantages
    ratio = torch.exp(mb.logprobs - mb.old_logprobs).detach()
    weight = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)
    clip_frac = masked_mean((weight != ratio).float(), mb.mask).item()
    if mb.token_weights is not None:
        weight = weight * mb.token_weights.detach()
    loss = -(weight * advantages * mb.logprobs * mb.mask).sum() / mb.minibatch_tokens
    return loss, {"clip_frac": clip_frac}


def opmd_loss(mb: MicroBatch, opmd_tau: float) -> tuple[torch.Tensor, dict]:
    """Kimi k1.5 online mirror descent surrogate (arXiv:2501.12599, eq. 3): per sequence
    (r - mean_r - tau * log pi/pi_old)^2 with the group's mean reward standing in for tau log Z, halved and
    averaged over the minibatch's sequences. The squared log-ratio keeps the update near pi_old, so off-policy
    samples are tolerated. The advantages are the centred rewards r - mean_r ([b])."""
    seq_log_ratio = ((mb.logprobs - mb.old_logprobs) * mb.mask).sum(-1)  # [b]
    loss = 0.5 * ((mb.advantages - opmd_tau * seq_log_ratio) ** 2).sum() / mb.minibatch_seqs
    return loss, {"clip_frac": 0.0}


@dataclass
class Advantages:
    advantages: torch.Tensor               # [B] per sequence or [B, T] per token
    returns: torch.Tensor | None = None    # [B, T] the critic's targets (GAE)
    values: torch.Tensor | None = None     # [B, T] the critic's values before this step's update (GAE)
    metrics: dict = field(default_factory=dict)  # the estimator's own numbers for the step's row


def group_normalised(batch, rewards: torch.Tensor, normalize_std: bool) -> Advantages:
    """GRPO: reward minus the group mean, divided by the group std when --normalize-std. `rewards` [B] or, with
    --kl-mode reward, [B, T] per token (summed per sequence here)."""
    return Advantages(group_advantages(rewards if rewards.dim() == 1 else rewards.sum(-1), batch.group_ids,
                                       normalize_std=normalize_std))


def group_centred(batch, rewards: torch.Tensor) -> Advantages:
    """dr_grpo and opmd: reward minus the group mean, never divided by the std."""
    return Advantages(group_advantages(rewards if rewards.dim() == 1 else rewards.sum(-1), batch.group_ids,
                                       normalize_std=False))


def gae(batch, rewards: torch.Tensor, critic, gamma: float, lam: float, normalize_std: bool) -> Advantages:
    """ppo: per-token GAE advantages from the critic's values before this update, whitened over the batch when
    --normalize-std; the returns are the critic's targets."""
    values = critic.values(batch)
    advantages, returns = gae_advantages(rewards, values, batch.response_mask, gamma, lam)
    if normalize_std:
        advantages = masked_whiten(advantages, batch.response_mask)
    return Advantages(advantages, returns, values)


def reverse_kl_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
    """On-policy distillation (Thinking Machines, "On-Policy Distillation", 2025; Qwen3 report sec. 4.5): on the
    student's own samples, each token's advantage is the negative per-token reverse KL estimate
    log pi_teacher(y_t) - log pi_student(y_t): tokens the teacher finds likelier than the student did go up.
    [B, T] -> [B, T], 0 where mask is 0."""
    return (teacher_logprobs - student_logprobs) * mask


def distilled(batch, rewards: torch.Tensor, teacher_logprobs: Callable, distill_reward_coef: float,
              normalize_std: bool) -> Advantages:
    """distill: per-token reverse-KL advantages against --teacher on the student's samples (behaviour log-probs),
    plus --distill-reward-coef x the task reward's group advantage. distill/reverse_kl is the mean per-token
    KL(student || teacher) estimate: it falls as the student learns."""
    advantages = reverse_kl_advantages(batch.old_logprobs, teacher_logprobs(batch), batch.response_mask)
    metrics = {"distill/reverse_kl": -masked_mean(advantages, batch.response_mask).item()}
    if distill_reward_coef:
        task = group_normalised(batch, rewards, normalize_std).advantages
        advantages = advantages + distill_reward_coef * task[:, None] * batch.response_mask
    return Advantages(advantages, metrics=metrics)


def turn_returns(turn_rewards: torch.Tensor, turn_ends: torch.Tensor, mask: torch.Tensor,
                 gamma: float = 1.0) -> torch.Tensor:
    """Per token, the discounted return from its turn on: G_k = r_k + gamma * G_{k+1} over the turns k of a row
    (`turn_rewards` sits at each turn's last sampled token, marked by `turn_ends`); every token of turn k gets
    G_k; 0 where mask is 0. [B, T] -> [B, T]."""
    out = torch.zeros_like(turn_rewards)
    running = torch.zeros(turn_rewards.shape[0], dtype=turn_rewards.dtype, device=turn_rewards.device)
    for t in range(turn_rewards.shape[1] - 1, -1, -1):
        end = turn_ends[:, t] > 0
        running = torch.where(end, turn_rewards[:, t] + gamma * running, running)
        out[:, t] = running
    return out * mask


def turn_group_advantages(returns: torch.Tensor, turn_ends: torch.Tensor, mask: torch.Tensor,
                          group_ids: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Turn-level GRPO: each token's turn return minus the mean of every turn return in its group (all turns of
    all samples of the task), divided by their std when `normalize_std`. Equal returns everywhere: 0."""
    adv = torch.zeros_like(returns)
    for g in group_ids.unique():
        rows = group_ids == g
        values = returns[rows][turn_ends[rows] > 0].float()
        if values.numel() == 0:
            continue
        centred = returns[rows] - values.mean()
        if normalize_std:
            centred = centred / (values.std(unbiased=False) + eps) if values.numel() > 1 else centred * 0
        adv[rows] = centred * mask[rows]
    return adv


def turn_normalised(batch, rewards: torch.Tensor, gamma: float, normalize_std: bool) -> Advantages:
    """grpo_turn: per-turn rewards (the environment's step rewards, the verifier's score and shaping at the last
    turn) -> discounted turn returns (--gamma) -> group-normalised per token. A single-turn sample is one turn, so
    this is grpo there."""
    returns = turn_returns(batch.turn_rewards, batch.turn_ends, batch.response_mask, gamma)
    return Advantages(turn_group_advantages(returns, batch.turn_ends, batch.response_mask, batch.group_ids,
                                            normalize_std))


@dataclass(frozen=True)
class Algo:
    """One line of `ALGOS`. Both functions take what they use by name: a parameter named like a config field gets
    that field (`clip_eps_low`, `gamma`, ...), one named `args` the whole config, `critic` the critic,
    `teacher_logprobs` the teacher's log-probs of a batch (`config_kwargs`)."""
    loss: Callable               # (MicroBatch, **fields) -> (loss share of the minibatch, stats)
    advantages: Callable         # (batch, rewards, **fields) -> Advantages
    critic: bool = False         # needs a learned value model (common/trainer/critic.py)
    teacher: bool = False        # needs --teacher (common/trainer/teacher.py)

    @property
    def group_signal(self) -> bool:
        """Whether a group whose rewards are all equal gets advantage 0 (no critic, no teacher gives it another)."""
        return not (self.critic or self.teacher)


def config_kwargs(fn: Callable, args, skip: int, **given) -> dict:
    """The keyword arguments of `fn` after its first `skip` parameters: `given` ones, the whole config for a
    parameter named `args`, else the config field of the same name (a name that is none of these: ValueError)."""
    out = {}
    for name in list(inspect.signature(fn).parameters)[skip:]:
        if name in given:
            out[name] = given[name]
        elif name == "args":
            out[name] = args
        elif hasattr(args, name):
            out[name] = getattr(args, name)
        else:
            raise ValueError(f"{fn.__name__}() takes {name!r}, which is no config field")
    return out


ALGOS: dict[str, Algo] = {
    "grpo": Algo(ppo_clip_loss, group_normalised),
    "grpo_turn": Algo(ppo_clip_loss, turn_normalised),
    "dr_grpo": Algo(dr_grpo_loss, group_centred),
    "opmd": Algo(opmd_loss, group_centred),
    "ppo": Algo(ppo_clip_loss, gae, critic=True),
    "gspo": Algo(gspo_loss, group_normalised),
    "cispo": Algo(cispo_loss, group_normalised),
    "distill": Algo(ppo_clip_loss, distilled, teacher=True),
}
