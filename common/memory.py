"""Memory that fits, decided before any model loads: the peak memory of every trainer and explorer, estimated from
the model's config (no weights) and the flags, against the memory of the device each one uses (a GPU: its free
memory; the CPU: the machine's available memory, shared by every worker placed on it).

`plan_memory(args)` (called by common/run.py before any worker starts) either fits the run as configured, or
chooses what the user left open (--gradient-checkpointing, --micro-batch-size) so that it fits, saying so in one
line, or stops with one line naming the flag to change and the numbers.

The accounting of one trainer (bytes; b = bytes of --dtype, S = trainers when --trainer-shard fsdp, else 1):
- states: parameters P x b / S, gradients and AdamW's two moments 3 x P x b / S (in the parameters' dtype; with
  LoRA none for the frozen base, and 4 x 4 B per adapter parameter: fp32 adapters, gradients, moments), a
  reference model P x b / S when --kl-coef > 0, the critic's model, gradients and moments (ppo), the
  teacher's weights P_teacher x b / S (--algo distill);
- activations of one micro-batch, linear in its tokens (packed micro-batches: attention runs per sequence,
  `common.trainer.forward.packed_attention`, so nothing is N x N): what autograd keeps of every decoder layer per
  token (`layer_bytes_per_token`), or with --gradient-checkpointing one hidden state per layer plus one layer's
  working set recomputed in the backward; LoRA adds the fp32 copies of the adapted layers' inputs
  (`lora_activation_bytes`);
- the log-probs: one chunk of common.trainer.forward.LOGPROB_CHUNK_TOKENS positions' fp32 logits over the
  vocabulary, with their softmax, entropy and gradients (`head_bytes`);
- the process itself: CUDA context, or on the CPU the interpreter with torch and transformers loaded.
With --fsdp-cpu-offload (GPU trainers) the states are counted in the node's host memory instead; the GPU holds the
activations and the gathered units, and, while it loads, the largest model whole (each trainer loads it on its
device before sharding it), so offloading a frozen LoRA base frees the room its shards took, never more than that.
An explorer: its weights (in --dtype) plus, with vLLM on a GPU, --vllm-gpu-memory-utilization x the GPU's memory in
all; with vLLM on the CPU --vllm-kv-cache-gb; with HF generate the KV cache of every sample of a rollout batch.
The weight sync, on top (`sync_bytes`; the method --sync-method auto will pick): trainer 0's broadcast bucket
(`pack`: at least the largest tensor, the embedding), its in-flight snapshot (train_async.py: a full copy on its
device, or in host memory when sharded), the colocated slot (a full copy on trainer 0's device), LoRA's merged
matrices (built at every push, --lora-sync merged only; adapter sync sends the fp32 adapters alone), a sharded
trainer's gathered bucket; an explorer's receive bucket, and a vLLM explorer's own process's CUDA context next to
vLLM's share. A CPU trainer's colocated slot in /dev/shm is checked against its free space (`check_shared_memory`).
A judge tandem serves (`judge_bytes`): one per explorer, on --judge-device of that explorer's node.
bench/memory.py --estimate-check compares these figures with measured CPU peaks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import torch

from common.buckets import shared_memory_dir
from common.explorer.engine import StaticCacheSize, use_static_cache
from common.knobs import ConfigError
from common.model import build_tiny_model, build_tiny_tokenizer, resolve_model
from common.runtime.worker import plan_world
from common.trainer.forward import LOGPROB_CHUNK_TOKENS
from common.trainer.losses import ALGOS
from common.vlm import BUILT_IN

GIB = 2**30
CPU_PROCESS_BYTES = int(0.5 * GIB)   # a worker's interpreter with torch + transformers imported (measured ~0.45 GiB)
CUDA_CONTEXT_BYTES = int(0.6 * GIB)  # CUDA context + cuBLAS workspace of a process on a GPU
SLACK = 1.10                         # on activations: allocator fragmentation and what the accounting leaves out
# A CPU's activations: glibc keeps the blocks of freed tensors in its heap, so a step's resident peak runs 18-30 %
# over its live one (docs/BENCHMARKS.md, bench/memory.py --estimate-check).
CPU_SLACK = 1.35


@dataclass
class ModelShape:
    """What the estimate needs of a causal LM, read from its config (the parameter count from a model built on
    the meta device: no memory, no weights)."""
    params: int          # every parameter (tied embeddings once)
    embed_params: int    # input embedding (+ an untied LM head)
    hidden: int
    layers: int
    vocab: int
    intermediate: int
    q_dim: int           # attention heads x head size
    kv_dim: int          # key/value heads x head size

    @property
    def body_params(self) -> int:
        """Non-embedding parameters (the N of 6·N·tokens)."""
        return self.params - self.embed_params

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        from transformers import AutoModelForCausalLM

        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in model.parameters())
        embed = model.get_input_embeddings().weight.numel()
        head = model.get_output_embeddings()
        if head is not None and head.weight is not model.get_input_embeddings().weight:
            embed += head.weight.numel()
        hidden = text.hidden_size
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        inter = getattr(text, "intermediate_size", None) or 4 * hidden
        return cls(params, embed, hidden, text.num_hidden_layers, text.vocab_size, inter, heads * head_dim,
                   kv_heads * head_dim)


def model_config(name: str):
    """The transformers config of --model (no weights), or None for the built-in vision models (small)."""
    if name == "tiny":
        with torch.device("meta"):
            return build_tiny_model(build_tiny_tokenizer()).config
    if name in BUILT_IN:
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(resolve_model(name))
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model {name}: cannot read its config ({str(e).splitlines()[0]})") from None


def model_shape(name: str) -> ModelShape | None:
    """The ModelShape of `name` (--model, --critic-model, --teacher), None for the built-in vision models."""
    config = model_config(name)
    return ModelShape.from_config(config) if config is not None else None


# ----------------------------------------------------------------------------- the trainer
def dtype_bytes(dtype: str) -> int:
    """Bytes per weight of --dtype (bfloat16 or float32)."""
    return 2 if dtype == "bfloat16" else 4


def layer_bytes_per_token(shape: ModelShape, b: int) -> float:
    """What autograd keeps of one decoder layer per token (Llama-style: RMSNorm, attention with rotary embeddings,
    gated MLP; a multiplication by a constant such as the rotary cos/sin keeps only the constant): each norm's
    fp32 input, normalised value and output; the rotated q and k and v (sdpa's inputs), sdpa's output and
    o_proj's input; the MLP's gate, up, activation and product."""
    h, q, kv, i = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    return 2 * (4 * h + 2 * b * h) + b * (3 * q + 2 * kv) + 4 * b * i


def head_bytes(shape: ModelShape, chunk_tokens: int) -> float:
    """The log-prob chunk in the backward (the first thing it runs, while every layer's activations are alive):
    the recomputed logits in the head's dtype, their fp32 copy, the probabilities (an entropy bonus) and the
    gradient in the head's dtype (common.trainer.forward._HeadLogprobs: at most 4 [chunk, vocab] fp32 tensors'
    bytes)."""
    return 4 * 4 * chunk_tokens * shape.vocab


def activation_bytes(shape: ModelShape, b: int, tokens: int, trained_tokens: int, checkpointing: bool) -> float:
    """Peak bytes above the states while one micro-batch of `tokens` tokens (`trained_tokens` of them trained)
    runs forward and backward."""
    layer = layer_bytes_per_token(shape, b) * tokens
    saved = (shape.layers * shape.hidden * b * tokens + layer) if checkpointing else shape.layers * layer
    # the final hidden states, their trained rows, the gradient flowing back through one layer
    edges = 4 * shape.hidden * b * tokens + 2 * shape.hidden * max(b, 4) * trained_tokens
    return saved + edges + head_bytes(shape, min(max(trained_tokens, 1), LOGPROB_CHUNK_TOKENS))


def forward_bytes(shape: ModelShape, b: int, tokens: int) -> float:
    """Peak bytes above the weights while one micro-batch of `tokens` tokens runs forward without autograd (a
    frozen model's log-probs): one layer's temporaries, the hidden states, one chunk of the LM head."""
    return layer_bytes_per_token(shape, b) * tokens + 4 * shape.hidden * b * tokens + \
        head_bytes(shape, min(tokens, LOGPROB_CHUNK_TOKENS))


@dataclass
class TrainerEstimate:
    states: float        # weights, gradients, optimizer state, reference, critic, teacher (per trainer)
    activations: float   # one micro-batch (AdamW's fused step needs no temporaries: never the peak)
    process: float
    slack: float = SLACK  # on the activations: SLACK on a GPU, CPU_SLACK on a CPU
    host: float = 0.0    # --fsdp-cpu-offload: the states, in host memory instead of `states`
    load: float = 0.0    # --fsdp-cpu-offload: the largest model whole on the device while it loads

    @property
    def peak(self) -> float:
        return max(self.states + self.slack * self.activations, self.load) + self.process


def trainer_estimate(shape: ModelShape, args, device_type: str, tokens: int, trained_tokens: int,
                     checkpointing: bool, critic: ModelShape | None = None,
                     teacher: ModelShape | None = None) -> TrainerEstimate:
    """One trainer's memory with micro-batches of `tokens` tokens (module docstring)."""
    b = dtype_bytes(args.dtype)
    shards = len(args.trainer_device_list) if args.trainer_shard == "fsdp" else 1
    states = (lora_state_bytes(shape, args, b) if args.lora_rank else 4 * shape.params * b) / shards
    if args.kl_coef > 0:
        states += shape.params * b / shards
    acts = activation_bytes(shape, b, tokens, trained_tokens, checkpointing)
    if args.lora_rank:
        acts += lora_activation_bytes(shape, args, tokens, checkpointing)
    if teacher is not None:  # frozen: its weights only; its forward runs without autograd, before the update
        states += teacher.params * b / shards
    if critic is not None:
        states += 4 * critic.params * b / shards
        acts = max(acts, activation_bytes(critic, b, tokens, 0, checkpointing))
    if args.trainer_shard == "fsdp":  # two gathered layers (the current one and the prefetched next)
        acts += 2 * b * shape.body_params / shape.layers
    if device_type == "cuda" and args.fsdp_cpu_offload:
        return TrainerEstimate(0.0, acts, CUDA_CONTEXT_BYTES, host=states, load=whole_model_bytes(b, shape, critic,
                                                                                                   teacher))
    if device_type == "cuda":
        return TrainerEstimate(states, acts, CUDA_CONTEXT_BYTES)
    return TrainerEstimate(states, acts, CPU_PROCESS_BYTES, CPU_SLACK)


def whole_model_bytes(b: int, *shapes: ModelShape | None) -> float:
    """The largest of a trainer's models (policy, critic, teacher) whole: what it holds on its device while it
    loads one, before FSDP2 shards it."""
    return max(m.params for m in shapes if m is not None) * b


# ----------------------------------------------------------------------------- LoRA (common/lora.py)
def _lora_dims(shape: ModelShape, args) -> list[tuple[int, int]]:
    """(in, out) of every adapted projection of one layer."""
    dims = {"q_proj": (shape.hidden, shape.q_dim), "k_proj": (shape.hidden, shape.kv_dim),
            "v_proj": (shape.hidden, shape.kv_dim), "o_proj": (shape.q_dim, shape.hidden),
            "gate_proj": (shape.hidden, shape.intermediate), "up_proj": (shape.hidden, shape.intermediate),
            "down_proj": (shape.intermediate, shape.hidden)}
    names = [m.strip() for m in args.lora_target_modules.split(",") if m.strip()]
    return [dims.get(m, (shape.hidden, shape.hidden)) for m in names]


def lora_params(shape: ModelShape, args) -> int:
    """LoRA adapters' parameters: rank x (in + out) per adapted projection per layer."""
    return shape.layers * sum(args.lora_rank * (i + o) for i, o in _lora_dims(shape, args))


def lora_state_bytes(shape: ModelShape, args, b: int) -> float:
    """A LoRA trainer's states: the frozen base in --dtype (no gradient, no optimizer state), the adapters, their
    gradients and AdamW's two moments in fp32."""
    return shape.params * b + 4 * 4 * lora_params(shape, args)


def lora_activation_bytes(shape: ModelShape, args, tokens: int, checkpointing: bool) -> float:
    """What the adapters add to the activations: per adapted projection and token, the fp32 copy of its input the
    adapter multiplies (peft casts the bf16 input to the adapters' fp32 and autograd keeps it) and the rank-r
    intermediate; every layer's, or one layer's recomputed with --gradient-checkpointing."""
    per_layer = 4 * sum(i + args.lora_rank for i, _ in _lora_dims(shape, args)) * tokens
    return per_layer * (1 if checkpointing else shape.layers)


def lora_explorer_bytes(shape: ModelShape, args, device_type: str) -> float:
    """An explorer's adapters: the HF engine's fp32 A and B; vLLM on the CPU keeps --max-staleness + 1 versions in
    the model's dtype (on a GPU they are inside its --vllm-gpu-memory-utilization share)."""
    if args.engine == "vllm":
        return 0.0 if device_type == "cuda" else (args.max_staleness + 1) * lora_params(shape, args) * \
            dtype_bytes(args.dtype)
    return 4 * lora_params(shape, args)


def explorer_bytes(shape: ModelShape, args, device_type: str, total: float, sequence_tokens: int) -> float:
    """One explorer's memory: weights plus the engine's KV cache (vLLM: its whole share of a GPU)."""
    b = dtype_bytes(args.dtype)
    weights = shape.params * b + (lora_explorer_bytes(shape, args, device_type) if args.lora_rank else 0)
    if args.engine == "vllm" and device_type == "cuda":
        return args.vllm_gpu_memory_utilization * total
    if args.engine == "vllm":
        return weights + args.vllm_kv_cache_gb * GIB + 1.5 * GIB  # + vLLM's own process
    # one cache of fixed rows x positions for the run (a VLM's, dynamic on CUDA, is no larger: counted the same)
    if use_static_cache(args.hf_cache, device_type, vlm=False):
        size = StaticCacheSize.plan(args.rollout_batch_size, args.hf_cache_tokens or sequence_tokens)
        kv = 2 * shape.layers * shape.kv_dim * b * size.tokens * size.slots
        # the decode step's fp32 rows x vocabulary tensors (scores, log-probs, probabilities, the draw; with top-p
        # its sort, indices and cumulative sums), held in the CUDA graphs' memory pool
        logits = 8 * 4 * shape.vocab * size.slots
    else:
        kv = 2 * shape.layers * shape.kv_dim * b * sequence_tokens * args.rollout_batch_size
        if device_type == "cpu":  # HF's cache grows by concatenation; glibc keeps the freed copies in its heap
            kv *= 2  # (measured: 2.92 GiB resident against a 1.91 GiB live peak, docs/BENCHMARKS.md)
        logits = 3 * 4 * shape.vocab * args.rollout_batch_size  # one decoding step's fp32 logits and their softmax
    process = CUDA_CONTEXT_BYTES if device_type == "cuda" else CPU_PROCESS_BYTES
    return SLACK * (weights + kv + logits) + process


# ----------------------------------------------------------------------------- the weight sync
def sync_method(args, trainers: list[str], explorers: list[str]) -> str:
    """The method the run will use: --sync-method, or for auto what common/weight_sync picks (colocated when every
    explorer is on trainer 0's device, else broadcast)."""
    if args.sync_method != "auto":
        return args.sync_method
    return "colocated" if all(d == trainers[0] for d in explorers) else "broadcast"


def adapted_params(shape: ModelShape, args) -> int:
    """Parameters of the matrices LoRA adapts (--lora-target-modules): what `merged_named_weights` builds anew."""
    return shape.layers * sum(i * o for i, o in _lora_dims(shape, args))


def sync_bytes(shape: ModelShape, args, method: str, role: str, source: bool = False) -> tuple[float, float, str]:
    """What the weight sync adds to one worker: (bytes on its device, bytes of host memory, what they are). `source`:
    trainer 0, which sends."""
    b = dtype_bytes(args.dtype)
    model = shape.params * b
    bucket = max(args.sync_bucket_mb << 20, shape.vocab * shape.hidden * b)  # pack(): at least one whole tensor
    if args.lora_rank and args.lora_sync != "merged":  # only the fp32 adapters travel (common/lora.py)
        model = bucket = 4 * lora_params(shape, args)
    device, host, what = 0.0, 0.0, []
    sharded = args.trainer_shard == "fsdp"
    if role == "explorer":
        if method == "broadcast":  # (vLLM: its worker receives into the bucket, beside vLLM's share)
            device, what = bucket, ["receive bucket"]
        return device, host, " + ".join(what)
    if sharded and method != "checkpoint":  # every trainer gathers whole tensors of the bucket it sends / joins
        device, what = bucket, ["gathered bucket"]
    if not source:
        return device, host, " + ".join(what)
    if method == "broadcast":
        device, what = device + bucket, what + ["bucket"]
        if getattr(args, "SCHEDULE", "") == "async":  # push(wait=False): a snapshot the broadcast thread sends
            if sharded:
                host, what = model, what + ["in-flight snapshot (host)"]
            else:
                device, what = device + model, what + ["in-flight snapshot"]
    if method == "colocated":
        device, what = device + model, what + ["colocated slot"]
    if args.lora_rank and args.lora_sync == "merged":
        device, what = device + adapted_params(shape, args) * b, what + ["LoRA merged matrices"]
    return device, host, " + ".join(what)


# ----------------------------------------------------------------------------- the devices
def device_memory(devices: list[str]) -> dict[str, tuple[float, float]]:
    """(free, total) bytes of every device: a GPU's free memory (queried in a short child process, so this one
    holds no CUDA context), the machine's available memory for "cpu"."""
    out = {}
    if "cpu" in devices:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
        out["cpu"] = (float(info.get("MemAvailable", info["MemFree"])), float(info["MemTotal"]))
    gpus = sorted({d for d in devices if d.startswith("cuda")})
    if gpus:
        code = ("import sys, torch\nfor d in sys.argv[1:]: print(*torch.cuda.mem_get_info(torch.device(d)))")
        try:
            done = subprocess.run([sys.executable, "-c", code, *gpus], capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            raise ConfigError(f"querying the free memory of {', '.join(gpus)} took over 120 s") from None
        if done.returncode != 0:
            raise ConfigError(f"cannot query the free memory of {', '.join(gpus)}: "
                              f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
        for d, line in zip(gpus, done.stdout.split("\n")):
            free, total = map(float, line.split())
            out[d] = (free, total)
    return out


def worker_devices(args, gpus: int | None = None, local_world: int = 0) -> tuple[list[str], list[str]]:
    """The device of every trainer and explorer as the plan keys them: bare `cuda` resolved as the launcher does (the
    rank's own GPU: its local rank modulo the node's `gpus`, default this machine's), and on nodes after the first
    the node appended (`cuda:3@node1`, a GPU of its own): ranks fill nodes in order, `local_world` each (default:
    this machine's torchrun LOCAL_WORLD_SIZE where `gpus` is this machine's, else one node)."""
    plan = plan_world(args.trainer_device_list, args.explorer_device_list)
    here = gpus is None  # this machine (its torchrun world), not a node planned by --plan
    gpus = torch.cuda.device_count() if here else gpus
    local_world = local_world or (int(os.environ.get("LOCAL_WORLD_SIZE", 0)) if here else 0) or len(plan)
    devices = []
    for rank, w in enumerate(plan):
        node, local = divmod(rank, local_world)
        device = f"cuda:{local % max(1, gpus)}" if w.device == "cuda" else w.device
        devices.append(device if node == 0 else f"{device}@node{node}")
    return devices[:len(args.trainer_device_list)], devices[len(args.trainer_device_list):]


JUDGE_PROMPT_TOKENS = 512  # a judge request's own text: instructions, rubric, reference (rewards/judge.py SYSTEM)
JUDGE_REPLIES = 11  # the served judge's candidate replies 0..10 (rewards/judge_server.py constrained_scores)


def judge_tokens(args, sequence: int) -> int:
    """The longest judge request: its own text, the task's prompt and a group's --samples-per-task responses."""
    return JUDGE_PROMPT_TOKENS + sequence + (args.samples_per_task - 1) * args.max_new_tokens


def judge_bytes(args, device_type: str, sequence: int) -> float:
    """A judge model tandem serves (--judge-model without --judge-url, rewards/judge_server.py) in float32. HF: its
    weights, one forward of the JUDGE_REPLIES candidate replies over the longest judge request, its process. vLLM:
    its weights, its KV cache (common/explorer/judge_vllm.py `kv_cache_bytes`) and one forward of
    --judge-max-model-len tokens (its longest request and its chunk of batched tokens), vLLM's own process (a CUDA
    context on a GPU), the server's on the CPU. Sets --judge-max-model-len when it is 0: twice the longest request,
    within the judge's context. (--judge-engine is resolved by then, common/run.py; anything but vllm counts as hf.)"""
    config = model_config(args.judge_model)
    if config is None:
        return 0.0
    judge = ModelShape.from_config(config)
    cuda = device_type == "cuda"
    if args.judge_engine == "vllm":
        if not args.judge_max_model_len:  # as --vllm-max-model-len: prompts past the first measured may be longer
            want = 2 * judge_tokens(args, sequence)
            args.judge_max_model_len = min(want, getattr(config, "max_position_embeddings", None) or want)
        tokens = args.judge_max_model_len
        own = CUDA_CONTEXT_BYTES if cuda else 1.5 * GIB + CPU_PROCESS_BYTES  # (as explorer_bytes' vLLM)
        from common.explorer.judge_vllm import kv_cache_bytes

        return judge.params * 4 + kv_cache_bytes(config, tokens) + SLACK * forward_bytes(judge, 4, tokens) + own
    tokens = JUDGE_REPLIES * judge_tokens(args, sequence)
    return judge.params * 4 + SLACK * forward_bytes(judge, 4, tokens) + (CUDA_CONTEXT_BYTES if cuda else
                                                                           CPU_PROCESS_BYTES)


def served_judge(args) -> bool:
    """The run serves its own judge model (--judge-model without --judge-url): one per explorer, on --judge-device.
    (The same --judge-model is the k12/vision yes/no judge inside the verifier workers, on the CPU.)"""
    return bool(args.judge_model and not args.judge_url)


def local_device(key: str) -> str:
    """A plan key's device on its own node (`cuda:3@node1` -> `cuda:3`)."""
    return key.split("@")[0]


def host_of(key: str) -> str:
    """The host memory of a plan key's node (`cpu`, `cpu@node1`)."""
    return "cpu" + key[len(local_device(key)):]


# ----------------------------------------------------------------------------- the decision
def gib(x: float) -> str:
    return f"{x / GIB:.1f} GiB"


def plan_memory(args, sequence: int, given: frozenset = frozenset(), memory: dict | None = None,
                report: dict | None = None, gpus: int | None = None, local_world: int = 0) -> list[str]:
    """Fit the run into its devices before any model loads: returns the lines saying what was chosen (fields of
    `args` set: --gradient-checkpointing, --micro-batch-size or --max-tokens-per-micro-batch), or raises a one-line
    ConfigError naming the flag. `sequence`: tokens of the longest sequence a rollout makes (prompt + response,
    or a whole episode); `given`: fields the user set (never changed here); `memory`: (free, total) bytes per
    device (default: measured now; a node after the first has its first node's devices; host memory ("cpu") that is
    not listed is not checked); `report`: filled with each device's workers and planned bytes; `gpus`,
    `local_world`: the node's GPUs and ranks (worker_devices)."""
    shape = model_shape(args.model)
    if shape is None:
        return []
    # a built-in vision critic or teacher is counted as the policy
    critic = ((args.critic_model and model_shape(args.critic_model)) or shape) if ALGOS[args.algo].critic else None
    teacher = (model_shape(args.teacher) or shape) if args.teacher else None
    trainers, explorers = worker_devices(args, gpus, local_world)
    own = [args.teacher_device] if args.teacher and args.teacher_device else []
    # a served judge per explorer, on --judge-device of that explorer's node
    judges = [args.judge_device + e[len(local_device(e)):] for e in explorers] if served_judge(args) else []
    method = sync_method(args, trainers, explorers)
    host = {host_of(k): 0.0 for k in trainers + explorers}  # host-side snapshots
    if memory is None:
        memory = device_memory(sorted({local_device(k) for k in trainers + explorers + own + judges} | {"cpu"}))
    memory = {**{k: memory[local_device(k)] for k in trainers + explorers + own + judges + list(host)
                 if local_device(k) in memory}, **memory}
    report = report if report is not None else {}
    if args.engine == "hf" and not args.hf_cache_tokens:  # the static KV cache's positions, decided here
        args.hf_cache_tokens = StaticCacheSize.plan(1, sequence).tokens
    # what the explorers take of each device
    taken: dict[str, float] = {}
    for i, d in enumerate(explorers):
        kind = "cpu" if local_device(d) == "cpu" else "cuda"
        need = explorer_bytes(shape, args, kind, memory[d][1], sequence)
        extra, shm, what = sync_bytes(shape, args, method, "explorer")
        if kind == "cuda" and args.engine == "vllm":  # the explorer's own process, beside vLLM's share
            extra, what = extra + CUDA_CONTEXT_BYTES, " + ".join(filter(None, ["explorer process", what]))
        taken[d] = taken.get(d, 0.0) + need + extra
        host[host_of(d)] += shm
        report.setdefault(d, []).append((f"explorer{i}", need + extra, what))
    for key, need in taken.items():
        if need > memory[key][0]:
            raise ConfigError(_explorer_error(args, shape, key, need, memory[key][0]))
    host_explorers = dict(host)
    for key, need in host.items():  # host memory (CPU workers there have that much less)
        taken[key] = taken.get(key, 0.0) + need
    if own:  # --teacher-device: the teacher's weights and one forward there, not on the trainer's
        key, b = own[0], dtype_bytes(args.dtype)
        tokens = args.max_tokens_per_micro_batch or args.micro_batch_size * sequence
        need = teacher.params * b + SLACK * forward_bytes(teacher, b, tokens) + \
            (CUDA_CONTEXT_BYTES if key != "cpu" else 0)
        if need + taken.get(key, 0.0) > memory[key][0]:
            raise ConfigError(f"--teacher {args.teacher} does not fit --teacher-device {key}: its weights and one "
                              f"forward need {gib(need)} and {_where(key, memory[key][0], taken.get(key, 0.0))}")
        taken[key] = taken.get(key, 0.0) + need
        report.setdefault(key, []).append(("teacher", need, ""))
        teacher = None  # not on the trainers' devices
    for key in judges:  # a served judge: its weights and one forward on --judge-device, per explorer
        need = judge_bytes(args, "cpu" if local_device(key) == "cpu" else "cuda", sequence)
        if key in memory and need + taken.get(key, 0.0) > memory[key][0]:  # (host memory not listed: unchecked)
            raise ConfigError(f"--judge-model {args.judge_model} does not fit --judge-device {key}: each of the "
                              f"{len(judges)} explorers' judges ({args.judge_engine}) needs {gib(need)} and "
                              f"{_where(key, memory[key][0], taken.get(key, 0.0))}: pass --judge-device with "
                              f"another device, or --judge-url")
        taken[key] = taken.get(key, 0.0) + need
        report.setdefault(key, []).append(("judge", need, args.judge_engine))
    # each trainer device's budget: what is free minus the explorers there (CPU: shared by the CPU trainers there)
    notes: list[str] = []
    offloaded: dict[str, float] = {}  # --fsdp-cpu-offload: the GPU trainers' states, per node's host memory
    for key in sorted(set(trainers), key=trainers.index):
        free, _ = memory[key]
        first = trainers.index(key)
        sync, shm, what = sync_bytes(shape, args, method, "trainer", source=first == 0)
        host[host_of(key)] += shm
        share = trainers.count(key) if local_device(key) == "cpu" else 1
        budget = (free - taken.get(key, 0.0)) / share
        notes += _fit_trainer(shape, critic, args, key, budget, free, taken.get(key, 0.0), sequence, given, teacher,
                              sync, what)
        tokens = args.max_tokens_per_micro_batch or args.micro_batch_size * sequence
        trained = tokens if args.max_tokens_per_micro_batch else args.micro_batch_size * args.max_new_tokens
        estimate = trainer_estimate(shape, args, "cpu" if local_device(key) == "cpu" else "cuda", tokens, trained,
                                    args.gradient_checkpointing, critic, teacher)
        peak = estimate.peak + sync
        report.setdefault(key, []).append((f"trainer{first}" + (f" (x{share})" if share > 1 else ""), peak * share,
                                           what))
        offloaded[host_of(key)] = offloaded.get(host_of(key), 0.0) + estimate.host
    for key, need in host.items():
        if not need:
            continue
        report.setdefault(key, []).append(("weight sync", need, "host copies"))
        if key in memory and key not in trainers and taken.get(key, 0.0) - host_explorers.get(key, 0.0) + need > \
                memory[key][0]:
            raise ConfigError(f"the weight sync's host memory on {key} ({gib(need)}: a sharded trainer's in-flight "
                              f"snapshot) does not fit: "
                              f"{_where(key, memory[key][0], taken.get(key, 0.0) - host_explorers.get(key, 0.0))}")
    for key, need in offloaded.items():
        if not need:
            continue
        report.setdefault(key, []).append(("trainer states", need, "--fsdp-cpu-offload"))
        used = taken.get(key, 0.0) - host_explorers.get(key, 0.0) + host.get(key, 0.0)
        if key in memory and used + need > memory[key][0]:
            raise ConfigError(f"--fsdp-cpu-offload: the trainers' shards, gradients and AdamW state need {gib(need)} "
                              f"of host memory on {key}, whose available memory is {gib(memory[key][0])}, of which "
                              f"the explorers and the weight sync there take {gib(used)}")
    check_shared_memory(args, shape, trainers, explorers)
    return notes


def check_shared_memory(args, shape: ModelShape, trainers: list[str], explorers: list[str]) -> None:
    """The shared memory the weight hand-off needs is free, or one line naming --shm-size (a container's /dev/shm
    is 64 MB unless it is given more). What the run lays out there (common/buckets.py `shared_memory_dir`):
    trainer0's colocated slot when it trains on the CPU (common/weight_sync/colocated.py), the whole model in
    --dtype. (A vLLM explorer takes the slot, a broadcast or a checkpoint in its worker: nothing in /dev/shm; a GPU
    slot is GPU memory.)"""
    cpu_slot = trainers[0] == "cpu" and args.sync_method in ("auto", "colocated") and set(explorers) == {"cpu"}
    need = shape.params * dtype_bytes(args.dtype) if cpu_slot else 0.0
    where = shared_memory_dir()
    free = shutil.disk_usage(where).free
    if need > free:
        raise ConfigError(f"{where} has {gib(free)} free and the colocated weight hand-off lays out {gib(need)} there "
                          f"(--model {args.model} in {args.dtype}): enlarge it (docker run --shm-size="
                          f"{-(-int(need) // GIB) + 1}g; Kubernetes: an emptyDir with medium: Memory at /dev/shm)")


def _where(key: str, free: float, explorers: float) -> str:
    place = "the machine's available memory" if local_device(key) == "cpu" else f"{key}'s free memory"
    shared = f", of which the explorers there take {gib(explorers)}" if explorers else ""
    return f"{place} is {gib(free)}{shared}"


def _fit_trainer(shape, critic, args, key, budget, free, explorers, sequence, given, teacher=None, sync=0.0,
                 sync_what="") -> list[str]:
    """Fit one trainer device: as configured, else with checkpointing, else with smaller micro-batches (each only
    where the user left that field open), else one line naming the flag. `sync`: the weight sync's bytes there."""
    device_type = "cpu" if local_device(key) == "cpu" else "cuda"
    packed = args.max_tokens_per_micro_batch > 0
    flag, field = (("--max-tokens-per-micro-batch", "max_tokens_per_micro_batch") if packed else
                   ("--micro-batch-size", "micro_batch_size"))
    size, smallest = getattr(args, field), sequence if packed else 1

    def peak(n: int, ckpt: bool) -> float:  # a packed micro-batch holds at least one whole sequence
        tokens = max(n, sequence) if packed else n * sequence
        trained = tokens if packed else n * args.max_new_tokens
        return trainer_estimate(shape, args, device_type, tokens, trained, ckpt, critic, teacher).peak + sync

    ckpt = args.gradient_checkpointing
    if peak(size, ckpt) <= budget:
        return []
    states = trainer_estimate(shape, args, device_type, 0, 0, True, critic, teacher)
    offloading = device_type == "cuda" and args.fsdp_cpu_offload
    resident = max(states.states, states.load) + states.process + sync  # before any micro-batch
    if resident > budget:  # weights, gradients, optimizer state (or, offloaded, the model loading) and the sync
        fixes = []
        if args.trainer_shard != "fsdp" and not args.lora_rank:
            fixes += ["--trainer-shard fsdp over more --trainer-devices", "--lora-rank 16"]
        if args.dtype != "bfloat16":
            fixes.append("--dtype bfloat16")
        if device_type == "cuda" and args.trainer_shard == "fsdp" and not args.fsdp_cpu_offload and \
                whole_model_bytes(dtype_bytes(args.dtype), shape, critic, teacher) + states.process + sync <= budget:
            fixes.append("--fsdp-cpu-offload")
        if explorers:
            fixes.append("the explorers on another device")
        what = ("the whole model (each trainer loads it there, then shards and offloads it):" if offloading else
                "weights, gradients and AdamW state of")
        raise ConfigError(f"--model {args.model} does not fit a trainer on {key}: {what} "
                          f"{shape.params / 1e9:.2f} B parameters in {args.dtype} need {gib(resident)}"
                          f"{f' with the weight sync ({sync_what}: {gib(sync)})' if sync else ''} and "
                          f"{_where(key, free, explorers)}: use "
                          f"{' or '.join(fixes) or 'a device with more memory'}")
    notes = []
    if not ckpt and "gradient_checkpointing" not in given:
        line = (f"[tandem] memory: trainer on {key}: --gradient-checkpointing on ({gib(peak(size, False))} "
                f"without it, {_where(key, free, explorers)})")
        ckpt = args.gradient_checkpointing = True
        if peak(size, True) <= budget:
            return [line]
        notes.append(line)
    best = _largest_fit(lambda n: peak(n, ckpt) <= budget, size)
    if best >= smallest and field not in given:
        setattr(args, field, best)
        return notes + [f"[tandem] memory: trainer on {key}: {flag} {best} ({gib(peak(best, ckpt))}; {size} "
                        f"would need {gib(peak(size, ckpt))} and {_where(key, free, explorers)})"]
    unit = "tokens" if packed else f"sequences of up to {sequence} tokens"
    hint = (f"{flag} {best} fits" if best >= smallest else
            f"not even one sequence of {sequence} tokens fits: lower --max-new-tokens, or shard the trainer over "
            "more --trainer-devices with --trainer-shard fsdp")
    more = "" if ckpt else "; or add --gradient-checkpointing"
    raise ConfigError(f"{flag} {size}: a trainer on {key} needs {gib(peak(size, ckpt))} for micro-batches of {size} "
                      f"{unit}{f' (the weight sync {gib(sync)} of it: {sync_what})' if sync else ''} and "
                      f"{_where(key, free, explorers)}: {hint}{more}")


def _largest_fit(fits, upper: int) -> int:
    """The largest n in 1..upper with fits(n) (fits is monotone: memory grows with n), 0 if none."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _explorer_error(args, shape: ModelShape, key: str, need: float, free: float) -> str:
    weights = shape.params * dtype_bytes(args.dtype)
    if weights > free and not (args.engine == "vllm" and local_device(key) != "cpu"):
        return (f"--model {args.model} does not fit an explorer on {key}: its weights in {args.dtype} need "
                f"{gib(weights)} and {_where(key, free, 0)}" + ("" if args.dtype == "bfloat16" else
                                                                 ": use --dtype bfloat16 or a smaller model"))
    if args.engine == "vllm" and local_device(key) != "cpu":
        return (f"--vllm-gpu-memory-utilization {args.vllm_gpu_memory_utilization}: vLLM (its share, with the "
                f"explorer's own process and sync buffer) would take {gib(need)} of "
                f"{key}, whose free memory is {gib(free)}: lower it")
    if args.engine == "vllm":
        return (f"--vllm-kv-cache-gb {args.vllm_kv_cache_gb}: the explorers on cpu need {gib(need)} with the weights "
                f"of --model {args.model} and the machine's available memory is {gib(free)}: lower it")
    return (f"--tasks-per-step {args.tasks_per_step} x --samples-per-task {args.samples_per_task}: the HF explorers "
            f"on {key} need {gib(need)} (weights and the KV cache of every sample, --max-new-tokens "
            f"{args.max_new_tokens}) and {key} has {gib(free)} free: lower them")
