"""Placement by itself (common/placement.py) and what follows from where ranks run: the plan for nodes this
machine is not (--plan), a torchrun CPU world placed by the same rule, the world's backend from every rank's physical
place (two nodes, one GPU visible per rank, FSDP2 CPU offload), the weight sync's memory in the plan, and a colocated
vLLM engine started before its trainer loads."""

import os
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from common.cli import parse_args
from common.knobs import ConfigError
from common.memory import GIB
from common.runtime.launcher import run_function
from common.placement import plan_report
from common.runtime.worker import Place, WorkerContext, choose_backend
from conftest import ROOT, TINY, assert_trained, run_in_process

SHAPES = {  # public configs (bench/memory.py MODELS)
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
GPU_FLAGS = ["--dtype", "bfloat16", "--engine", "vllm", "--max-new-tokens", "512", "--tasks-per-step", "32",
             "--samples-per-task", "8", "--minibatch-size", "64", "--micro-batch-size", "8"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Config-only folders of the 1.5B and 7B shapes (a tokenizer, no weights: loading one would fail)."""
    from transformers import Qwen2Config

    from common.model import build_tiny_tokenizer

    out = {}
    for name, shape in SHAPES.items():
        folder = tmp_path_factory.mktemp(name)
        Qwen2Config(**shape).save_pretrained(folder)
        build_tiny_tokenizer().save_pretrained(folder)
        out[name] = str(folder)
    return out


def _planned(script: str, *argv: str):
    import importlib

    args = parse_args(importlib.import_module(script).Args, ["--plan", *argv])
    return args, plan_report(args)


@pytest.mark.parametrize("size", ["1.5B", "7B"])
def test_plan_for_1_2_4_8_gpus_and_two_nodes(models, size):
    """--plan on nodes this machine is not: every GPU busy, trainers first then explorers, each GPU's planned peak
    within its 80 GiB, an explorer per GPU holding the model, and several trainers sharded."""
    for gpus, nnodes in ((1, 1), (2, 1), (4, 1), (8, 1), (8, 2)):
        if size == "7B" and gpus == 1:  # vLLM's half of the GPU and 7B's weights, gradients and AdamW state: no
            with pytest.raises(ConfigError, match="does not fit a trainer on cuda:0: .*colocated slot.* --lora-rank"):
                _planned("train_async", "--model", models[size], *GPU_FLAGS, "--gpus", "1")
            continue
        args, r = _planned("train_async", "--model", models[size], *GPU_FLAGS, "--gpus", str(gpus),
                           "--gpu-memory-gb", "80", "--nnodes", str(nnodes))
        trainers, explorers = args.trainer_device_list, args.explorer_device_list
        world = gpus * nnodes
        if world == 1:
            assert trainers == explorers == ["cuda:0"], r["placement"]
        else:
            assert len(trainers) + len(explorers) == world, r["placement"]
            assert args.num_explorers == len(explorers) >= 1
            assert args.trainer_shard == ("fsdp" if len(trainers) > 1 else "none")
            if nnodes == 1:  # one rank per GPU, explorers last
                assert trainers + explorers == [f"cuda:{i}" for i in range(world)]
            else:  # torchrun on each node: every rank its own GPU
                assert set(trainers + explorers) == {"cuda"}
        devices = r["devices"]
        gpus_used = [k for k in devices if not k.startswith("cpu")]
        assert len(gpus_used) == world, devices
        for key in gpus_used:
            peak = sum(b for _, b, _ in devices[key])
            assert 0 < peak <= 80 * GIB, (key, devices[key])
        if world > 1:
            explorer_rows = [w for k in gpus_used for w in devices[k] if w[0].startswith("explorer")]
            # the weights go into vLLM's worker by broadcast: a bucket there, no model copy in host memory
            assert all("receive bucket" in w[2] and "/dev/shm" not in w[2] for w in explorer_rows)
        if size == "7B" and world >= 4:  # 7B's weights, gradients and AdamW state do not fit one 80 GiB trainer
            assert len(trainers) >= 2


def test_sync_colocates_when_trainer0_fits_beside_the_explorer_else_splits(models):
    args, r = _planned("train_sync", "--model", models["1.5B"], *GPU_FLAGS, "--gpus", "4")
    assert args.trainer_device_list == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"] and args.explorer_devices == "cuda:0"
    assert "never generates and trains at once" in r["placement"]
    assert any("colocated slot" in w[2] for w in r["devices"]["cuda:0"])
    # a 24 GiB card: vLLM's half and the trainer's share of 7B do not fit one GPU together
    args, r = _planned("train_sync", "--model", models["7B"], *GPU_FLAGS, "--gpus", "4", "--gpu-memory-gb", "40")
    assert args.explorer_devices == "cuda:3" and len(args.trainer_device_list) == 3, r["placement"]
    assert "gets a GPU of its own" in r["placement"]


def test_explicit_flags_are_kept_and_explorer_gpus_overrides(models):
    args = parse_args(__import__("train_async").Args, ["--model", models["1.5B"], *GPU_FLAGS, "--plan", "--gpus", "8",
                                                       "--explorer-devices", "cuda:7", "--trainer-devices", "cuda:0"])
    assert (args.explorer_devices, args.trainer_devices, args.trainer_shard) == ("cuda:7", "cuda:0", "none")
    assert not hasattr(args, "placement")
    args, _ = _planned("train_async", "--model", models["1.5B"], *GPU_FLAGS, "--gpus", "8", "--explorer-gpus", "2")
    assert args.explorer_devices == "cuda:6,cuda:7" and args.num_explorers == 2
    with pytest.raises(ConfigError, match="--explorer-gpus places the workers itself"):
        parse_args(__import__("train_async").Args, ["--explorer-gpus", "2", "--trainer-devices", "cpu"])
    with pytest.raises(ConfigError, match=r"--explorer-gpus 7 leaves 1 of 8 GPUs to the trainers and --model .* needs"):
        parse_args(__import__("train_async").Args, ["--model", models["7B"], *GPU_FLAGS, "--plan", "--gpus", "8",
                                                    "--gpu-memory-gb", "40", "--explorer-gpus", "7"])


def test_a_served_judge_gets_a_gpu_of_its_own_and_is_counted_there(models):
    """--judge-model without --judge-url or --judge-device on a GPU node: the judge on the node's last GPU and the
    workers on the rest by the same rule, its weights, KV cache and forward counted there; one GPU: shared and
    counted, or one line when it does not fit; a given --judge-device is kept."""
    from common.explorer.judge_vllm import kv_cache_bytes
    from common.memory import ModelShape, model_config

    judge = ["--judge-model", models["1.5B"]]
    args, r = _planned("train_async", "--model", models["1.5B"], *GPU_FLAGS, *judge, "--gpus", "4")
    assert args.judge_device == "cuda:3" and args.judge_engine == "vllm", r["placement"]
    assert args.trainer_device_list + args.explorer_device_list == ["cuda:0", "cuda:1", "cuda:2"], r["placement"]
    assert "round(3 x" in r["placement"] and "the served judge on cuda:3, a GPU of its own" in r["placement"]
    shape = ModelShape.from_config(model_config(models["1.5B"]))
    assert args.judge_max_model_len == 2 * (512 + r["sequence"] + 7 * 512)  # its longest request, twice
    (name, need, engine), = r["devices"]["cuda:3"]
    kv = kv_cache_bytes(model_config(models["1.5B"]), args.judge_max_model_len)
    assert (name, engine) == ("judge", "vllm") and need > shape.params * 4 + kv > shape.params * 4 + 2 ** 29
    args, r = _planned("train_sync", "--model", models["1.5B"], *GPU_FLAGS, *judge, "--gpus", "2")
    assert (args.trainer_devices, args.explorer_devices, args.judge_device) == ("cuda:0", "cuda:0", "cuda:1")
    assert [w[0] for w in r["devices"]["cuda:1"]] == ["judge"]
    args, r = _planned("train_async", "--model", models["1.5B"], *GPU_FLAGS, *judge, "--gpus", "4",
                       "--judge-device", "cpu", "--judge-engine", "hf")
    assert len(args.trainer_device_list + args.explorer_device_list) == 4 and args.judge_device == "cpu"
    assert [w[2] for w in r["devices"]["cpu"] if w[0] == "judge"] == ["hf"] * 2  # one per explorer
    args, r = _planned("train_async", "--model", models["1.5B"], *GPU_FLAGS, *judge, "--gpus", "1")
    assert args.judge_device == "cuda:0" and "the served judge shares cuda:0" in r["placement"]
    assert [w[0] for w in r["devices"]["cuda:0"]] == ["explorer0", "judge", "trainer0"]
    with pytest.raises(ConfigError, match=r"--judge-model .* does not fit --judge-device cuda:0: each of the 1 "
                                          r"explorers' judges \(vllm\) needs .* GiB and cuda:0's free memory is "
                                          r"64.0 GiB, of which the explorers there take"):
        _planned("train_async", "--model", models["1.5B"], *GPU_FLAGS, "--judge-model", models["7B"], "--gpus", "1",
                 "--gpu-memory-gb", "64")


def test_a_served_judge_under_torchrun_needs_a_gpu_no_rank_uses(models):
    """Several nodes (torchrun): every GPU has a rank, so the judge needs a device named, counted on each explorer's
    node."""
    with pytest.raises(ConfigError, match=r"every GPU of the node has a rank: start torchrun with --nproc-per-node 7"):
        _planned("train_async", "--model", models["1.5B"], *GPU_FLAGS, "--judge-model", models["1.5B"], "--gpus", "8",
                 "--nnodes", "2")
    args, r = _planned("train_async", "--model", models["1.5B"], *GPU_FLAGS, "--judge-model", "tiny",
                       "--gpus", "8", "--nnodes", "2", "--judge-device", "cuda:7")
    assert args.explorer_device_list == ["cuda"] * args.num_explorers  # the last ranks: node 1
    assert [w[0] for w in r["devices"]["cuda:7@node1"]].count("judge") == args.num_explorers
    assert not any(w[0] == "judge" for w in r["devices"]["cuda:7"])


def test_7b_plan_counts_the_weight_sync_and_refuses_in_one_line(models, tmp_path):
    """USAGE's 7B trainer (one replica, checkpointing, 16k-token packed micro-batches: 68 GB by the trainer's own
    accounting) on an 80 GiB GPU in train_async.py, whose in-flight broadcast snapshots the weights on that GPU (14 GiB
    more): one line naming it, before any model loads (the folder has no weights)."""
    flags = ["--model", models["7B"], *GPU_FLAGS, "--gpus", "2", "--gpu-memory-gb", "80", "--trainer-devices", "cuda:0",
             "--explorer-devices", "cuda:1", "--max-tokens-per-micro-batch", "16384", "--gradient-checkpointing"]
    proc = run_in_process("train_async.py", "--plan", *flags, "--out-dir", str(tmp_path / "run"))
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith("error: --max-tokens-per-micro-batch 16384: a trainer on cuda:0 needs"), lines[0]
    assert "in-flight snapshot" in lines[0], lines[0]
    # train_sync.py's trainer sends without a snapshot: the same trainer fits
    args, r = _planned("train_sync", *flags)
    (name, peak, what), = r["devices"]["cuda:0"]
    assert name == "trainer0" and what == "bucket" and 60 * GIB < peak < 80 * GIB
    # the explorer: vLLM's share plus its own process and receive bucket, over what is free, is its flag
    with pytest.raises(ConfigError, match="--vllm-gpu-memory-utilization 0.99: vLLM .* would take"):
        _planned("train_sync", *flags, "--vllm-gpu-memory-utilization", "0.99")


# ----------------------------------------------------------------------------- ranks on the CPU
@pytest.mark.timeout(300)
def test_torchrun_on_the_cpu_places_by_the_same_rule(tmp_path):
    """`torchrun --nproc-per-node 4 train_async.py` with no placement flag: the planner splits the 4 CPU ranks
    (2 trainers, 2 explorers at the default ratio) and the run trains."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                           os.path.join(ROOT, "train_async.py"), *TINY, "--steps", "1", "--out-dir", str(out)],
                          capture_output=True, text=True, timeout=280, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("[tandem] placement:"))
    assert "a CPU world of 4 ranks: 2 trainer(s) on cpu, 2 explorer(s) on cpu" in line, line
    assert_trained(out, steps=1)
    assert {n.split(".")[0] for n in os.listdir(out / "timeline")} >= {"trainer0", "trainer1", "explorer0",
                                                                        "explorer1"}


