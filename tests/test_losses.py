"""Losses and advantages against values computed by hand on tiny tensors; padding never counts."""

import math

import pytest
import torch

from types import SimpleNamespace

from common.trainer.losses import (ALGOS, MicroBatch, behaviour_weights, cispo_loss, config_kwargs, dr_grpo_loss,
                                   group_advantages, gspo_loss, kl_estimate, masked_mean,
                                   opmd_loss, ppo_clip_loss, reverse_kl_advantages)
from tests.conftest import entropy_from_logits


def _loss(fn, logp, old, adv, mask, token_weights=None, clip_eps=0.2, max_tokens=4, tau=0.1, clip_eps_high=None):
    """An algorithm's loss on one micro-batch that is the whole minibatch."""
    mb = MicroBatch(logp, old, adv, mask, token_weights, mask.sum().clamp(min=1), len(logp))
    args = SimpleNamespace(clip_eps_low=clip_eps, clip_eps_high=clip_eps if clip_eps_high is None else clip_eps_high,
                           max_new_tokens=max_tokens, opmd_tau=tau)
    return fn(mb, **config_kwargs(fn, args, 1))


def clipped_surrogate_loss(logp, old, adv, mask, clip_eps=0.2, token_weights=None):
    loss, stats = _loss(ppo_clip_loss, logp, old, adv, mask, token_weights, clip_eps)
    return loss, torch.tensor(stats["clip_frac"])


def test_every_algorithm_is_one_registered_loss():
    assert set(ALGOS) == {"grpo", "grpo_turn", "dr_grpo", "opmd", "ppo", "gspo", "cispo", "distill"}
    assert ALGOS["grpo"].loss is ALGOS["grpo_turn"].loss is ALGOS["ppo"].loss is ppo_clip_loss  # GRPO = PPO's surrogate, group advantages
    assert ALGOS["distill"].loss is ppo_clip_loss  # distillation: the same surrogate, the teacher's advantages
    assert [name for name, a in ALGOS.items() if a.critic] == ["ppo"]
    assert [name for name, a in ALGOS.items() if not a.group_signal] == ["ppo", "distill"]


def test_losses_take_the_config_fields_they_use_by_name():
    args = SimpleNamespace(clip_eps_low=0.3, clip_eps_high=0.4, max_new_tokens=7, opmd_tau=0.1, gamma=1.0, lam=0.9,
                           normalize_std=True)
    assert config_kwargs(ALGOS["dr_grpo"].loss, args, 1) == {"clip_eps_low": 0.3, "clip_eps_high": 0.4,
                                                             "max_new_tokens": 7}
    assert config_kwargs(ALGOS["ppo"].advantages, args, 2, critic="C") == {
        "critic": "C", "gamma": 1.0, "lam": 0.9, "normalize_std": True}
    assert config_kwargs(lambda mb, args: 0, args, 1) == {"args": args}  # a --loss-fn may take the whole config
    with pytest.raises(ValueError, match="'beta', which is no config field"):
        config_kwargs(lambda mb, beta: 0, args, 1)


def test_micro_batches_sum_to_the_minibatch_loss():
    """Each loss returns its share of the minibatch: split into micro-batches, the shares add up to the whole."""
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    adv, mask = torch.randn(4, generator=g), (torch.rand(4, 5, generator=g) > 0.3).float()
    args = SimpleNamespace(clip_eps_low=0.2, clip_eps_high=0.28, max_new_tokens=5, opmd_tau=0.1)
    for algo in ALGOS.values():
        kw = config_kwargs(algo.loss, args, 1)
        whole = algo.loss(MicroBatch(logp, old, adv, mask, None, mask.sum(), 4), **kw)[0]
        parts = sum(algo.loss(MicroBatch(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], None,
                                         mask.sum(), 4), **kw)[0] for i in (0, 2))
        assert parts.item() == pytest.approx(whole.item(), rel=1e-5)


def test_masked_mean_ignores_padding():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(x, mask).item() == pytest.approx((1 + 2 + 3) / 3)
    assert masked_mean(x, mask, dim=1).tolist() == pytest.approx([1.5, 3.0])
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, groups)
    # group 0: mean 0.25, population std sqrt(0.1875)
    std = math.sqrt(0.1875)
    assert adv[:4].tolist() == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], rel=1e-4)
    assert adv[4:].tolist() == [0.0, 0.0]  # all-equal group: no signal
    dr = group_advantages(rewards, groups, normalize_std=False)
    assert dr[:4].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_clipped_surrogate_by_hand():
    old = torch.zeros(2, 3)
    new = torch.log(torch.tensor([[1.5, 0.9, 1.0], [0.5, 1.1, 7.0]]))
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])  # the last column is padding (ratio 7 must not count)
    loss, clip_frac = clipped_surrogate_loss(new, old, adv, mask, clip_eps=0.2)
    # row 0 (A=+1): min(1.5, 1.2)=1.2, min(0.9, 0.9)=0.9; row 1 (A=-1): min(-0.5, -0.8)=-0.8, min(-1.1, -1.1)=-1.1
    assert loss.item() == pytest.approx(-(1.2 + 0.9 - 0.8 - 1.1) / 4, rel=1e-5)
    assert clip_frac.item() == pytest.approx(2 / 4)


