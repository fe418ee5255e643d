"""Memory decided before any model loads (common/memory.py): a run that cannot fit stops in one line naming the flag;
what the user left open is chosen to fit; a packed micro-batch's activations grow linearly with its tokens."""

import copy
import re

import pytest
import torch

from common.cli import parse_args
from common.knobs import ConfigError
from common.memory import (CUDA_CONTEXT_BYTES, GIB, SLACK, ModelShape, explorer_bytes, forward_bytes, lora_params,
                           lora_state_bytes, model_config, plan_memory, sync_bytes, trainer_estimate)
from conftest import TINY, run_in_process
from train_sync import Args


def _config_folder(tmp_path, name: str, **shape) -> str:
    """A model folder with a config (Qwen2 architecture of this shape) and a tokenizer, and no weights at all: a
    check that loaded the model would fail on it."""
    from transformers import Qwen2Config

    from common.model import build_tiny_tokenizer

    folder = tmp_path / name
    Qwen2Config(**shape).save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    return str(folder)


QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
QWEN_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
QWEN_72B = dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False)


def test_a_model_that_cannot_fit_stops_in_one_line_before_any_model_loads(tmp_path):
    """72 B parameters in fp32 need 290 GB for the explorer's weights alone, and the trainer's AdamW over 1 TB: no
    machine's CPU memory holds them. The folder has no weights, so the line must come before anything tries to load
    them."""
    folder = _config_folder(tmp_path, "big", **QWEN_72B)
    proc = run_in_process("train_sync.py", *TINY, "--model", folder, "--out-dir", str(tmp_path / "run"))
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: --model") and "does not fit" in lines[0] and "GiB" in lines[0], lines[0]
    assert "--dtype bfloat16" in lines[0], lines[0]
    assert not (tmp_path / "run" / "timeline").exists()  # no worker started


def test_a_7b_lora_policy_fits_one_80gb_gpu_colocated_where_full_fine_tuning_does_not(tmp_path):
    """Qwen2.5-7B-shaped, bf16, trainer and a vLLM explorer (35 % of the GPU) on one 80 GB GPU: with LoRA rank 16
    the frozen base (15 GB), fp32 adapters with gradients and AdamW state (0.6 GB) and the activations fit; full
    fine-tuning's weights, gradients and moments alone (61 GB) do not, and the error names --lora-rank."""
    folder = _config_folder(tmp_path, "qwen7b", **QWEN_7B)
    shape = ModelShape.from_config(model_config(folder))
    assert 7.6e9 < shape.params < 7.7e9  # Qwen2.5-7B's published size
    gpu = {"cuda:0": (79 * GIB, 80 * GIB)}

    def colocated(*flags):
        args = _args(folder, "--vllm-gpu-memory-utilization", "0.35", *flags, explorers="cuda:0")
        args.engine = "vllm"
        return args

    args = colocated("--lora-rank", "16")
    assert lora_state_bytes(shape, args, 2) == shape.params * 2 + 16 * lora_params(shape, args)  # fp32 adapters
    assert 40e6 < lora_params(shape, args) < 41e6  # rank 16 on the 7 projections of 28 layers
    plan_memory(args, 64 + 512, args.given_fields, gpu)  # fits (choosing what was left open, if it must)
    estimate = trainer_estimate(shape, args, "cuda", args.micro_batch_size * 576, args.micro_batch_size * 512,
                                args.gradient_checkpointing)
    assert estimate.peak + 0.35 * 80 * GIB < 79 * GIB
    with pytest.raises(ConfigError, match="does not fit a trainer on cuda:0: .*--lora-rank 16"):
        plan_memory(colocated(), 64 + 512, frozenset(), gpu)


