"""Trainer-level memory levers in one process: padding-free packing and activation checkpointing change how the
work is done, not the gradients (policy, reference and critic)."""

import random

import pytest
import torch

from common.cli import parse_args
from common.experience import Experience
from common.trainer.trainer import Trainer
from conftest import TINY

pytestmark = pytest.mark.timeout(180)


def uneven_experiences(n=8, seed=0, vocab=256):
    """Very uneven lengths: responses of 1 to 60 tokens behind 3..6-token prompts; two-sample groups."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, r = rng.randint(3, 6), [1, 60, 2, 45, 3, 30, 5, 58][i % 8]
        out.append(Experience([rng.randrange(vocab) for _ in range(p)], [rng.randrange(vocab) for _ in range(r)],
                              [-rng.random() * 3 for _ in range(r)], [1] * r, float(i % 3 == 0), i // 2, f"t{i}", 0))
    return out


def make_trainer(*flags):
    from train_sync import Args

    args = parse_args(Args, [*TINY, "--minibatch-size", "8", "--micro-batch-size", "8", *flags])
    torch.manual_seed(0)
    return Trainer(args, torch.device("cpu"))


def grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_packed_and_checkpointed_equal_padded(algo):
    extra = ["--algo", algo, "--kl-coef", "0.1", "--off-policy-correction", "tis", "--ppo-epochs", "2",
             "--minibatch-size", "8"]
    runs = {}
    for name, flags in {"padded": [], "packed+ckpt": ["--max-tokens-per-micro-batch", "70", "--gradient-checkpointing"]}.items():
        trainer = make_trainer(*extra, *flags)
        metrics = trainer.train_step(uneven_experiences())
        runs[name] = (metrics, grads(trainer.model), dict(trainer.model.named_parameters()),
                      grads(trainer.critic.model) if trainer.critic else {})
    metrics, g_ref, p_ref, c_ref = runs["padded"]
    assert metrics["grad_norm"] > 0 and abs(metrics["loss"]) > 0 and metrics["kl"] > 0
    for name in ("packed+ckpt",):
        m, g, p, c = runs[name]
        # (per-micro-batch metrics such as "loss" and "kl" are means over differently cut micro-batches)
        for k in g_ref:
            assert torch.allclose(g[k], g_ref[k], atol=1e-5), (name, k, (g[k] - g_ref[k]).abs().max())
            assert torch.allclose(p[k], p_ref[k], atol=1e-5), (name, k)
        for k in c_ref:
            assert torch.allclose(c[k], c_ref[k], atol=1e-5), (name, k)


@pytest.mark.parametrize("flags, message", [
    (["--trainer-shard", "zero3"], "--trainer-shard 'zero3': not one of none, fsdp"),
    (["--fsdp-cpu-offload"], "--fsdp-cpu-offload needs --trainer-shard fsdp"),
    (["--fsdp-cpu-offload", "--trainer-shard", "fsdp"], "--fsdp-cpu-offload needs cuda --trainer-devices"),
    (["--max-tokens-per-micro-batch", "-1"], "--max-tokens-per-micro-batch must be >= 0"),
    (["--lora-rank", "4", "--trainer-shard", "fsdp", "--lora-sync", "merged"],
     "--lora-sync merged with --trainer-shard fsdp is not supported"),
    (["--lora-rank", "4", "--lora-target-modules", " , "], "--lora-target-modules must name at least one module"),
])
def test_memory_flags_are_one_line_errors(flags, message):
    from train_sync import Args

    with pytest.raises(SystemExit, match=message):
        parse_args(Args, [*TINY, *flags])


def test_lora_target_modules_must_exist():
    with pytest.raises(SystemExit, match="--lora-target-modules nope: none of these modules is in the model"):
        make_trainer("--lora-rank", "4", "--lora-target-modules", "nope")