def test_clipped_surrogate_gradient_sign():
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = clipped_surrogate_loss(logp, torch.zeros(1, 2), torch.tensor([2.0]), torch.ones(1, 2))
    loss.backward()
    assert (logp.grad < 0).all()  # descending the loss raises the log-prob of positively rewarded tokens


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    # log r = logp - ref = [0.5, -1.0]
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0])
    assert (kl_estimate(torch.randn(100), torch.randn(100), "k3") >= 0).all()
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")


def test_kl_k1_k3_unbiased_on_samples():
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.4, 0.4, 0.2])
    true_kl = (p * (p / q).log()).sum().item()
    x = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    for kind in ("k1", "k3"):
        assert kl_estimate(p.log()[x], q.log()[x], kind).mean().item() == pytest.approx(true_kl, abs=5e-3)


def test_entropy_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [1.0, 1e-9, 1e-9]]))
    ent = entropy_from_logits(logits)
    assert ent[0].item() == pytest.approx(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)), rel=1e-5)
    assert ent[1].item() == pytest.approx(0.0, abs=1e-6)


def test_behaviour_weights_by_hand():
    prox = torch.log(torch.tensor([0.5, 0.9, 0.3]))
    behav = torch.log(torch.tensor([0.5, 0.3, 0.6]))  # w = [1, 3, 0.5]
    assert behaviour_weights(prox, behav, "tis", cap=2.0).tolist() == pytest.approx([1.0, 2.0, 0.5])
    assert behaviour_weights(prox, behav, "decoupled", cap=2.0).tolist() == pytest.approx([1.0, 0.0, 0.5])
    with pytest.raises(ValueError):
        behaviour_weights(prox, behav, "none")


def test_token_weights_scale_the_objective():
    logp = torch.zeros(1, 2)
    w = torch.tensor([[2.0, 0.0]])
    loss, _ = clipped_surrogate_loss(logp, logp, torch.tensor([1.0]), torch.ones(1, 2), token_weights=w)
    assert loss.item() == pytest.approx(-(2.0 * 1.0 + 0.0) / 2)


def test_dr_grpo_uses_a_constant_normaliser():
    logp = torch.zeros(2, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([1.0, 1.0])
    loss, _ = _loss(dr_grpo_loss, logp, logp, adv, mask, max_tokens=4)
    # sums 2 and 4 over tokens, each / 4, mean over sequences -> -(0.5 + 1.0) / 2; a token mean would give -1
    assert loss.item() == pytest.approx(-0.75)
    tm, _ = clipped_surrogate_loss(logp, logp, adv, mask)
    assert tm.item() == pytest.approx(-1.0)


def test_opmd_value_and_gradient_sign():
    logp = torch.zeros(2, 3, requires_grad=True)
    old = torch.zeros(2, 3)
    centred = torch.tensor([0.5, -0.5])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, _ = _loss(opmd_loss, logp, old, centred, mask, tau=0.1)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 0.25) / 2)
    loss.backward()
    assert (logp.grad[0, :2] < 0).all() and (logp.grad[1] > 0).all()  # up for better-than-mean, down for worse
    assert (logp.grad[0, 2] == 0)  # padding gets no gradient
    # At log-ratio r/tau the sample is where mirror descent wants it: no gradient.
    at_target = torch.tensor([[0.5 / 0.1 / 2, 0.5 / 0.1 / 2, 0.0]], requires_grad=True)
    _loss(opmd_loss, at_target, torch.zeros(1, 3), torch.tensor([0.5]), torch.tensor([[1, 1, 0]]))[0].backward()
    assert at_target.grad.abs().max().item() < 1e-6


# ---------------------------------------------------------------- PPO with a critic, KL in the reward
def _close(tensor, expected):
    torch.testing.assert_close(tensor, torch.tensor(expected, dtype=tensor.dtype), atol=1e-6, rtol=1e-5)


