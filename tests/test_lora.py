"""--lora-rank: the trainer trains fp32 adapters on a frozen base, and the explorers get the adapters (never the
weights merged on the bf16 grid): the update an engine applies is the trainer's, for the HF engine and vLLM on CPU."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from common import lora
from common.explorer.engine import HFEngine, SamplingConfig
from common.explorer.engine_vllm import vllm_available
from common.model import load_model, load_tokenizer
from common.weight_sync.base import Buffers, Folder
from common.weight_sync.checkpoint import write_sync_checkpoint
from conftest import TINY, run_in_process
from test_scale_trainer import make_trainer, uneven_experiences

pytestmark = pytest.mark.timeout(240)
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2"]
BF16 = ["--lora-rank", "8", "--lora-alpha", "16", "--dtype", "bfloat16"]  # the measurement: rank 8, scale 2
EXCHANGE_TOL = 0.10  # relative error of the update an engine applies (merged in bf16: 63 % lost here, 98 % on 135M)


def test_lora_trains_fp32_adapters_only_and_merges_like_peft():
    trainer = make_trainer(*LORA, "--gradient-checkpointing", "--max-tokens-per-micro-batch", "80")
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    metrics = trainer.train_step(uneven_experiences())
    assert metrics["grad_norm"] > 0
    assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if n in base)  # frozen

    sent = trainer.named_weights()  # the adapters alone, in fp32
    assert [n for n, _ in sent] == [n for n, _ in lora.adapter_tensors(trainer.model)]
    assert sent and all(n.endswith((".lora_A.weight", ".lora_B.weight")) and t.dtype == torch.float32 for n, t in sent)
    assert trainer.sync_metrics()["sync/bytes"] == sum(t.numel() * 4 for _, t in sent)
    merged = lora.merged_named_weights(trainer.model)  # --lora-sync merged, and final/
    hf = load_model("tiny")
    assert [n for n, _ in merged] == [n for n, _ in hf.named_parameters()]  # the explorers' names and order
    reference = dict(trainer.model.merge_and_unload(safe_merge=True).named_parameters())  # peft's own merge
    moved = 0.0
    for name, w in merged:
        assert torch.allclose(w, reference[name], atol=1e-7), name
        moved = max(moved, (w - dict(hf.named_parameters())[name]).abs().max().item())
    assert moved > 1e-4  # the adapters changed the merged weights


def test_bf16_base_keeps_fp32_adapters_and_adamw_state():
    trainer = make_trainer(*BF16, "--lr", "1e-3")
    trainer.train_step(uneven_experiences())
    params = dict(trainer.model.named_parameters())
    assert {p.dtype for n, p in params.items() if ".lora_" in n} == {torch.float32}
    assert {p.dtype for n, p in params.items() if ".lora_" not in n} == {torch.bfloat16}
    states = [s for s in trainer.optimizer.state.values() if s]
    assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in states)


def test_merged_sync_says_what_it_loses():
    """--lora-sync merged (or an engine without adapters): said in the run's first lines, measured each sync."""
    trainer = make_trainer(*BF16, "--lora-sync", "merged")
    mode, why = lora.resolve_sync(trainer.args, "tiny")
    assert mode == "merged" and "MERGED weights" in lora.describe(trainer.args, mode, why)
    assert [n for n, _ in trainer.named_weights()] == [n for n, _ in load_model("tiny").named_parameters()]
    _move_b(trainer.model, 1e-4, seed=0)
    assert trainer.sync_metrics()["lora/merge_lost"] > 0.5  # bf16: most of a +-1e-4 update
    fp32 = make_trainer(*LORA, "--lora-sync", "merged")
    _move_b(fp32.model, 1e-4, seed=0)
    assert lora.merge_lost_share(fp32.model) < 1e-3 and "lora/merge_lost" not in fp32.sync_metrics()
    assert "loses nothing (fp32)" in lora.describe(fp32.args, "merged", "--lora-sync merged")
    assert "adapters" == lora.resolve_sync(make_trainer(*BF16).args, "tiny")[0]  # auto, with the HF engine


