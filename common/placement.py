"""Where every worker runs when the run names no device (no --explorer-devices, no --trainer-devices): `place(args)`
chooses them for the node, before anything starts, and says so in the run's "placement:" line. The same decision
serves `python train_X.py` (one rank per GPU of this machine), `torchrun --nproc-per-node N` (its ranks, on one node or
several) and a CPU world over gloo (`torchrun` on a machine without GPUs); `--plan` prints it, with the memory plan,
for this machine or for a node it is not (`--gpus 8 --gpu-memory-gb 80 --nnodes 2`), and exits. Device flags
that are given are used as given.

The rule (ranks: trainers first, then explorers, common/runtime/worker.py):
- One GPU: explorer and trainer share it (colocated).
- train_sync.py (rollout and training take turns): on one node, the explorer shares trainer 0's GPU and every GPU
  trains, when trainer 0 fits beside the explorer's memory (common/memory.py); else the explorer gets a GPU of its
  own. Under torchrun the world decides: one rank per GPU gives the explorer its own GPU.
- train_offpolicy.py, train_async.py (rollout and training at once): explorers on k GPUs of their own, trainers on
  the rest. k balances the two sides: k explorers make batches k times as fast as one, T trainers train T times as
  fast, so the steps match when k / T = r, the rollout:train time ratio of one step with one GPU each
  (--rollout-train-ratio: measured, see its help), i.e. k = round(G x r / (1 + r)) of G GPUs; at least 1, and at most
  what leaves the trainers enough GPUs to hold the model (its size: weights, gradients and AdamW state sharded over
  them, the weight sync, one sequence with activation checkpointing). One explorer for train_offpolicy.py;
  --explorer-gpus (or --num-explorers) sets k.
- Several trainers on GPUs shard the model (FSDP2, --trainer-shard fsdp) unless --trainer-shard is given or LoRA is on.
- A CPU world of W ranks splits the same way (no memory limit: every rank shares the machine's); `python train_X.py`
  on a machine without GPUs keeps one CPU trainer and the explorers on the CPU.
- A judge tandem serves (--judge-model without --judge-url) and no --judge-device: the node's last GPU, set aside
  before the rules above place the workers on the rest; one GPU: shared (common/memory.py counts it there); under
  torchrun the last GPU where the node has more GPUs than ranks, else one line naming --judge-device (`_judge_gpu`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass

from common.knobs import ConfigError
from common.memory import (CUDA_CONTEXT_BYTES, GIB, device_memory, dtype_bytes, explorer_bytes, gib, model_shape,
                            plan_memory, served_judge, sync_bytes, trainer_estimate)

DEVICE_FLAGS = {"explorer_devices", "trainer_devices"}
SEQUENCE_GUESS = 512  # prompt tokens assumed beside --max-new-tokens before the tasks are read (as build_engine does)


@dataclass
class Node:
    """What the placement is for: `gpus` per node (0: CPU only), each of `gpu_bytes`; `ranks` on this node and
    `world_size` in all when torchrun started them (0: `python train_X.py`, which starts one per GPU)."""
    gpus: int
    gpu_bytes: float = 0.0
    nnodes: int = 1
    ranks: int = 0
    world_size: int = 0


def this_node(args) -> Node:
    """--plan's --gpus / --gpu-memory-gb / --nnodes when given, else this machine and torchrun's world."""
    if args.gpus:
        return Node(args.gpus, (args.gpu_memory_gb or 80) * GIB, args.nnodes)
    import torch

    ranks = world = 0
    if "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    memory = args.gpu_memory_gb * GIB or (device_memory(["cuda:0"])["cuda:0"][1] if gpus else 0.0)
    return Node(gpus, memory, -(-world // ranks) if ranks else 1, ranks, world)


def place(args) -> None:
    """Choose --trainer-devices and --explorer-devices (and --num-explorers, --trainer-shard) when neither device flag
    was given (module docstring); `args.placement` says what and why. A placement that cannot work is a one-line
    ConfigError."""
    given = args.given_fields
    if given & DEVICE_FLAGS or args.resume:  # a resumed run keeps its saved placement
        if "explorer_gpus" in given and not args.resume:
            raise ConfigError("--explorer-gpus places the workers itself: give it or --explorer-devices / "
                              "--trainer-devices, not both")
        return
    node = args.node = this_node(args)
    if not node.gpus and not node.ranks:  # python train_X.py on a CPU machine: the device flags' defaults
        return
    schedule = getattr(args, "SCHEDULE", "sync")
    torchrun = bool(node.ranks) or node.nnodes > 1
    node, judge = _judge_gpu(args, node, torchrun)  # the node the workers share, without the judge's own GPU
    world = node.world_size or (node.ranks or node.gpus) * node.nnodes
    shape = model_shape(args.model) if node.gpus else None
    if schedule == "sync" and not torchrun and node.gpus > 1:
        colocate, why = _colocation(args, shape, node)
        explorers, trainers = 1, (world if colocate else world - 1)
    else:
        explorers, why = _explorer_count(args, schedule, world, torchrun, shape, node, given)
        trainers = max(1, world - explorers)
    shard = trainers > 1 and node.gpus > 0 and "trainer_shard" not in given and not args.lora_rank
    if shard:
        args.trainer_shard = "fsdp"
    kind = "cuda" if node.gpus else "cpu"
    if kind == "cuda" and not torchrun:  # one node, one rank per GPU: say which
        t = [f"cuda:{i}" for i in range(trainers)]
        e = [f"cuda:{(trainers + j) % node.gpus}" for j in range(explorers)]
    else:  # `cuda`: each rank's own GPU (its local rank)
        t, e = [kind] * trainers, [kind] * explorers
    args.trainer_devices, args.explorer_devices = ",".join(t), ",".join(e)
    if hasattr(args, "num_explorers"):
        args.num_explorers = explorers
    gpus = args.node.gpus
    where = (f"{node.nnodes} nodes x {gpus} GPUs" if node.nnodes > 1 else f"{gpus} GPU(s)") if gpus \
        else f"a CPU world of {world} ranks"
    args.placement = (f"{where}: {trainers} trainer(s) on {_span(t)}"
                      f"{' (FSDP2, --trainer-shard fsdp)' if shard else ''}, {explorers} explorer(s) on {_span(e)}: "
                      f"{why}{judge}")


def _judge_gpu(args, node: Node, torchrun: bool) -> tuple[Node, str]:
    """A judge tandem serves (--judge-model without --judge-url) and no --judge-device, on a GPU node: the node's
    last GPU, set aside from the workers; one GPU: shared with them (the memory plan counts it there, or refuses in
    one line); under torchrun the last GPU when the node has more GPUs than ranks, else a one-line refusal (the ranks
    are torchrun's to count). Sets --judge-device; returns the node the workers are placed on and what the
    placement line says of the judge."""
    if not (node.gpus and served_judge(args)) or "judge_device" in args.given_fields:
        return node, ""
    last = f"cuda:{node.gpus - 1}"
    if torchrun and (node.ranks or node.gpus) >= node.gpus:
        raise ConfigError(f"--judge-model {args.judge_model} is served by tandem on a GPU of its own, and every GPU of "
                          f"the node has a rank: start torchrun with --nproc-per-node {node.gpus - 1} (the judge then "
                          f"takes {last}), or pass --judge-device (cpu, or a GPU it shares, counted by the memory "
                          "plan), or --judge-url")
    args.judge_device = last
    if torchrun:
        return node, f"; the served judge on {last} of each node, which no rank uses"
    if node.gpus == 1:
        return node, (f"; the served judge shares {last} with them (one GPU; counted by the memory plan, "
                      "--judge-device cpu keeps it off the GPU)")
    return dataclasses.replace(node, gpus=node.gpus - 1), \
        f"; the served judge on {last}, a GPU of its own (--judge-device cpu or cuda:N places it yourself)"


def _span(devices: list[str]) -> str:
    if len(set(devices)) == 1 and len(devices) > 1:
        return f"{devices[0]} x{len(devices)} (each rank's own)" if devices[0] == "cuda" else f"{devices[0]}"
    return ",".join(devices)


def _engine(args) -> str:
    """The engine the memory estimate assumes: --engine, and for auto vLLM where it imports (or when planning a node
    that is not this one: the GPU install has it)."""
    if args.engine != "auto":
        return args.engine
    if args.gpus:
        return "vllm"
    from common.explorer.engine import vllm_available

    return "vllm" if vllm_available()[0] else "hf"


def _judge_engine(args) -> str:
    """The served judge's engine the plan counts: --judge-engine, auto by the explorers' rule on --judge-device (on
    a node this machine is not: vllm on a GPU, whose install has it; hf on the CPU, where the GPU build runs none)."""
    if args.judge_engine != "auto":
        return args.judge_engine
    if args.gpus:
        return "hf" if args.judge_device == "cpu" else "vllm"
    from common.explorer.engine import resolve_judge_engine

    return resolve_judge_engine(args)[0]


def _trainer_bytes(args, shape, trainers: int, method: str, source: bool) -> float:
    """One GPU trainer's peak with `trainers` of them (sharded when more than one, as placed), checkpointing on and
    one sequence a micro-batch: the least it can take."""
    probe = copy.copy(args)
    probe.trainer_devices = ",".join(["cuda"] * trainers)
    if trainers > 1 and "trainer_shard" not in args.given_fields and not args.lora_rank:
        probe.trainer_shard = "fsdp"
    probe.engine = _engine(args)
    tokens = args.max_new_tokens + SEQUENCE_GUESS
    return trainer_estimate(shape, probe, "cuda", tokens, args.max_new_tokens, True).peak + \
        sync_bytes(shape, probe, method, "trainer", source)[0]


def _explorer_bytes(args, shape, node: Node) -> float:
    probe = copy.copy(args)
    probe.engine = _engine(args)
    return explorer_bytes(shape, probe, "cuda", node.gpu_bytes, args.max_new_tokens + SEQUENCE_GUESS) + \
        CUDA_CONTEXT_BYTES


def _colocation(args, shape, node: Node) -> tuple[bool, str]:
    """train_sync.py on one node of several GPUs: the explorer beside trainer 0 when trainer 0 fits there."""
    if "explorer_gpus" in args.given_fields:
        colocate = args.explorer_gpus == 0
        return colocate, f"--explorer-gpus {args.explorer_gpus}"
    if shape is None:
        return True, "the synchronous schedule never generates and trains at once: every GPU trains"
    need = _trainer_bytes(args, shape, node.gpus, "colocated", True)
    beside = node.gpu_bytes - _explorer_bytes(args, shape, node)
    if need <= beside:
        return True, (f"the synchronous schedule never generates and trains at once, so every GPU trains and the "
                      f"explorer shares cuda:0 (trainer0 needs at least {gib(need)}, {gib(beside)} are left beside "
                      "the explorer)")
    return False, (f"trainer0 needs at least {gib(need)} and only {gib(beside)} are left beside the explorer on one "
                   "GPU, so the explorer gets a GPU of its own")


def _explorer_count(args, schedule: str, world: int, torchrun: bool, shape, node: Node, given) -> tuple[int, str]:
    """How many explorers, each on a GPU (or CPU rank) of its own, and why."""
    if world == 1:
        if torchrun:
            raise ConfigError("a world of 1 rank holds no explorer beside its trainer: torchrun --nproc-per-node 2 "
                              "or more (two ranks may share one GPU)")
        return 1, "one GPU: explorer and trainer share it (colocated)"
    explorer_gpus = args.explorer_gpus if "explorer_gpus" in given else None
    if explorer_gpus == 0:
        raise ConfigError(f"--explorer-gpus 0 (explorers on the trainers' GPUs) with {world} ranks, one per GPU: "
                          "name the devices instead (--explorer-devices cuda:0 --trainer-devices ...)")
    least = _least_trainers(args, shape, world, node) if shape is not None else 1
    if schedule != "async":
        return 1, "one explorer (this schedule runs one), the trainers on the rest"
    if explorer_gpus is None and "num_explorers" in given:
        explorer_gpus = args.num_explorers
    if explorer_gpus:
        if world - explorer_gpus < least:
            raise ConfigError(f"--explorer-gpus {explorer_gpus} leaves {world - explorer_gpus} of {world} GPUs to the "
                              f"trainers and --model {args.model} needs {least}")
        return explorer_gpus, f"--explorer-gpus {explorer_gpus}" if "explorer_gpus" in given else \
            f"--num-explorers {explorer_gpus}"
    r = args.rollout_train_ratio
    k = max(1, min(round(world * r / (1 + r)), world - least))
    room = f"; the trainers need at least {least} GPUs of {gib(node.gpu_bytes)} for --model {args.model}" \
        if least > 1 else ""
    return k, f"k = round({world} x {r:g} / (1 + {r:g})) balances rollout and training (--rollout-train-ratio {r:g})" \
              f"{room}"


def _least_trainers(args, shape, world: int, node: Node) -> int:
    """The fewest GPU trainers the model fits on, leaving at least one GPU to an explorer; a one-line error when
    none does, or when its weights do not fit one explorer GPU (an explorer is one GPU: no tensor parallelism)."""
    weights = shape.params * dtype_bytes(args.dtype)
    if _explorer_bytes(args, shape, node) < weights or weights > node.gpu_bytes:
        raise ConfigError(f"--model {args.model}: its weights in {args.dtype} ({gib(weights)}) do not fit one "
                          f"explorer GPU of {gib(node.gpu_bytes)} (an explorer runs on one GPU): "
                          + ("use --dtype bfloat16" if args.dtype != "bfloat16" else "raise "
                             "--vllm-gpu-memory-utilization or use a smaller model"))
    for trainers in range(1, world):
        if _trainer_bytes(args, shape, trainers, "broadcast", True) <= node.gpu_bytes:
            return trainers
    raise ConfigError(f"--model {args.model} does not fit {world - 1} trainer GPUs of {gib(node.gpu_bytes)} (FSDP2 "
                      f"over all of them, activation checkpointing, one sequence a micro-batch): use more GPUs, "
                      + ("--dtype bfloat16, " if args.dtype != "bfloat16" else "") + "or --lora-rank 16")


# ----------------------------------------------------------------------------- --plan
def plan_report(args) -> dict:
    """The placement and the memory plan of `args` (placed, or as its flags name it) for its node: {"node",
    "placement", "notes" (what the memory plan chose), "devices": {device: [(worker, bytes, what)]}}, from the model's
    config and the tasks' prompts (no weights load). Raises the run's one-line ConfigError when it does not fit."""
    from common.model import resolve_model
    from common.preflight import rollout_sequence
    from common.tasks import tasksets_of

    node = getattr(args, "node", None) or this_node(args)
    args.engine = _engine(args) if node.gpus else ("hf" if args.engine == "auto" else args.engine)
    if served_judge(args):
        args.judge_engine = _judge_engine(args)
    resolve_model(args.model)
    train, held_out = tasksets_of(args)
    sequence = rollout_sequence(args, (train.tasks or []) + held_out)
    memory = None  # this machine's, measured
    if args.gpus:  # a node this machine is not: every GPU free, host memory not checked
        memory = {f"cuda:{i}": (node.gpu_bytes, node.gpu_bytes) for i in range(node.gpus)}
    devices: dict = {}
    notes = plan_memory(args, sequence, args.given_fields, memory, devices,
                        node.gpus if args.gpus else None, node.ranks or (node.gpus if node.nnodes > 1 else 0))
    return {"node": node, "placement": getattr(args, "placement", "as the device flags name it"), "notes": notes,
            "devices": devices, "sequence": sequence}


def print_plan(args, script: str) -> None:
    """--plan: the placement, then one row per device: its workers, what the plan expects each to take at its peak,
    and of how much."""
    r = plan_report(args)
    node = r["node"]
    size = f"{node.nnodes} x {node.gpus} GPUs" if node.nnodes > 1 else f"{node.gpus} GPU(s)"
    print(f"[tandem] plan: {script} --model {args.model} ({args.dtype}, --engine {args.engine}, sequences of up to "
          f"{r['sequence']} tokens) on {size + f' of {gib(node.gpu_bytes)}' if node.gpus else 'the CPU'}")
    print(f"placement: {r['placement']}")
    for line in r["notes"]:
        print(line.replace("[tandem] ", ""))
    print("| device | workers | planned peak |")
    print("|---|---|---|")
    for device, workers in sorted(r["devices"].items(), key=lambda kv: _order(kv[0])):
        names = "; ".join(f"{w}" + (f" ({what})" if what else "") for w, _, what in workers)
        print(f"| {device} | {names} | {gib(sum(b for _, b, _ in workers))} |")


def _order(key: str) -> tuple:
    """Plan keys by node, GPUs in index order, then the node's host memory."""
    device, _, node = key.partition("@node")
    return int(node or 0), device == "cpu", int(device.split(":")[1]) if ":" in device else 0
