"""Trainer-side memory levers applied to a freshly loaded model: activation checkpointing, LoRA (peft,
common/lora.py) and FSDP2
sharding over the data-parallel trainers (`--trainer-shard fsdp`). `prepare_model` is the one call the trainer and
the critic make; the state-dict helpers below are what checkpoints and resume use in either mode.

FSDP2 (`torch.distributed.fsdp.fully_shard`): every decoder layer is one unit and the root holds the rest
(embeddings, final norm, LM head), so a trainer keeps 1/N of the parameters, gradients and AdamW moments and
all-gathers one layer at a time in the forward and backward. Gradients are reduce-scattered as a sum (divide factor
1): the loss is already normalised by the whole minibatch, exactly as the replicas' all-reduce does
(common/trainer/parallel.py). With `--dtype bfloat16` the parameters are bf16 and the reduction runs in fp32
(MixedPrecisionPolicy). Sharded trainers must run the same number of forward/backward passes (every pass is a
collective): common/trainer/forward.py `micro_batches` pads the shorter lists with idle passes.

Checkpoints of sharded trainers are gathered into the same HF folder + trainer_state.pt as the replicas' (full
state dicts, gathered into trainer 0's host memory, one tensor at a time on the device): final/ stays a plain HF
folder, and a run can be resumed with any number of trainers, sharded or not, at the price of holding a full
copy of weights and optimizer state in trainer 0's CPU memory while saving (torch.distributed.checkpoint would
write shards in parallel instead; worth it beyond ~30B, where host memory runs short).
"""

from __future__ import annotations

import os
import types

import torch

from common.lora import LoraSpec, add_lora
from common.trainer.forward import logprobs_forward, lm_body, use_packed_attention
from common.vlm import freeze


def decoder_layers(hf_model) -> list[torch.nn.Module]:
    """The transformer blocks of a causal LM (or of the critic's body): one FSDP unit each."""
    body = lm_body(hf_model)
    for attr in ("layers", "h", "blocks"):
        if isinstance(getattr(body, attr, None), torch.nn.ModuleList):
            return list(getattr(body, attr))
    raise SystemExit(f"error: --trainer-shard fsdp: cannot find the decoder layers of {type(body).__name__}")


def shard(model, dp, dtype: torch.dtype | None, cpu_offload: bool = False, hf_model=None):
    """FSDP2 over the trainers' process group: each decoder layer (of `hf_model`, the causal LM inside `model`; by
    default `model` itself), then the root. `dtype`: the parameters' compute dtype (None: each its own)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = DeviceMesh.from_group(dp.group, dp.device.type)
    mixed = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)  # bf16: fp32 gradient reduction
    # pinned host memory needs an accelerator (CPU trainers offload only in tests: --fsdp-cpu-offload refuses them)
    offload = CPUOffloadPolicy(pin_memory=dp.device.type == "cuda") if cpu_offload else OffloadPolicy()
    options = dict(mesh=mesh, mp_policy=mixed, offload_policy=offload)
    for layer in decoder_layers(hf_model or model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum, as the replicas' all-reduce
            module.set_force_sum_reduction_for_comms(True)  # ReduceOp.SUM (gloo has no PREMUL_SUM)
    if hasattr(model, "get_output_embeddings"):
        # sequence_logprobs calls the body and the LM head, not model.forward: make that call a forward of the
        # root, so FSDP gathers the root's parameters (embeddings, norm, head) around it.
        from torch.distributed.fsdp import register_fsdp_forward_method

        model.tandem_logprobs_forward = types.MethodType(logprobs_forward, model)
        register_fsdp_forward_method(model, "tandem_logprobs_forward")
    return model


def prepare_model(model, args, dp=None, trainable: bool = True, shard_it: bool = True, value_body=None):
    """The model as the trainer uses it: packed attention when --max-tokens-per-micro-batch (common/trainer/forward.py
    `use_packed_attention`), checkpointed when --gradient-checkpointing and with LoRA adapters when --lora-rank
    (trainable models only), sharded over the trainers when --trainer-shard fsdp (and `shard_it`: not a model on a
    device of its own). `value_body`: `model` is a value model (the critic) over this causal LM body, trained in
    full (no LoRA)."""
    hf_model = model if value_body is None else value_body
    if args.max_tokens_per_micro_batch > 0:
        use_packed_attention(hf_model)
    if trainable and args.gradient_checkpointing:  # non-reentrant: works under FSDP2 and with inputs needing no grad
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if trainable and args.freeze != "none":
        freeze(model, args.freeze)
    if trainable and args.lora_rank and value_body is None:  # the critic is trained in full
        model = add_lora(model, LoraSpec.from_args(args))
    if args.trainer_shard == "fsdp" and shard_it:
        if dp is None or dp.group is None:
            raise RuntimeError("--trainer-shard fsdp: the model must be prepared inside a trainer worker")
        # LoRA: each parameter computes in its own dtype (fp32 adapters next to the frozen base in --dtype), as
        # the replicas and the engines do; one FSDP unit per layer holds both and gathers them one unit at a time
        dtype = None if args.lora_rank else next(model.parameters()).dtype
        model = shard(model, dp, dtype, args.fsdp_cpu_offload, hf_model)
    return model


def is_fsdp(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


# ----------------------------------------------------------------------------- state dicts for checkpoints
def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_state_dict(model) -> dict:
    """Every weight, whole, on the CPU: gathered onto trainer 0 when sharded (a collective: every trainer calls it;
    the others get {}), else the plain state dict."""
    if not is_fsdp(model):
        return {k: v.detach() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def load_full_state_dict(model, state: dict, strict: bool = True):
    """Load whole weights into a model, sharding them when it is sharded (every trainer passes the same dict)."""
    if not is_fsdp(model):
        return model.load_state_dict(state, strict=strict)
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    return set_model_state_dict(model, state, options=_options(strict=strict))


def optimizer_state(model, optimizer) -> dict:
    """The optimizer's state to save: gathered by parameter name onto trainer 0 when sharded (collective)."""
    if not is_fsdp(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))


def load_optimizer_state(model, optimizer, state: dict) -> None:
    if not is_fsdp(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=_options())


def save_hf_folder(model, state: dict, folder: str) -> None:
    """A plain HF folder (config + model.safetensors) from a whole state dict: what save_pretrained writes, without
    touching the (possibly sharded) module. A tied LM head is left out, as save_pretrained does."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    tied = getattr(model.config, "tie_word_embeddings", False)
    weights = {k: v.contiguous() for k, v in state.items() if not (tied and k == "lm_head.weight")}
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