def places_world(ctx):
    """Each rank says where it runs through the run's store, as join_world has each do; the places are made up (two
    nodes, one GPU visible per rank) and what follows from them is decided by the real functions, on every rank."""
    from common.runtime.worker import gather_places
    from common.weight_sync.colocated import colocated

    scenarios = {  # rank -> Place; what every rank must conclude: (backend, colocated)
        "two nodes, cuda:0 on each": ([Place("node-a", "cuda:0", "GPU-a0"), Place("node-b", "cuda:0", "GPU-b0")],
                                      ("nccl", False)),
        "one GPU visible per rank": ([Place("node-a", "cuda:0", "GPU-1"), Place("node-a", "cuda:0", "GPU-2")],
                                     ("nccl", False)),
        "colocated on one GPU": ([Place("node-a", "cuda:0", "GPU-1"), Place("node-a", "cuda:0", "GPU-1")],
                                 ("cpu:gloo,cuda:nccl", True)),
        "both on one node's CPU": ([Place("node-a", "cpu", "cpu"), Place("node-a", "cpu", "cpu")], ("gloo", True)),
        "two nodes' CPUs": ([Place("node-a", "cpu", "cpu"), Place("node-b", "cpu", "cpu")], ("gloo", False)),
    }
    for name, (places, expected) in scenarios.items():
        ctx.places = gather_places(dist.PrefixStore(name, ctx.store), ctx.rank, ctx.names, places[ctx.rank], 30)
        assert ctx.places == places, (name, ctx.places)
        got = (choose_backend(ctx.places), colocated(ctx)[0])
        assert got == expected, f"{name}: {ctx.name} concluded {got}, expected {expected}"