def test_auto_sync_merges_for_vllm_on_cpus_in_fp32_only():
    """vLLM's CPU LoRA path samples slower the higher the rank, and an fp32 merge is exact: merged there; bf16 (the
    merge would lose the update) and GPUs (vLLM's LoRA kernels) keep the adapters."""
    args = make_trainer(*LORA).args
    args.engine = "vllm"
    assert lora.resolve_sync(args, "tiny")[0] == "merged"
    args.dtype = "bfloat16"
    assert lora.resolve_sync(args, "tiny")[0] == "adapters"
    args.dtype, args.explorer_devices = "float32", "cuda:0"
    assert lora.resolve_sync(args, "tiny")[0] == "adapters"


def test_lora_rank_alone_scales_the_learning_rate():
    from train_sync import Args
    from common.cli import parse_args

    without_lr = [a for a in TINY if a not in ("--lr", "1e-3")]
    alone = parse_args(Args, [*without_lr, "--lora-rank", "1"])
    given = parse_args(Args, [*without_lr, "--lora-rank", "1", "--lr", "3e-5"])
    assert alone.lr == pytest.approx(lora.LR_SCALE * Args().lr) and given.lr == 3e-5
    assert alone.lora_alpha == 32 and "o_proj" in alone.lora_target_modules and "down_proj" in alone.lora_target_modules


# ----------------------------------------------------------------------------- the update the explorer applies
def _move_b(model, size: float, seed: int) -> None:
    """Every entry of every B moves by +-size (what about ten AdamW steps at lr 1e-5 do, the issue's measurement)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in [t for n, t in lora.adapter_tensors(model) if n.endswith("lora_B.weight")]:
            b.add_(size * (torch.randint(0, 2, b.shape, generator=g) * 2 - 1).float())


def _deltas(named: list[tuple[str, torch.Tensor]], scale: float) -> dict[str, torch.Tensor]:
    """{module: scale * B @ A} from (`<module>.lora_A.weight`, A), (`<module>.lora_B.weight`, B) pairs."""
    return {a_name.removesuffix(".lora_A.weight"): lora.adapter_delta(a, b, scale)
            for (a_name, a), (_, b) in zip(named[::2], named[1::2])}


def _relative_error(applied: dict, wanted: dict) -> float:
    return (sum((applied[k] - w).square().sum() for k, w in wanted.items())
            / sum(w.square().sum() for w in wanted.values())).sqrt().item()


def test_hf_engine_applies_the_trainers_update_in_bf16(tmp_path):
    """bf16: the HF engine applies the trainer's adapter update to <= 10 % (merged weights lose most of it), for a
    +-1e-4 and a +-1e-3 update and for one accumulated over several syncs; its forward is the trainer's."""
    trainer = make_trainer(*BF16)
    spec = lora.LoraSpec.from_args(trainer.args)
    engine = HFEngine(load_model("tiny", dtype=torch.bfloat16), load_tokenizer("tiny"), lora=spec)
    base = dict(load_model("tiny", dtype=torch.bfloat16).named_parameters())
    version = 0
    for size in (1e-4, 1e-3, *[1e-4] * 4):  # the last four accumulate on the 1e-3 one
        _move_b(trainer.model, size, seed=version)
        version += 1
        folder = write_sync_checkpoint(str(tmp_path), trainer.named_weights(), version)  # checkpoint sync's files
        engine.load_weights(Folder(folder), version)
        wanted = _deltas(trainer.named_weights(), spec.scale)
        applied = _deltas(engine.weight_buffers(), spec.scale)  # the A and B its forward multiplies with
        assert _relative_error(applied, wanted) <= EXCHANGE_TOL, size
        if version == 1:  # what merged sync would have applied: most of a +-1e-4 update lost on the bf16 grid
            merged = dict(lora.merged_named_weights(trainer.model))
            lost = {k: merged[f"{k}.weight"].float() - base[f"{k}.weight"].float() for k in wanted}
            assert _relative_error(lost, wanted) > 0.5
            assert lora.merge_lost_share(trainer.model) > 0.5
    ids = torch.tensor([[256, 10, 20, 30, 40, 50]])
    with torch.no_grad():
        assert torch.equal(engine.model(input_ids=ids).logits, trainer.model(input_ids=ids).logits)


