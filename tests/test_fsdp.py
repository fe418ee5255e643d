"""--trainer-shard fsdp: two FSDP2 trainers over gloo (real ranks under torch elastic) against one trainer; the
weight sync from shards; resume from a checkpoint written by sharded trainers."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from common.runtime.launcher import run_function
from common.trainer import checkpoints as ckpt
from conftest import TINY
from test_scale_trainer import uneven_experiences

pytestmark = pytest.mark.timeout(300)
FLAGS = {"grpo": ["--kl-coef", "0.1", "--ref-reset-every", "2"],
         "ppo": ["--algo", "ppo", "--kl-coef", "0.1", "--kl-mode", "reward", "--critic-lr", "1e-3"]}
STEPS, SYNC = 3, {1: "broadcast", 2: "checkpoint", 3: "broadcast"}


def _args(out_dir, *flags):
    from common.cli import parse_args
    from train_sync import Args

    offload = "--fsdp-cpu-offload" in flags  # refused for CPU trainers (they hold everything in host memory
    # already); set past the check so that FSDP2's offload paths run here (on the CPU no byte moves)
    args = parse_args(Args, [*TINY, "--minibatch-size", "8", "--micro-batch-size", "3", "--out-dir", str(out_dir),
                             "--ppo-epochs", "2", *(f for f in flags if f != "--fsdp-cpu-offload")])
    args.fsdp_cpu_offload = offload
    return args


def offloaded(model) -> bool:
    """Every FSDP unit of `model` keeps its shards, gradients and optimizer state in host memory."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return bool(units) and all(isinstance(fully_shard.state(m)._fsdp_param_group.offload_policy, CPUOffloadPolicy)
                               for m in units if fully_shard.state(m)._fsdp_param_group is not None)


def worker(ctx, out_dir, flags, resume):
    flags, resume = json.loads(flags), resume == "True"
    """Trainers: (resume,) train to step 3 on fixed experiences, syncing after every step and saving a checkpoint
    at step 2 and final/. The explorer (an HF engine) pulls every version and records the checksum it holds."""
    from common.explorer.engine import HFEngine
    from common.lora import LoraSpec
    from common.runtime.metrics import Timeline
    from common.model import build_tiny_tokenizer, load_model
    from common.trainer.parallel import DataParallel
    from common.trainer.trainer import Trainer
    from common.weight_sync import METHODS, weights_hash

    args = _args(out_dir, *flags)
    timeline = Timeline(out_dir, ctx.name)
    hashes = {}
    if ctx.role == "explorer":
        from common.trainer.trainer import DTYPES

        # other weights than the trainers' until the first sync; the run's dtype, as the explorer of a run
        engine = HFEngine(load_model("tiny", dtype=DTYPES[args.dtype], seed=7), build_tiny_tokenizer(),
                          lora=LoraSpec.from_args(args))  # LoRA: the adapters are what it takes
        methods = {name: METHODS[name](ctx, args, timeline, engine) for name in set(SYNC.values())}
        for step in range(STEPS + 1):
            receiver = methods[SYNC.get(step, "broadcast")]
            receiver.version = max(m.version for m in methods.values())  # the version the engine holds
            version = receiver.pull(step)
            hashes[version] = engine.weights_checksum()
    else:
        trainer = Trainer(args, ctx.device, DataParallel.from_context(ctx))
        assert offloaded(trainer.model) == args.fsdp_cpu_offload
        methods = {name: METHODS[name](ctx, args, timeline) for name in set(SYNC.values())} if ctx.explorer_ranks \
            else None
        if resume:
            ckpt.resume(trainer, out_dir)
        if methods:
            methods["broadcast"].push(trainer.named_weights(), trainer.version, 0)
        hashes[trainer.version] = weights_hash(trainer.named_weights())  # gathered: every trainer joins
        while trainer.step < STEPS:
            metrics = trainer.train_step(uneven_experiences(seed=trainer.step))
            # through the policy-gradient term: non-zero advantages, loss and gradient
            assert metrics["grad_norm"] > 0 and metrics["loss"] != 0 and metrics["advantage/abs_mean"] > 0
            hashes[trainer.version] = weights_hash(trainer.named_weights())
            if methods:
                methods[SYNC[trainer.step]].push(trainer.named_weights(), trainer.version, trainer.step)
            if trainer.step == 2:
                ckpt.save(trainer, out_dir)
        ckpt.save(trainer, out_dir)  # step_3: everything (final/ holds the model and tokenizer only)
        ckpt.save(trainer, out_dir, "final")
    with open(os.path.join(out_dir, f"hashes-{ctx.name}.json"), "w") as f:
        json.dump(hashes, f)


def run_workers(out_dir, flags, trainers=2, explorer=True, resume=False):
    os.makedirs(out_dir, exist_ok=True)
    run_function("test_fsdp:worker", trainers, int(explorer), str(out_dir), json.dumps(flags), str(resume))


