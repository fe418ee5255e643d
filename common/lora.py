"""LoRA (`--lora-rank`, peft): the trainer trains low-rank adapters on a frozen base, and the explorers get the
adapters themselves, never the base weights with the adapters merged in.

Why not merged. Merging computes W + scale * B @ A and rounds it to the weights' dtype. In bf16 (8 significant bits)
an entry of the update smaller than about |W| * 2^-9 rounds away: on SmolLM2-135M with rank 8 on every linear layer
98 % of a +-1e-4 update of B and 85 % of a +-1e-3 one were lost (issue 52), so the explorers kept sampling from
nearly the base model while the trainer's adapters moved. Kept apart, A and B each keep their own precision.

What crosses the weight sync (`adapter_tensors`): for every adapted linear layer lora_A [r, in] and lora_B [out, r]
in fp32 (the adapters' training precision, whatever --dtype), named after the HF module (`<module>.lora_A.weight`,
peft's saved names without its `base_model.model.` prefix), in the model's module order; the scale alpha / r is
config both sides know. That is all a sync sends (`sync/bytes`: rank 8 on every linear layer of a 7B ~80 MB, where
the merged model is 15 GB in bf16). The engines apply them unmerged:
- HF engine (`inject_lora`): the same peft layers as the trainer's, y = W x + scale * B (A x) with A and B in fp32
  (W x in --dtype, as in the trainer); an update copies into A and B in place, so captured CUDA graphs stay valid;
- vLLM (common/explorer/engine_vllm.py): each weights version is one LoRA adapter built from the tensors in memory,
  kept loaded while requests sampled by it still run.
Merged sync (`merged_named_weights`) remains for `--lora-sync merged` and engines that cannot serve adapters (a vLLM
architecture without LoRA support); the run says so in its first lines, with what the merge loses at its dtype.

Defaults, from "LoRA Without Regret" (Schulman and Thinking Machines Lab, 2025, https://thinkingmachines.ai/blog/lora/):
adapters on every linear layer (attention and MLP: attention-only LoRA learns markedly worse); alpha 32 with the
1/r scale, which makes the best learning rate nearly independent of the rank; a learning rate 10x the full fine-tune's
(their optimum was ~10x across tasks and ranks, up to 15x for short runs); in RL even rank 1 matched full fine-tuning
(a policy-gradient episode carries about one bit). So `--lora-rank R` alone is a recipe: --lr, unless given, is
`LR_SCALE` times the full fine-tune's default.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from common.model import resolve_model

LR_SCALE = 10.0  # LoRA's learning rate / the full fine-tune's ("LoRA Without Regret": ~10x)
ADAPTER = "default"  # peft's adapter name, on both sides


@dataclass(frozen=True)
class LoraSpec:
    """Rank, alpha and target module names: what the trainer's peft model and every engine build alike."""
    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_args(cls, args) -> "LoraSpec | None":
        if not args.lora_rank:
            return None
        return cls(args.lora_rank, args.lora_alpha,
                   tuple(m.strip() for m in args.lora_target_modules.split(",") if m.strip()))

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=0.0, bias="none",
                          target_modules=list(self.targets))


def apply_defaults(args) -> None:
    """--lora-rank without --lr: the learning rate scaled for LoRA (`LR_SCALE`, module docstring)."""
    if args.lora_rank and "lr" not in args.given_fields:
        args.lr *= LR_SCALE
        args.given_fields = frozenset(args.given_fields | {"lr"})  # once


def _check_targets(model, spec: LoraSpec) -> None:
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    if not set(spec.targets) & present:
        raise SystemExit(f"error: --lora-target-modules {','.join(spec.targets)}: none of these modules is in the "
                         "model")


def _adapters_to_fp32(model) -> None:
    """A and B in fp32 whatever the base's dtype (their optimizer state follows them)."""
    for name, p in model.named_parameters():
        if ".lora_" in name:
            p.data = p.data.float()


