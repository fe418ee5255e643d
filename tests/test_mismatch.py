"""Train-inference mismatch (mismatch/* in every metrics row) and the sequence-level correction geo_mask: the
HF engine and the trainer with the same fp32 weights agree to < 1e-4; perturbed behaviour log-probs show up."""

import pytest
import torch

from common.cli import parse_args
from common.experience import Experience
from conftest import TINY

pytestmark = pytest.mark.timeout(180)


def engine_experiences(args, shift=lambda i: 0.0):
    """Samples of the tiny model by the HF engine with the weights the trainer starts from; row i's behaviour
    log-probs moved by shift(i)."""
    from common.explorer.engine import HFEngine, SamplingConfig
    from common.model import build_tiny_tokenizer, load_model

    torch.manual_seed(0)
    engine = HFEngine(load_model("tiny", seed=args.seed), build_tiny_tokenizer())
    prompts = [[5 + i, 17, 33 + i, 40] for i in range(4)]
    groups = engine.generate(prompts, SamplingConfig(temperature=args.temperature, max_new_tokens=8, n=2))
    out = []
    for g, samples in enumerate(groups):
        for j, s in enumerate(samples):
            i = len(out)
            out.append(Experience(s.prompt_ids, s.response_ids, [lp + shift(i) for lp in s.logprobs],
                                  [1] * len(s.response_ids), float(j), g, f"t{g}", 0))
    return out


def step(flags, shift=lambda i: 0.0) -> dict:
    from common.trainer.trainer import Trainer
    from train_sync import Args

    args = parse_args(Args, [*TINY, "--minibatch-size", "8", "--micro-batch-size", "4", *flags])
    experiences = engine_experiences(args, shift)
    return Trainer(args, torch.device("cpu")).train_step(experiences)


@pytest.mark.parametrize("epochs", ["1", "2"])  # the first minibatch's own forward / no proximal pass, and a 2nd epoch
def test_same_fp32_weights_agree_and_perturbed_log_probs_show(epochs):
    same = step(["--ppo-epochs", epochs])
    assert same["mismatch/logp_abs_max"] < 1e-4 and 0 <= same["mismatch/k3"] < 1e-8, same
    moved = step(["--ppo-epochs", epochs], shift=lambda i: 0.5 if i % 2 else -0.5)
    assert moved["mismatch/logp_abs_mean"] == pytest.approx(0.5, abs=1e-3)
    assert moved["mismatch/logp_abs_max"] == pytest.approx(0.5, abs=1e-3) and moved["mismatch/k3"] > 0.1


def test_geo_mask_drops_whole_far_sequences_and_trains_on_the_rest():
    # Rows 0-3 as sampled, rows 4-7 with behaviour log-probs 3 higher: their geometric-mean ratio is e^-3 < 1/2.
    out = step(["--off-policy-correction", "geo_mask"], shift=lambda i: 3.0 if i >= 4 else 0.0)
    assert out["mismatch/logp_abs_mean"] == pytest.approx(1.5, abs=1e-3)  # the proximal pass: the whole batch
    assert out["correction/weight_mean"] == pytest.approx(0.5, abs=1e-3) and out["grad_norm"] > 0


def test_geo_mask_weights():
    from common.trainer.losses import behaviour_weights

    prox = torch.zeros(3, 4)
    behaviour = torch.tensor([[0.0, 0.0, 0.0, -2.0],   # one extreme token: geometric mean e^0.5, kept
                              [1.0, 1.0, 1.0, 1.0],    # e^-1 < 1/2: masked whole
                              [0.1, 0.1, 9.0, 0.1]])   # the 9 is past the mask: e^-0.1, kept
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 1]])
    w = behaviour_weights(prox, behaviour, "geo_mask", 2.0, mask)
    assert torch.allclose(w, torch.tensor([[0.5] * 4, [-1e9] * 4, [-0.1] * 4]).exp())