def one_trainer(out_dir, flags):
    from common.trainer.trainer import Trainer

    trainer = Trainer(_args(out_dir, *flags), torch.device("cpu"))
    while trainer.step < STEPS:
        trainer.train_step(uneven_experiences(seed=trainer.step))
    ckpt.save(trainer, str(out_dir))
    ckpt.save(trainer, str(out_dir), "final")


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _sharded(algo):
    return [*FLAGS[algo], "--trainer-devices", "cpu,cpu", "--trainer-shard", "fsdp"]


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """One sharded run per algorithm (2 trainers + an explorer), shared by the tests below."""
    cache = {}

    def get(algo):
        if algo not in cache:
            cache[algo] = tmp_path_factory.mktemp(f"fsdp-{algo}")
            run_workers(cache[algo] / "fsdp", _sharded(algo))
        return cache[algo]
    return get


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_fsdp_trainers_equal_one_trainer_and_sync_exact_weights(fsdp_runs, algo):
    tmp_path = fsdp_runs(algo)
    one_trainer(tmp_path / "one", FLAGS[algo])

    sent = json.load(open(tmp_path / "fsdp" / "hashes-trainer0.json"))
    assert sent == json.load(open(tmp_path / "fsdp" / "hashes-trainer1.json"))
    got = json.load(open(tmp_path / "fsdp" / "hashes-explorer0.json"))
    assert sorted(got, key=int) == ["0", "1", "2", "3"] and got == sent  # broadcast and checkpoint sync alike

    init = load_file(tmp_path / "fsdp" / "checkpoints" / "step_2" / "model.safetensors")
    fsdp, one = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("fsdp", "one"))
    assert _max_diff(fsdp, init) > 1e-4  # it trained
    assert _max_diff(fsdp, one) < 1e-5, _max_diff(fsdp, one)  # final/ is a plain HF folder: same keys
    if algo == "ppo":
        critic = [load_file(tmp_path / d / "checkpoints" / "step_3" / "critic" / "model.safetensors") for d in ("fsdp", "one")]
        assert _max_diff(*critic) < 1e-5


def test_resume_from_sharded_checkpoint_continues_exactly(fsdp_runs, tmp_path):
    """ppo: policy, critic and both optimizers come back from the step-2 checkpoint of the sharded run."""
    full_dir = fsdp_runs("ppo") / "fsdp"
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(full_dir / "checkpoints" / "step_2", tmp_path / "resumed" / "checkpoints" / "step_2")
    run_workers(tmp_path / "resumed", _sharded("ppo"), explorer=False, resume=True)
    full = json.load(open(full_dir / "hashes-trainer0.json"))
    resumed = json.load(open(tmp_path / "resumed" / "hashes-trainer0.json"))
    assert resumed["2"] == full["2"]  # the same weights at the same step ...
    assert resumed["3"] == full["3"]  # ... and the same next step: optimizer state (AdamW moments) came back too
    for name in ("model.safetensors", "critic/model.safetensors"):
        a, b = (load_file(d / "checkpoints" / "step_3" / name) for d in (full_dir, tmp_path / "resumed"))
        assert _max_diff(a, b) == 0


LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2", "--dtype", "bfloat16"]
LORA_SHARDED = [*LORA, "--trainer-devices", "cpu,cpu", "--trainer-shard", "fsdp"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """LoRA + FSDP2 (2 trainers over gloo, bf16 base) and an explorer, and one trainer: shared by the tests below."""
    tmp_path = tmp_path_factory.mktemp("lora")
    run_workers(tmp_path / "fsdp", LORA_SHARDED)
    one_trainer(tmp_path / "one", LORA)
    return tmp_path


def _adapter(run_dir, step):
    return load_file(run_dir / "checkpoints" / f"step_{step}" / "adapter" / "adapter_model.safetensors")


def test_lora_fsdp_trains_fp32_adapters_and_sends_only_them(lora_run):
    """One unit per layer holds the bf16 base and the fp32 adapters; the trainers train the adapters as one trainer
    does, and the explorer gets exactly the adapters."""
    tmp_path = lora_run
    sent = json.load(open(tmp_path / "fsdp" / "hashes-trainer0.json"))
    got = json.load(open(tmp_path / "fsdp" / "hashes-explorer0.json"))
    assert sorted(got, key=int) == ["0", "1", "2", "3"] and got == sent  # the adapters, bit for bit

    fsdp, one = _adapter(tmp_path / "fsdp", 3), _adapter(tmp_path / "one", 3)
    assert {t.dtype for t in fsdp.values()} == {torch.float32} and any(".lora_B." in k for k in fsdp)
    assert _max_diff(fsdp, _adapter(tmp_path / "fsdp", 2)) > 1e-4  # it trained
    assert _max_diff(fsdp, one) < 1e-3, _max_diff(fsdp, one)  # as one trainer (bf16 forward: not bit-equal)
    final = load_file(tmp_path / "fsdp" / "final" / "model.safetensors")  # a plain HF folder of merged weights
    assert final.keys() == load_file(tmp_path / "one" / "final" / "model.safetensors").keys()


def test_lora_fsdp_resume_with_cpu_offload_continues_exactly(lora_run, tmp_path):
    """The LoRA run's step-2 checkpoint resumed by 2 FSDP2 trainers with --fsdp-cpu-offload (frozen bf16 base, fp32
    adapters and their AdamW moments sharded in host memory): the saved adapters and their optimizer state come
    back, so the resumed run trains step 3 through the policy-gradient term (asserted in `worker`) to exactly the
    uninterrupted run's adapters, and gathers and saves them from the offloaded shards."""
    full_dir = lora_run / "fsdp"
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(full_dir / "checkpoints" / "step_2", tmp_path / "resumed" / "checkpoints" / "step_2")
    run_workers(tmp_path / "resumed", [*LORA_SHARDED, "--fsdp-cpu-offload"], explorer=False, resume=True)
    full = json.load(open(full_dir / "hashes-trainer0.json"))
    resumed = json.load(open(tmp_path / "resumed" / "hashes-trainer0.json"))
    assert sorted(resumed, key=int) == ["2", "3"] and full["3"] != full["2"]
    assert resumed["2"] == full["2"]  # the saved adapters, not fresh ones ...
    assert resumed["3"] == full["3"]  # ... and the same next step: their AdamW moments came back too
    assert _max_diff(_adapter(full_dir, 3), _adapter(tmp_path / "resumed", 3)) == 0
