"""LoRA (`--lora-rank`, peft): the trainer trains adapters only, and the explorers get the merged weights, so they
serve a plain model of the original architecture (no adapter support needed in the rollout engine)."""

from __future__ import annotations

import torch


def add_lora(model, rank: int, alpha: float, target_modules: str):
    """peft LoRA adapters on `target_modules`; every other weight is frozen (no gradient, no optimizer state)."""
    from peft import LoraConfig, get_peft_model

    modules = [m.strip() for m in target_modules.split(",") if m.strip()]
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    if not set(modules) & present:
        raise SystemExit(f"error: --lora-target-modules {target_modules}: none of these modules is in the model")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", target_modules=modules)
    return get_peft_model(model, config)


def merged_named_weights(model) -> list[tuple[str, torch.Tensor]]:
    """LoRA: the base model's weights with every adapter merged in (W + scale * B @ A), in the HF names and
    named_parameters order the explorers hold; new tensors for the adapted matrices, the others as they are."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            deltas[f"{name}.base_layer.weight"] = (f"{name}.weight", module)
    out = []
    with torch.no_grad():
        for name, p in base.named_parameters():
            if ".lora_" in name:
                continue
            if name in deltas:
                hf_name, module = deltas[name]
                delta = sum(module.get_delta_weight(a) for a in module.active_adapters)
                out.append((hf_name, p.detach() + delta.to(p.dtype)))
            else:
                out.append((name.replace(".base_layer.", "."), p.detach()))
    return out