def _gae_by_definition(rewards, values, mask, gamma, lam):
    """Per row, over the trained positions in order: A_t = sum_l (gamma lam)^l delta_{t+l},
    delta_t = r_t + gamma V_{t+1} - V_t, V after the last trained token = 0 (the paper's eq. 16, literally)."""
    adv = torch.zeros_like(values)
    for b in range(values.shape[0]):
        pos = [t for t in range(values.shape[1]) if mask[b, t]]
        v = [values[b, t].item() for t in pos] + [0.0]
        deltas = [rewards[b, t].item() + gamma * v[i + 1] - v[i] for i, t in enumerate(pos)]
        for i, t in enumerate(pos):
            adv[b, t] = sum((gamma * lam) ** l * d for l, d in enumerate(deltas[i:]))
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.0), (0.99, 0.5)])
def test_gae_matches_the_definition_on_random_tensors(gamma, lam):
    from common.trainer.losses import gae_advantages

    g = torch.Generator().manual_seed(int(gamma * 100 + lam * 10))
    rewards, values = torch.randn(5, 9, generator=g), torch.randn(5, 9, generator=g)
    mask = (torch.rand(5, 9, generator=g) > 0.3).float()
    mask[0, :3] = 0  # a prompt before the response, and rows with holes (env tokens) and no trained token at all
    mask[4] = 0
    adv, returns = gae_advantages(rewards, values, mask, gamma, lam)
    expected = _gae_by_definition(rewards, values, mask, gamma, lam)
    assert torch.allclose(adv, expected, atol=1e-5)
    assert torch.allclose(returns, (expected + values) * mask, atol=1e-5)
    assert adv[mask == 0].abs().max() == 0


def test_gae_places_the_outcome_reward_on_the_last_response_token():
    from common.trainer.losses import gae_advantages

    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 0, 0]])
    values = torch.tensor([[9.0, 0.5, 0.25, 0.5, 9.0], [9.0, 9.0, 0.5, 9.0, 9.0]])  # 9s are masked: never count
    adv, returns = gae_advantages(torch.tensor([1.0, -1.0]), values, mask, gamma=1.0, lam=1.0)
    # gamma = lam = 1: A_t = R - V_t, returns = R at every trained token
    _close(adv, [[0, 0.5, 0.75, 0.5, 0], [0, 0, -1.5, 0, 0]])
    _close(returns, [[0, 1, 1, 1, 0], [0, 0, -1, 0, 0]])
    # gamma 0.5, lam 0: one-step TD, A_t = r_t + 0.5 V_{t+1} - V_t
    adv, _ = gae_advantages(torch.tensor([1.0, -1.0]), values, mask, gamma=0.5, lam=0.0)
    assert adv[0].tolist() == pytest.approx([0, 0.5 * 0.25 - 0.5, 0.5 * 0.5 - 0.25, 1 - 0.5, 0])


def test_clipped_value_loss_by_hand():
    from common.trainer.losses import clipped_value_loss

    old = torch.tensor([[0.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, -0.1, 3.0]], requires_grad=True)
    returns = torch.tensor([[1.0, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 0]])  # the last position is padding
    loss, clip_frac = clipped_value_loss(values, old, returns, mask, clip_eps=0.2)
    # token 0: unclipped (0.5-1)^2 = 0.25, clipped V = 0.2 -> 0.64: max 0.64 (clipped); token 1: 1.21 both ways
    assert loss.item() == pytest.approx(0.5 * (0.64 + 1.21) / 2)
    assert clip_frac.item() == pytest.approx(0.5)
    loss.backward()
    # token 0 is clipped: no gradient (the clipped term does not depend on V there); token 1 pulls V up to R
    assert values.grad[0, 0] == 0 and values.grad[0, 1] < 0 and values.grad[0, 2] == 0
    no_clip, _ = clipped_value_loss(values, old, returns, mask, clip_eps=0.0)
    assert no_clip.item() == pytest.approx(0.5 * (0.25 + 1.21) / 2)


def test_clipped_value_loss_gradient_moves_values_towards_returns():
    from common.trainer.losses import clipped_value_loss

    values = torch.tensor([[0.0, 0.0]], requires_grad=True)
    loss, _ = clipped_value_loss(values, values.detach(), torch.tensor([[2.0, -3.0]]), torch.ones(1, 2), 0.2)
    loss.backward()
    assert values.grad[0, 0] < 0 < values.grad[0, 1]  # descending: V up towards 2, down towards -3
    _close(values.grad, [[-1.0, 1.5]])  # d/dV 0.5 (V-R)^2 / 2 tokens