def test_backend_and_colocation_follow_each_ranks_physical_place():
    """Finding 10 (two nodes x GPUs: cuda:0 twice is two GPUs, a pure NCCL world) and 11 (one GPU visible per rank:
    every rank cuda:0, yet no colocation and no CUDA IPC between them), in a real two-rank world over gloo: a rank
    that concludes otherwise fails the run."""
    run_function("test_placement:places_world", 1, 1, timeout_s=60)


def test_backend_strings():
    gpu = [Place("a", f"cuda:{i}", f"GPU-{i}") for i in range(3)]
    assert choose_backend([Place("a", "cpu", "cpu")] * 3) == "gloo"
    assert choose_backend(gpu) == "nccl"
    assert choose_backend([gpu[0], gpu[0]]) == "cpu:gloo,cuda:nccl"  # colocated on one GPU
    assert choose_backend([gpu[0], Place("a", "cpu", "cpu")]) == "cpu:gloo,cuda:nccl"
    # FSDP2 with --fsdp-cpu-offload: its shards' collectives run on CPU tensors, so gloo joins NCCL (as torchtitan)
    assert choose_backend(gpu, cpu_collectives=True) == "cpu:gloo,cuda:nccl"


# ----------------------------------------------------------------------------- start-up order
def _context(store, rank: int, places: list[Place]) -> WorkerContext:
    names = ["trainer0", "explorer0"]
    return WorkerContext(name=names[rank], role="trainer" if rank == 0 else "explorer", index=0, rank=rank,
                         world_size=2, device=None, backend="", trainer_ranks=[0], explorer_ranks=[1], names=names,
                         places=places, store=store)