def test_hf_engine_static_loop_takes_adapter_updates_in_place():
    """The static decode loop decodes with the adapters as updated in place (the tensors a CUDA graph captured):
    greedy tokens follow the new adapters, equal to generate's."""
    from common.explorer.engine import StaticCacheSize

    trainer = make_trainer(*LORA)
    spec = lora.LoraSpec.from_args(trainer.args)
    static = HFEngine(load_model("tiny"), load_tokenizer("tiny"), lora=spec, static_cache=StaticCacheSize(8, 64))
    dynamic = HFEngine(load_model("tiny"), load_tokenizer("tiny"), lora=spec)
    buffers = [t.data_ptr() for _, t in static.weight_buffers()]
    greedy = SamplingConfig(temperature=0, max_new_tokens=12)
    before = static.generate([[256, 10, 20]], greedy)[0][0].response_ids
    _move_b(trainer.model, 0.5, seed=0)
    for engine in (static, dynamic):
        for (_, t), (_, src) in zip(engine.weight_buffers(), trainer.named_weights()):
            t.copy_(src)  # what broadcast and colocated sync do
        engine.load_weights(Buffers(), 1)
    after = static.generate([[256, 10, 20]], greedy)[0][0].response_ids
    assert [t.data_ptr() for _, t in static.weight_buffers()] == buffers  # in place
    assert after != before and after == dynamic.generate([[256, 10, 20]], greedy)[0][0].response_ids


# ----------------------------------------------------------------------------- vLLM on CPU: one adapter per version
needs_vllm = pytest.mark.skipif(not vllm_available()[0], reason=vllm_available()[1])


@pytest.fixture(scope="module")
def vllm_bf16(tmp_path_factory):
    """A bf16 vLLM engine serving rank-8 adapters, two versions kept (one engine for the module: vLLM starts in
    tens of seconds on the CPU)."""
    from common.explorer.engine_vllm import VLLMEngine
    from common.model import save_servable_tiny

    folder = save_servable_tiny(str(tmp_path_factory.mktemp("tiny-vllm-lora")), seed=0)
    spec = lora.LoraSpec(8, 16.0, tuple(lora.LoraSpec.from_args(make_trainer(*BF16).args).targets))
    engine = VLLMEngine(folder, dtype="bfloat16", kv_cache_gb=0.25, max_model_len=512, lora=spec, lora_versions=2)
    yield engine
    engine.close()


def _send(engine, trainer, version):
    """What broadcast and colocated sync do: the trainer's tensors into the engine's buffers, then load them."""
    sent = trainer.named_weights()
    assert [n for n, _ in engine.weight_buffers()] == [n for n, _ in sent]
    for (_, t), (_, src) in zip(engine.weight_buffers(), sent):
        t.copy_(src)
    engine.load_weights(Buffers(), version)


@needs_vllm
def test_vllm_applies_the_trainers_update_in_bf16(vllm_bf16, tmp_path):
    """bf16 vLLM on CPU: the update its LoRA buffers apply (read back from the worker, B' @ A) equals the trainer's
    to <= 10 % for a +-1e-4 and a +-1e-3 update and one accumulated over several syncs; its behaviour log-probs
    follow the trainer's adapters, not the base."""
    from common.trainer.forward import sequence_logprobs

    engine, trainer = vllm_bf16, make_trainer(*BF16)
    spec = lora.LoraSpec.from_args(trainer.args)
    prompt = [[256, 10, 20, 30]]
    for version, size in enumerate((0.0, 1e-4, 1e-3, *[1e-4] * 3)):
        _move_b(trainer.model, size, seed=version)
        _send(engine, trainer, version)
        assert engine.weights_checksum() == lora_hash(trainer)  # what arrived, bit for bit
        engine.generate(prompt, SamplingConfig(temperature=0, max_new_tokens=12))  # the adapter becomes active
        if version == 0:
            continue
        path = str(tmp_path / f"v{version}.safetensors")
        engine.llm.collective_rpc("tandem_lora_deltas", args=(version + 1, path))
        wanted = _deltas(trainer.named_weights(), spec.scale)
        applied = {k: v for k, v in load_file(path).items() if k in wanted}
        assert set(applied) == set(wanted)
        assert _relative_error(applied, wanted) <= EXCHANGE_TOL, size
    _move_b(trainer.model, 0.05, seed=99)  # an update the log-probs show
    _send(engine, trainer, 6)
    g = engine.generate(prompt, SamplingConfig(temperature=0, max_new_tokens=12))[0][0]
    ids = torch.tensor([g.prompt_ids + g.response_ids])
    with torch.no_grad():
        policy = sequence_logprobs(trainer.model, ids, torch.ones_like(ids), temperature=1.0)[0, len(prompt[0]) - 1:]
        with trainer.model.disable_adapter():
            base = sequence_logprobs(trainer.model, ids, torch.ones_like(ids), temperature=1.0)[0, len(prompt[0]) - 1:]
    behaviour = torch.tensor(g.logprobs)
    assert (behaviour - policy).abs().max() < 0.2 * (behaviour - base).abs().max()