def test_ppo_actor_loss_with_per_token_advantages():
    logp = torch.zeros(1, 3, requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, _ = clipped_surrogate_loss(logp, torch.zeros(1, 3), adv, mask)
    assert loss.item() == pytest.approx(-(1.0 - 2.0) / 2)
    loss.backward()
    # each token is pushed by its own advantage: up for A > 0, down for A < 0, padding untouched
    assert logp.grad[0, 0] < 0 < logp.grad[0, 1] and logp.grad[0, 2] == 0


def test_kl_in_the_reward_by_hand():
    from common.trainer.losses import gae_advantages, kl_penalized_rewards

    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    kl = torch.tensor([[5.0, 0.2, 0.4, 5.0], [0.1, 0.1, 0.1, 0.1]])
    shaped = kl_penalized_rewards(torch.tensor([1.0, 0.0]), kl, mask, kl_coef=0.5)
    _close(shaped, [[0, -0.1, 1 - 0.2, 0], [-0.05, -0.05, -0.05, -0.05]])
    assert shaped.sum(-1).tolist() == pytest.approx([1 - 0.5 * 0.6, -0.5 * 0.4])  # r - coef * sum KL
    # gamma = lam = 1 and V = 0: the advantage of a token is the shaped reward still to come
    adv, _ = gae_advantages(shaped, torch.zeros(2, 4), mask, 1.0, 1.0)
    assert adv[0].tolist() == pytest.approx([0, 0.7, 0.8, 0])


def test_masked_whiten():
    from common.trainer.losses import masked_whiten

    x = torch.tensor([[1.0, 3.0, 100.0]])
    w = masked_whiten(x, torch.tensor([[1, 1, 0]]))
    _close(w, [[-1.0, 1.0, 0.0]])


# ---------------------------------------------------------------- DAPO, GSPO, CISPO, distillation, rollout correction
def test_dapo_clip_higher_and_token_level_aggregation_by_hand():
    """DAPO (arXiv:2503.14476) eq. 10-12: clip(r, 1 - eps_low, 1 + eps_high), summed over every token of every
    sample and divided by the total token count."""
    old = torch.zeros(2, 4)
    new = torch.log(torch.tensor([[1.3, 0.7, 1.0, 1.0], [0.7, 1.3, 1.0, 1.0]]))
    adv, mask = torch.tensor([1.0, -1.0]), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    loss, stats = _loss(ppo_clip_loss, new, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    # A=+1: min(1.3, 1.28) = 1.28, min(0.7, 0.8) = 0.7; A=-1: min(-0.7, -0.8) = -0.8, min(-1.3, -1.28) = -1.3, -1, -1
    assert loss.item() == pytest.approx(-(1.28 + 0.7 - 0.8 - 1.3 - 1 - 1) / 6, rel=1e-5)
    assert stats["clip_frac"] == pytest.approx(2 / 6)
    symmetric, _ = _loss(ppo_clip_loss, new, old, adv, mask, clip_eps=0.2)  # 1.2 instead of 1.28
    assert symmetric.item() == pytest.approx(-(1.2 + 0.7 - 0.8 - 1.3 - 1 - 1) / 6, rel=1e-5)
    # token-level, not sample-level: the sample mean of the two rows would be (0.99 - 1.025) / 2
    assert loss.item() != pytest.approx(-(0.99 - 1.025) / 2, rel=1e-2)


def test_gspo_sequence_ratio_by_hand():
    """GSPO (arXiv:2507.18071) eq. 5-7: s_i = (pi/pi_old)^(1/|y_i|), min(s A, clip(s, 1-eps, 1+eps) A), mean over
    sequences; the gradient reaches every token of an unclipped sequence as s A / |y| and none of a clipped one."""
    old = torch.zeros(2, 4)
    new = torch.log(torch.tensor([[1.5, 1.0, 1.0, 1.0], [0.9, 1.0, 1.0, 7.0]])).requires_grad_()
    adv, mask = torch.tensor([1.0, -1.0]), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    loss, stats = _loss(gspo_loss, new, old, adv, mask, clip_eps=0.2)
    s0, s1 = 1.5 ** (1 / 2), 0.9 ** (1 / 3)  # 1.2247 (clipped to 1.2), 0.9655 (inside the band)
    assert loss.item() == pytest.approx(-(min(s0, 1.2) - s1) / 2, rel=1e-5)
    assert stats["clip_frac"] == pytest.approx(0.5)
    loss.backward()
    assert new.grad[0].abs().max().item() == 0  # clipped sequence: no gradient at all
    assert new.grad[1, :3].tolist() == pytest.approx([s1 / 2 / 3] * 3, rel=1e-5)
    assert new.grad[1, 3].item() == 0  # padding
    # the ratio is per sequence: one token far off moves the whole sequence's ratio, not only its own
    token_level, _ = _loss(ppo_clip_loss, new.detach(), old, adv, mask, clip_eps=0.2)
    assert token_level.item() != pytest.approx(loss.item(), rel=1e-3)


def test_cispo_clips_the_weight_and_keeps_every_token_by_hand():
    """CISPO (arXiv:2506.13585) eq. 4: sg(clip(r, 1-eps_low, 1+eps_high)) A log pi, token-summed over the total
    tokens: a clipped token still gets the gradient -w A / N (PPO's clip gives it 0)."""
    old = torch.zeros(2, 2)
    new = torch.log(torch.tensor([[1.5, 1.0], [0.5, 1.0]])).requires_grad_()
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 2)
    loss, stats = _loss(cispo_loss, new, old, adv, mask, clip_eps=0.2)
    # weights [1.2, 1.0], [0.8, 1.0]
    assert loss.item() == pytest.approx(-(1.2 * math.log(1.5) + 0.8 * -1 * math.log(0.5)) / 4, rel=1e-5)
    assert stats["clip_frac"] == pytest.approx(0.5)
    loss.backward()
    assert new.grad.flatten().tolist() == pytest.approx([-1.2 / 4, -1.0 / 4, 0.8 / 4, 1.0 / 4], rel=1e-5)
    ppo_new = new.detach().clone().requires_grad_()
    _loss(ppo_clip_loss, ppo_new, old, adv, mask, clip_eps=0.2)[0].backward()
    assert ppo_new.grad[0, 0].item() == 0 and ppo_new.grad[1, 0].item() == 0  # PPO drops the clipped tokens


def test_distillation_advantages_by_hand():
    """On-policy distillation: advantage_t = log pi_teacher(y_t) - log pi_student(y_t) (the negative per-token
    reverse KL), plus the task reward's group advantage times --distill-reward-coef."""
    from common.trainer.losses import distilled

    student = torch.tensor([[-1.5, -1.0, -9.0], [-0.5, -2.0, -1.0]])
    teacher = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.0, -3.0]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    assert reverse_kl_advantages(student, teacher, mask).tolist() == [[0.5, -1.0, 0.0], [0.0, 1.0, -2.0]]
    batch = SimpleNamespace(old_logprobs=student, response_mask=mask, group_ids=torch.tensor([0, 0]))
    pure = distilled(batch, torch.tensor([1.0, 0.0]), lambda b: teacher, 0.0, True)
    assert pure.advantages.tolist() == [[0.5, -1.0, 0.0], [0.0, 1.0, -2.0]]
    assert pure.metrics["distill/reverse_kl"] == pytest.approx((-0.5 + 1 + 0 - 1 + 2) / 5)
    mixed = distilled(batch, torch.tensor([1.0, 0.0]), lambda b: teacher, 0.5, False)  # group adv +-0.5
    assert mixed.advantages.flatten().tolist() == pytest.approx([0.75, -0.75, 0.0, -0.25, 0.75, -2.25])