def test_a_trainer_on_a_vllm_explorers_gpu_loads_after_the_engine_is_up():
    """Finding 12: common/run.py engines_first holds a trainer that shares its GPU with a vLLM explorer until that
    explorer's engine is up (announced by make_weight_sync); a trainer on a GPU of its own, or with the HF engine,
    does not wait."""
    from types import SimpleNamespace

    from common.run import engines_first
    from common.runtime.worker import ENGINE_READY

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    shared = [Place("a", "cuda:0", "GPU-1"), Place("a", "cuda:0", "GPU-1")]
    args = SimpleNamespace(engine="vllm", timeout_s=30)
    trainer = threading.Thread(target=engines_first, args=(_context(store, 0, shared), args))
    trainer.start()
    trainer.join(timeout=1.0)
    assert trainer.is_alive(), "the trainer went on before the explorer's engine was up"
    store.set(f"{ENGINE_READY}/1", "1")
    trainer.join(timeout=10)
    assert not trainer.is_alive()
    # nothing to wait for: another GPU, the HF engine
    other = [Place("a", "cuda:0", "GPU-1"), Place("a", "cuda:1", "GPU-2")]
    engines_first(_context(dist.HashStore(), 0, other), args)
    engines_first(_context(dist.HashStore(), 0, shared), SimpleNamespace(engine="hf", timeout_s=30))
    # and a store no explorer ever writes: one line naming whom it waits for, after --timeout-s
    with pytest.raises(TimeoutError, match="trainer0: no explorer0's vLLM engine on this GPU"):
        engines_first(_context(dist.HashStore(), 0, shared), SimpleNamespace(engine="vllm", timeout_s=0.2))
