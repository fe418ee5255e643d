"""The device placement of the train step, the weight sync and the explorer's generation, checked without a GPU:
they run on the CPU under tests/fake_device.py, which marks what a GPU run would hold on the GPU and raises where
CUDA would (a CPU index tensor into a GPU tensor is fine, a GPU index into a CPU tensor is not, ...)."""

import functools
import json
import os

import pytest
import torch

from common.cli import parse_args
from conftest import TINY, reference_varlen_attn
from fake_device import FAKE, FakeDevice, on_device

pytestmark = pytest.mark.timeout(180)


def test_the_fake_device_raises_where_cuda_does():
    with FakeDevice():
        x = torch.arange(4).to(FAKE)
        assert x.device == FAKE and on_device(x) and on_device(torch.zeros(2, device=x.device))
        assert on_device(x[torch.tensor([0, 1])])  # a CPU index into a device tensor
        assert on_device(x * torch.tensor(2))      # a 0-dim CPU tensor is a scalar
        assert not on_device(x.cpu()) and on_device(x)
        with pytest.raises(RuntimeError, match="indices should be either on cpu or on the same device"):
            torch.arange(4)[torch.argsort(x)]
        with pytest.raises(RuntimeError, match="expected all tensors to be on the same device"):
            x + torch.arange(4)


@pytest.mark.parametrize("micro_batches", [["--micro-batch-size", "2"], ["--max-tokens-per-micro-batch", "64"]],
                         ids=["padded", "packed"])
def test_train_step_on_a_device(micro_batches, monkeypatch):
    import common.trainer.forward
    from common.trainer.trainer import Trainer
    from test_scale_trainer import uneven_experiences
    from train_sync import Args

    packed, calls = "--max-tokens-per-micro-batch" in micro_batches, []
    if packed:  # the GPU's varlen call, a reference for its kernel, counted
        from torch.nn.attention import varlen

        @functools.wraps(reference_varlen_attn)  # the same signature: the caller asks it which keywords it takes
        def counted(*args, **kwargs):
            calls.append(1)
            return reference_varlen_attn(*args, **kwargs)
        monkeypatch.setattr(common.trainer.forward, "_varlen_runs", lambda query, dropout: True)
        monkeypatch.setattr(varlen, "varlen_attn", counted)
    args = parse_args(Args, [*TINY, "--minibatch-size", "4", *micro_batches, "--kl-coef", "0.01"])
    torch.manual_seed(0)
    with FakeDevice():
        trainer = Trainer(args, FAKE)
        assert all(on_device(p) for p in trainer.model.parameters())
        before = [p.detach().clone() for p in trainer.model.parameters()]
        metrics = trainer.train_step(uneven_experiences())
        assert all(on_device(p) for p in trainer.model.parameters())
    assert metrics["grad_norm"] > 0 and any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert bool(calls) == packed  # packed micro-batches ran tandem's packed attention, which the trainer gave its model


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generation_on_a_device(cache):
    from common.explorer.engine import HFEngine, SamplingConfig, StaticCacheSize
    from common.model import build_tiny_tokenizer, load_model

    tokenizer = build_tiny_tokenizer()
    static = StaticCacheSize(8, 64) if cache == "static" else None  # 4 rows + 4 padding rows
    with FakeDevice():
        engine = HFEngine(load_model("tiny", FAKE), tokenizer, static_cache=static)
        out = engine.generate([[5, 6, 7], [8, 9]], SamplingConfig(temperature=1.0, max_new_tokens=6, n=2))
    assert [len(g) for g in out] == [2, 2] and all(len(s.logprobs) == len(s.response_ids) > 0 for g in out for s in g)


def sync_ranks(ctx, comm: str, out: str):
    """Trainer 0 broadcasts its weights (on the device) to an explorer's HF engine (on the device) through buffers
    on `comm` (the CPU: gloo, colocated; the device: nccl), as common/weight_sync/broadcast.py does; the explorer
    then generates with them."""
    from common.explorer.engine import HFEngine, SamplingConfig
    from common.model import build_tiny_tokenizer, load_model
    from common.weight_sync import Buffers, weights_hash
    from common.weight_sync.broadcast import broadcast_weights

    device = FAKE if comm == "device" else torch.device("cpu")
    with FakeDevice(collectives=comm):
        model = load_model("tiny", FAKE, seed=ctx.rank)  # different weights on each side until the sync
        if ctx.role == "trainer":
            named = list(model.named_parameters())
            broadcast_weights(named, 3, ctx.sync_src, ctx.sync_group, device)
        else:
            engine = HFEngine(model, build_tiny_tokenizer())
            named = engine.weight_buffers()
            version, _ = broadcast_weights(named, 0, ctx.sync_src, ctx.sync_group, device)
            engine.load_weights(Buffers(), version)
            engine.generate([[5, 6, 7]], SamplingConfig(max_new_tokens=4))
        placed = all(on_device(t) for _, t in model.named_parameters())
    with open(os.path.join(out, f"{ctx.name}.json"), "w") as f:
        json.dump({"hash": weights_hash(list(model.named_parameters())), "on_device": placed}, f)


@pytest.mark.parametrize("comm", ["cpu", "device"])
def test_weight_sync_on_a_device(tmp_path, comm):
    from common.runtime.launcher import run_function

    run_function("test_fake_device:sync_ranks", 1, 1, comm, str(tmp_path))
    trainer, explorer = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("trainer0", "explorer0"))
    assert trainer["hash"] == explorer["hash"] and trainer["on_device"] and explorer["on_device"]