def test_rollout_correction_menu_by_hand():
    """Row 0: token ratios w = [2, 2]; row 1: [0.5, 4] (its third token is not trained); cap C = 3."""
    prox = torch.zeros(2, 3)
    behaviour = -torch.log(torch.tensor([[2.0, 2.0, 1.0], [0.5, 4.0, 3.0]]))
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 0]])

    def w(mode, **kw):
        return (behaviour_weights(prox, behaviour, mode, 3.0, mask, **kw) * mask).flatten().tolist()

    assert w("tis") == pytest.approx([2, 2, 0, 0.5, 3, 0])              # token x truncate
    assert w("decoupled") == pytest.approx([2, 2, 0, 0.5, 0, 0])        # token x mask
    assert w("seq_tis") == pytest.approx([3, 3, 0, 2, 2, 0])            # sequence: prod 4 -> 3, prod 2
    assert w("seq_mask") == pytest.approx([0, 0, 0, 2, 2, 0])           # sequence: prod 4 > 3 masked
    assert w("icepop", floor=0.6) == pytest.approx([2, 2, 0, 0, 0, 0])  # band [0.6, 3], both sides masked
    # k3 of KL(mu || pi) per token = w - 1 - log w: row 0 mean 0.307, row 1 mean (0.193 + 1.614) / 2 = 0.903
    assert w("k3_reject", k3_max=0.5) == [1, 1, 0, 0, 0, 0]
    assert w("k3_reject", k3_max=1.0) == [1, 1, 0, 1, 1, 0]
    with pytest.raises(ValueError, match="bypass"):
        behaviour_weights(prox, behaviour, "bypass")  # no weights: the trainer does not call it
