"""Losses and advantages against values computed by hand on tiny tensors; padding never counts."""

import math

import pytest
import torch

from types import SimpleNamespace

from common.trainer.losses import (ALGOS, MicroBatch, behaviour_weights, config_kwargs, dr_grpo_loss, entropy_from_logits, group_advantages,
                           kl_estimate, masked_mean, opmd_loss, ppo_clip_loss)


def _loss(fn, logp, old, adv, mask, token_weights=None, clip_eps=0.2, max_tokens=4, tau=0.1):
    """An algorithm's loss on one micro-batch that is the whole minibatch."""
    mb = MicroBatch(logp, old, adv, mask, token_weights, mask.sum().clamp(min=1), len(logp))
    return fn(mb, **config_kwargs(fn, SimpleNamespace(clip_eps=clip_eps, max_new_tokens=max_tokens, opmd_tau=tau), 1))


def clipped_surrogate_loss(logp, old, adv, mask, clip_eps=0.2, token_weights=None):
    loss, stats = _loss(ppo_clip_loss, logp, old, adv, mask, token_weights, clip_eps)
    return loss, torch.tensor(stats["clip_frac"])


def test_every_algorithm_is_one_registered_loss():
    assert set(ALGOS) == {"grpo", "grpo_turn", "dr_grpo", "opmd", "ppo"}
    assert ALGOS["grpo"].loss is ALGOS["grpo_turn"].loss is ALGOS["ppo"].loss is ppo_clip_loss  # GRPO = PPO's surrogate, group advantages
    assert [name for name, a in ALGOS.items() if a.critic] == ["ppo"]


def test_losses_take_the_config_fields_they_use_by_name():
    args = SimpleNamespace(clip_eps=0.3, max_new_tokens=7, opmd_tau=0.1, gamma=1.0, lam=0.9, normalize_std=True)
    assert config_kwargs(ALGOS["dr_grpo"].loss, args, 1) == {"clip_eps": 0.3, "max_new_tokens": 7}
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
    args = SimpleNamespace(clip_eps=0.2, max_new_tokens=5, opmd_tau=0.1)
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