def _args(folder, *extra, trainers="cuda:0", explorers="cuda:1"):
    """Parsed on this machine (CPU devices), then placed on GPUs: plan_memory gets their memory as a table."""
    argv = ["--model", folder, "--taskset", "parity", "--tasks-per-step", "8", "--samples-per-task", "2",
            "--max-new-tokens", "512", "--engine", "hf", "--dtype", "bfloat16", *extra]
    args = parse_args(Args, argv)
    args.trainer_devices, args.explorer_devices = trainers, explorers
    return args


def test_cpu_offload_moves_the_states_to_host_memory_and_lora_gains_the_frozen_base_s_room(tmp_path):
    """One FSDP2 trainer on an 80 GB GPU beside a vLLM explorer (35 %), Qwen2.5-7B-shaped in bf16. With
    --fsdp-cpu-offload the trainer's states are host memory and the GPU keeps the activations, or, while the model
    loads, the whole model: full fine-tuning (61 GB of states) does not fit without it, the error names it, and
    with it the run fits; LoRA's frozen base leaves the GPU, so a micro-batch almost twice as large fits; a host too
    small is one line naming --fsdp-cpu-offload."""
    folder = _config_folder(tmp_path, "qwen7b", **QWEN_7B)
    shape = ModelShape.from_config(model_config(folder))
    gpu, host = {"cuda:0": (79 * GIB, 80 * GIB)}, {"cpu": (200 * GIB, 256 * GIB)}

    parsed = {}

    def one_gpu(*flags, offload=False):  # parsed with CPU trainers, which refuse --fsdp-cpu-offload: set after
        if flags not in parsed:
            parsed[flags] = _args(folder, "--vllm-gpu-memory-utilization", "0.35", "--trainer-shard", "fsdp", *flags,
                                  explorers="cuda:0")
        args = copy.copy(parsed[flags])  # the plan sets what was left open
        args.engine, args.fsdp_cpu_offload = "vllm", offload
        return args

    with pytest.raises(ConfigError, match="does not fit a trainer on cuda:0: weights, gradients and AdamW state .*"
                                          "use --fsdp-cpu-offload"):
        plan_memory(one_gpu(), 576, frozenset(), gpu)
    report = {}
    plan_memory(one_gpu(offload=True), 576, frozenset(), {**gpu, **host}, report)
    assert ("trainer states", 4 * shape.params * 2, "--fsdp-cpu-offload") in report["cpu"]  # bf16 AdamW, 1 shard
    with pytest.raises(ConfigError, match=r"^error: --fsdp-cpu-offload: the trainers' shards, gradients and AdamW "
                                          r"state need 56\.\d GiB of host memory on cpu"):
        plan_memory(one_gpu(offload=True), 576, frozenset(), {**gpu, "cpu": (40 * GIB, 64 * GIB)})

    lora = ["--lora-rank", "16", "--micro-batch-size", "16", "--no-gradient-checkpointing"]
    fits = {}
    for offload in (False, True):
        with pytest.raises(ConfigError, match=r"--micro-batch-size 16: .*--micro-batch-size (\d+) fits") as e:
            args = one_gpu(*lora, offload=offload)
            plan_memory(args, 576, args.given_fields, {**gpu, **host})
        fits[offload] = int(re.search(r"--micro-batch-size (\d+) fits", str(e.value)).group(1))
    assert fits[True] >= fits[False] + 3, fits  # 7 sequences of 576 tokens where 4 fit
    estimate = trainer_estimate(shape, one_gpu(*lora, offload=True), "cuda", 0, 0, True)
    assert estimate.load == shape.params * 2 and estimate.host == lora_state_bytes(shape, one_gpu(*lora), 2)