def lora_hash(trainer):
    from common.weight_sync.base import weights_hash

    return weights_hash(trainer.named_weights())


@needs_vllm
def test_vllm_requests_keep_their_version_while_newer_ones_load(vllm_bf16):
    """A request keeps the adapter it started with (all its tokens are that version's) while newer versions load
    between decode steps; new requests take the newest; one whose version falls out of the kept ones restarts under
    the newest."""
    engine, trainer = vllm_bf16, make_trainer(*BF16)
    _send(engine, trainer, 10)
    owner, done = object(), {}
    sampling = SamplingConfig(temperature=0, max_new_tokens=24)  # greedy: the same tokens every run
    engine.add(owner, "old", [256, 10, 20], 24, sampling)
    engine.step(owner)
    _move_b(trainer.model, 1e-3, seed=1)
    _send(engine, trainer, 11)  # two kept: 10 (in use) and 11
    engine.add(owner, "new", [256, 30, 40], 24, sampling)
    while engine.running(owner):
        done.update(engine.step(owner))
    assert set(done["old"].versions) == {10} and set(done["new"].versions) == {11}
    restarted = engine.lora_restarted
    engine.add(owner, "stale", [256, 50, 60], 24, sampling)
    engine.step(owner)
    _send(engine, trainer, 12)
    _send(engine, trainer, 13)  # 11 is past the two kept: its request restarts under 13
    while engine.running(owner):
        done.update(engine.step(owner))
    assert set(done["stale"].versions) == {13} and engine.lora_restarted == restarted + 1


def _sync_hashes(out_dir):
    events = [json.loads(line) for name in os.listdir(out_dir / "timeline") for line in open(out_dir / "timeline" / name)]
    pick = lambda proc: {e["version"]: e["hash"] for e in events
                         if e["process"] == proc and e["phase"].startswith("sync") and "hash" in e}
    return pick("trainer0"), pick("explorer0")


def test_lora_run_explorer_holds_the_trainers_adapters_after_every_sync(tmp_path):
    out = tmp_path / "run"
    r = run_in_process("train_sync.py", *TINY, *LORA, "--steps", "3", "--checkpoint-every", "2", "--verify-sync",
                       "--out-dir", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    sent, got = _sync_hashes(out)
    assert sorted(sent) == [0, 1, 2, 3] and sent == got
    assert "explorers get the adapters (fp32, unmerged" in r.stdout
    adapter_bytes = sum(t.numel() * 4 for _, t in lora.adapter_tensors(make_trainer(*LORA).model))
    assert {json.loads(line)["sync/bytes"] for line in open(out / "metrics.jsonl")} == {adapter_bytes}
    final = load_file(out / "final" / "model.safetensors")  # a plain HF folder of the merged weights
    init = dict(load_model("tiny").named_parameters())
    assert set(final) == set(init) - {"lm_head.weight"}  # tied head left out, as save_pretrained does
    assert max((final[k] - init[k]).abs().max().item() for k in final) > 1e-4
    # final/ is the model and tokenizer only; step checkpoints keep the adapter to resume from
    assert os.path.exists(out / "checkpoints" / "step_2" / "adapter" / "adapter_model.safetensors")
    # resumes the adapter from checkpoints/step_2 (step 3 is off the --checkpoint-every grid)
    r = run_in_process("train_sync.py", *TINY, *LORA, "--steps", "4", "--verify-sync", "--resume", "--out-dir",
                       str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert [json.loads(l)["step"] for l in open(out / "metrics.jsonl")][-1] == 4