def add_lora(model, spec: LoraSpec):
    """The trainer's policy: peft adapters on `spec.targets`, in fp32; every other weight is frozen (no gradient, no
    optimizer state) in its own dtype."""
    from peft import get_peft_model

    _check_targets(model, spec)
    model = get_peft_model(model, spec.peft_config())
    _adapters_to_fp32(model)
    return model


def inject_lora(model, spec: LoraSpec):
    """An engine's model with the same peft layers as the trainer's (same module names, A and B in fp32, B zero):
    the model keeps its class and forward, so `generate` and the static decode loop run it as they are."""
    from peft import inject_adapter_in_model

    _check_targets(model, spec)
    model = inject_adapter_in_model(spec.peft_config(), model, adapter_name=ADAPTER)
    _adapters_to_fp32(model)
    model.requires_grad_(False)
    return model


def lora_layers(model) -> list[tuple[str, object]]:
    """(HF module name, peft LoRA layer) of every adapted layer, in module order (peft's wrapper prefix dropped)."""
    from peft.tuners.lora import LoraLayer

    return [(name.removeprefix("base_model.model."), m) for name, m in model.named_modules()
            if isinstance(m, LoraLayer)]


def adapter_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """What the explorers get: (`<module>.lora_A.weight`, A [r, in]) and (`<module>.lora_B.weight`, B [out, r]) of
    every adapted layer, the parameters themselves (DTensor shards when sharded: the sync gathers them)."""
    out = []
    for name, layer in lora_layers(model):
        out += [(f"{name}.lora_A.weight", layer.lora_A[ADAPTER].weight),
                (f"{name}.lora_B.weight", layer.lora_B[ADAPTER].weight)]
    return out


def adapter_delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * B @ A in fp32: the update an adapter adds to its layer's weight."""
    return scale * (b.float() @ a.float())