def test_what_was_left_open_is_chosen_to_fit_and_a_given_flag_is_named(tmp_path):
    folder = _config_folder(tmp_path, "qwen", **QWEN_1_5B)
    shape = ModelShape.from_config(model_config(folder))
    assert 1.5e9 < shape.params < 1.6e9 and 1.3e9 < shape.body_params < 1.32e9  # Qwen2.5-1.5B's published sizes
    seq = 64 + 512

    def peak(args, ckpt, rows):  # + the broadcast bucket trainer 0 packs (the embedding: larger than 256 MB)
        return trainer_estimate(shape, args, "cuda", rows * seq, rows * 512, ckpt).peak + \
            sync_bytes(shape, args, "broadcast", "trainer", source=True)[0]

    def plan(args, budget):  # the trainer's GPU to itself
        return plan_memory(args, seq, args.given_fields, {"cuda:0": (budget, 80 * GIB), "cuda:1": (80 * GIB, 80 * GIB)})

    base = _args(folder)
    assert base.micro_batch_size == 8 and not base.gradient_checkpointing
    full, ckpt8, ckpt2, ckpt3 = (peak(base, False, 8), peak(base, True, 8), peak(base, True, 2), peak(base, True, 3))
    assert ckpt2 < ckpt3 < ckpt8 < full
    # enough memory: nothing changes, nothing said
    args = _args(folder)
    assert plan(args, full * 1.01) == [] and not args.gradient_checkpointing and args.micro_batch_size == 8
    # between: checkpointing turns on, the micro-batch stays
    args = _args(folder)
    notes = plan(args, (full + ckpt8) / 2)
    assert args.gradient_checkpointing and args.micro_batch_size == 8 and "--gradient-checkpointing on" in notes[0]
    # less: checkpointing and a smaller micro-batch
    args = _args(folder)
    notes = plan(args, (ckpt2 + ckpt3) / 2)
    assert args.gradient_checkpointing and args.micro_batch_size == 2, notes
    assert "--micro-batch-size 2" in notes[-1]
    # the same memory with --micro-batch-size given: one line naming it and what fits
    args = _args(folder, "--micro-batch-size", "8", "--gradient-checkpointing")
    with pytest.raises(ConfigError, match=r"--micro-batch-size 8: .* needs .* GiB .*: --micro-batch-size 2 fits"):
        plan(args, (ckpt2 + ckpt3) / 2)
    # --no-gradient-checkpointing given: never turned on
    args = _args(folder, "--no-gradient-checkpointing", "--micro-batch-size", "8")
    with pytest.raises(ConfigError, match="add --gradient-checkpointing"):
        plan(args, (full + ckpt8) / 2)
    # less than the weights, gradients and AdamW state: the flags that shard or shrink them
    args = _args(folder)
    with pytest.raises(ConfigError, match="does not fit a trainer on cuda:0: .*--trainer-shard fsdp"):
        plan(args, shape.params * 2 * 4 * 0.9)
    # --algo distill: the teacher's weights (frozen: no gradients, no AdamW state) count on the trainer's device
    args = _args(folder, "--algo", "distill", "--teacher", folder)
    alone, with_teacher = (trainer_estimate(shape, args, "cuda", 8 * seq, 8 * 512, False, teacher=t) for t in (None, shape))
    assert with_teacher.states - alone.states == shape.params * 2  # bf16
    assert "--gradient-checkpointing on" in plan(args, full * 1.01)[0]  # what fitted alone no longer does
    # --teacher-device: the teacher counts there instead (its weights and logits), and must fit there
    args = _args(folder, "--algo", "distill", "--teacher", folder, "--teacher-device", "cuda:1")
    assert plan(args, full * 1.01) == []
    need = shape.params * 2 + SLACK * forward_bytes(shape, 2, 8 * seq) + CUDA_CONTEXT_BYTES  # beside the explorer
    explorer = explorer_bytes(shape, args, "cuda", 80 * GIB, seq) + sync_bytes(shape, args, "broadcast", "explorer")[0]
    room = {"cuda:0": (full * 1.01, 80 * GIB), "cuda:1": (explorer + need * 1.01, 80 * GIB)}
    assert plan_memory(args, seq, frozenset(), room) == []
    with pytest.raises(ConfigError, match=f"--teacher {folder} does not fit --teacher-device cuda:1: .* need"):
        plan_memory(args, seq, frozenset(), {**room, "cuda:1": (explorer + need * 0.99, 80 * GIB)})
    # a colocated vLLM explorer takes its share of the GPU first; asking more than is free is its flag
    args = _args(folder, explorers="cuda:0")
    args.engine = "vllm"
    with pytest.raises(ConfigError, match=r"--vllm-gpu-memory-utilization 0.5: vLLM .* would take 40.6 GiB"):
        plan_memory(args, seq, frozenset(), {"cuda:0": (20 * GIB, 80 * GIB)})