def merged_state(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """HF names -> weights of a plain model from a peft model's parameters (its own, or a sharded model's gathered
    full state): every adapted W becomes W + scale * B @ A rounded to W's dtype, the adapters drop out."""
    out = {}
    for key, t in state.items():
        if ".lora_" in key:
            continue
        if key.endswith(".base_layer.weight"):
            prefix = key.removesuffix(".base_layer.weight")
            a, b = state[f"{prefix}.lora_A.{ADAPTER}.weight"], state[f"{prefix}.lora_B.{ADAPTER}.weight"]
            t = t + adapter_delta(a, b, scale).to(t.dtype)
        out[key.removeprefix("base_model.model.").replace(".base_layer.", ".")] = t
    return out


def merged_named_weights(model) -> list[tuple[str, torch.Tensor]]:
    """The base model's weights with every adapter merged in, in the HF names and named_parameters order of a plain
    model: what `--lora-sync merged` sends and final/ holds (`merged_state`)."""
    scale = next(layer.scaling[ADAPTER] for _, layer in lora_layers(model))
    with torch.no_grad():
        return list(merged_state({n: p.detach() for n, p in model.named_parameters()}, scale).items())


def adapter_file_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of a peft model's state (its own, or gathered when sharded) under the names peft saves
    (adapter_model.safetensors: no adapter name)."""
    return {k.replace(f".{ADAPTER}.", "."): t.contiguous() for k, t in state.items() if ".lora_" in k}


def module_state(file_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`adapter_file_state` back to the peft model's parameter names."""
    return {k.replace(".lora_A.", f".lora_A.{ADAPTER}.").replace(".lora_B.", f".lora_B.{ADAPTER}."): t
            for k, t in file_state.items()}


def merge_lost_share(model) -> float:
    """The share of the adapters' update that merging onto the base's dtype loses: ||round(W + d) - W - d|| / ||d||
    over every adapted layer (0 with no update yet; 0 in fp32 up to fp32 rounding)."""
    lost = total = 0.0
    with torch.no_grad():
        for _, layer in lora_layers(model):
            w = layer.get_base_layer().weight
            d = adapter_delta(layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight, layer.scaling[ADAPTER])
            kept = (w + d.to(w.dtype)).float() - w.float()
            lost += (kept - d).square().sum().item()
            total += d.square().sum().item()
    return (lost / total) ** 0.5 if total else 0.0


# ----------------------------------------------------------------------------- which sync (--lora-sync auto)
def vllm_serves_adapters(model_path: str, spec: LoraSpec) -> tuple[bool, str]:
    """(True, "") when vLLM's implementation of the folder's architecture takes LoRA adapters of this rank, else
    (False, why)."""
    from vllm.model_executor.models.interfaces import supports_lora

    from common.compat.vllm import model_class

    archs = json.load(open(os.path.join(model_path, "config.json"))).get("architectures") or []
    for arch in archs:
        cls = model_class(arch)
        if cls is not None and not supports_lora(cls):
            return False, f"vLLM's {arch} takes no LoRA adapters"
    if spec.rank > 512:
        return False, f"vLLM serves LoRA ranks up to 512, not {spec.rank}"
    return True, ""


def resolve_sync(args, model_path: str) -> tuple[str, str]:
    """(adapters | merged, why) for --lora-sync: auto is adapters wherever the engine serves them, except vLLM on
    CPUs in fp32. The launcher resolves it once (common/run.py), so every worker gets adapters or merged."""
    spec = LoraSpec.from_args(args)
    if args.lora_sync == "merged":
        return "merged", "--lora-sync merged"
    if (args.lora_sync == "auto" and args.engine == "vllm" and args.dtype == "float32" and args.trainer_shard != "fsdp"
            and set(args.explorer_device_list) == {"cpu"}):
        # vLLM's CPU LoRA path copies each token's adapter (vllm/lora/ops/torch_ops): the default model's rollout
        # tokens/s 0.74x at rank 1, 0.15x at rank 32 (docs/BENCHMARKS.md); an fp32 merge loses nothing
        return "merged", "--lora-sync auto: vLLM on the CPU in fp32, where the merge is exact and faster to sample"
    if args.lora_sync == "adapters" and args.engine != "vllm":
        return "adapters", "--lora-sync adapters"
    # an engine not resolved yet (a trainer built directly, in tests) is taken for the HF engine
    ok, why = (True, "") if args.engine != "vllm" or model_path == "tiny" else vllm_serves_adapters(model_path, spec)
    if ok:
        return "adapters", f"--lora-sync {args.lora_sync}"
    if args.lora_sync == "adapters":
        raise SystemExit(f"error: --lora-sync adapters: {why} (use --lora-sync merged or --engine hf)")
    return "merged", f"--lora-sync auto: {why}"


def sync_mode(args) -> str | None:
    """adapters | merged for a LoRA run (resolved here when the launcher has not: trainers built directly), else
    None."""
    if not args.lora_rank:
        return None
    if args.lora_sync == "auto":
        args.lora_sync = resolve_sync(args, resolve_model(args.model))[0]
    return args.lora_sync


def describe(args, mode: str, why: str) -> str:
    """The run's first line about LoRA: the recipe and what the explorers get (and, merged, what that loses)."""
    spec = LoraSpec.from_args(args)
    default = type(args)().lr * LR_SCALE
    lr = f"lr {args.lr:g}" + (f" ({LR_SCALE:g}x the full fine-tune's default: LoRA Without Regret)"
                               if abs(args.lr - default) <= 1e-9 * default else "")
    head = (f"LoRA rank {spec.rank}, alpha {spec.alpha:g} (scale {spec.scale:g}) on {','.join(spec.targets)}; {lr}; "
            "adapters and their AdamW state in fp32, base frozen in " + args.dtype)
    if mode == "adapters":
        return f"{head}; explorers get the adapters (fp32, unmerged; {why})"
    loses = ("nothing (fp32)" if args.dtype == "float32" else
             f"most of a small update on the {args.dtype} grid (98 % of a +-1e-4 adapter update on SmolLM2-135M; "
             "measured each sync as lora/merge_lost)")
    return f"{head}; explorers get MERGED weights ({why}): the merge loses {loses}"