def _saved_bytes(model, rows: int, length: int) -> int:
    """Bytes autograd keeps for the backward of one packed forward of `rows` sequences of `length` tokens."""
    from common.trainer.forward import sequence_logprobs

    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    ids = torch.randint(0, model.config.vocab_size, (rows, length))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sequence_logprobs(model, ids, torch.ones_like(ids), packed=True)
    return total


def test_packed_activations_grow_linearly_with_tokens():
    """Twice the sequences of a packed micro-batch keep twice the bytes for the backward (attention runs per
    sequence: nothing of size tokens x tokens), measured on what autograd saves."""
    from common.model import load_model
    from common.trainer.forward import use_packed_attention

    model = load_model("tiny")
    model.config.use_cache = False
    use_packed_attention(model)
    sizes = {rows: _saved_bytes(model, rows, 128) for rows in (4, 8, 16)}
    assert sizes[16] - sizes[8] == pytest.approx(2 * (sizes[8] - sizes[4]), rel=0.02), sizes
    assert sizes[16] / sizes[4] < 4.2, sizes


def test_packed_gradients_equal_padded_with_gradient_checkpointing():
    """The per-sequence attention of a packed micro-batch also holds where checkpointing recomputes each layer in
    the backward (outside the forward's call): same log-probs and gradients as padded rows."""
    from common.model import load_model
    from common.trainer.forward import sequence_logprobs, use_packed_attention

    model = load_model("tiny")
    model.config.use_cache = False
    use_packed_attention(model)
    ids = torch.randint(0, model.config.vocab_size, (3, 40))
    attention = torch.ones_like(ids)
    attention[0, 30:] = 0
    attention[2, 12:] = 0

    def run(packed: bool):
        model.zero_grad()
        logprobs = sequence_logprobs(model, ids, attention, packed=packed)
        logprobs.sum().backward()
        return logprobs.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    padded = run(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    packed = run(True)
    assert torch.allclose(packed[0], padded[0], atol=1e-5)
    assert torch.allclose(packed[1], padded[1], atol=1e-5)


def test_the_weight_hand_off_must_fit_the_real_shared_memory(tmp_path):
    """trainer0's colocated slot on the CPU holds the whole model in /dev/shm (a container's is 64 MB unless given
    more): a model larger than this machine's free /dev/shm is one line naming --shm-size before any model loads;
    smaller, or synced by checkpoints, it passes. The free space is /dev/shm's own (statvfs); the margins leave room
    for what the other test worker writes there meanwhile."""
    import shutil

    from common.buckets import shared_memory_dir

    free = shutil.disk_usage(shared_memory_dir()).free
    rows = lambda factor: int(factor * free / (64 * 2))  # a bf16 embedding of 64 columns (tied) ~ the whole model
    ample = {"cpu": (1e15, 1e15)}
    for factor, method, fits in [(1.5, "auto", False), (0.5, "auto", True), (1.5, "checkpoint", True)]:
        folder = _config_folder(tmp_path, f"wide{factor}{method}", hidden_size=64, intermediate_size=64,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                vocab_size=rows(factor), tie_word_embeddings=True)
        args = _args(folder, "--sync-method", method, trainers="cpu", explorers="cpu")
        if fits:
            plan_memory(args, 576, args.given_fields, ample)
        else:
            with pytest.raises(ConfigError, match=r"has .* free and the colocated weight hand-off lays out .* there "
                                                  r"\(--model .*--shm-size="):
                plan_memory(args, 576, args.given_fields, ample)
