"""Checkpoints: the trainer's save and resume (`save`, `resume`), and their files: whole or absent, verified before
use, pruned, and never written to a full disk.

- A checkpoint is written to `.tmp-<name>-<pid>` and renamed; a failed write removes the temporary folder, and the
  launcher removes any `.tmp-*` left by a killed run before it starts (`remove_partial`).
- Each checkpoint ends with `manifest.json`: the size and CRC-32 of every file. `verify` recomputes them, so a
  truncated or damaged file is found (and named) before `--resume` loads it; `newest_valid` then falls back to the
  previous checkpoint with a one-line warning.
- `prune` keeps the newest `--keep-checkpoints` K step checkpoints (the older ones go once the newest is complete).
- `ensure_free_space` refuses, in one line naming the folder, a save the disk has no room for (nothing is written).
- step_N holds the HF folder, trainer_state.pt (step, version, optimizer, schedule, RNGs) and critic/, reference/
  where they exist; final/ the model and tokenizer only. Sharded trainers all call `save` (each gather is a
  collective); trainer 0 writes.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import sys
import zlib

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from common.trainer.fsdp import (full_state_dict, load_full_state_dict, load_optimizer_state, optimizer_state,
                                 save_hf_folder)
from common.lora import ADAPTER, LoraSpec, adapter_file_state, merged_state, module_state

MANIFEST = "manifest.json"
MARGIN_BYTES = 1 << 20  # tokenizer, config and metrics rows besides the tensors


def tensor_bytes(obj) -> int:
    """Bytes of every tensor in a (nested) state dict / list: what torch.save or safetensors will write."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def tokenizer_bytes(tokenizer) -> int:
    """About what save_pretrained writes for a fast tokenizer (tokenizer.json is indented: ~2.4x the compact JSON)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return 3 * len(backend.to_str()) if backend is not None else 0


def adam_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """AdamW's state once it exists (before the first step: estimated as two moments per parameter)."""
    if optimizer.state:
        return tensor_bytes(optimizer.state_dict()["state"])
    return sum(2 * p.numel() * p.element_size() for group in optimizer.param_groups for p in group["params"])


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(folder: str) -> list[str]:
    out = []
    for root, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(root, n), folder) for n in names if n != MANIFEST]
    return sorted(out)


def write_manifest(folder: str) -> None:
    manifest = {rel: {"bytes": os.path.getsize(os.path.join(folder, rel)), "crc32": _crc32(os.path.join(folder, rel))}
                for rel in _files(folder)}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def verify(folder: str) -> str | None:
    """None when the checkpoint is whole; else what is wrong, naming the file."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):  # the manifest is written last: without it the checkpoint is not whole
        return f"{path} is missing"
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        return f"{path} is unreadable ({e})"
    for rel, want in manifest.items():
        file = os.path.join(folder, rel)
        if not os.path.exists(file):
            return f"{file} is missing"
        size = os.path.getsize(file)
        if size != want["bytes"]:
            return f"{file} is {size} bytes, expected {want['bytes']} (truncated?)"
        if _crc32(file) != want["crc32"]:
            return f"{file} is damaged (CRC-32 differs from the manifest)"
    return None


def step_checkpoints(out_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every out_dir/checkpoints/step_N folder, oldest first."""
    found = []
    for path in glob.glob(os.path.join(out_dir, "checkpoints", "step_*")):
        suffix = path.rsplit("_", 1)[1]
        if suffix.isdigit() and os.path.isdir(path):
            found.append((int(suffix), path))
    return sorted(found)


def newest_valid(out_dir: str, warn: bool = True) -> str | None:
    """The newest checkpoint that verifies; each newer one that does not is skipped with a one-line warning."""
    for step, path in reversed(step_checkpoints(out_dir)):
        problem = verify(path)
        if problem is None:
            return path
        if warn:
            print(f"warning: skipping corrupt checkpoint: {problem}; trying the previous one", file=sys.stderr,
                  flush=True)
    return None


def remove_newer(out_dir: str, step: int) -> None:
    """Checkpoints after `step` (a resumed run abandons them: they are redone, once)."""
    for path in [path for s, path in step_checkpoints(out_dir) if s > step]:
        shutil.rmtree(path)


def prune(out_dir: str, keep: int) -> None:
    """Keep the `keep` newest step checkpoints (0: all)."""
    if keep:
        for _, path in step_checkpoints(out_dir)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)


def remove_partial(out_dir: str) -> None:
    """Temporary folders of saves that never finished (a killed run)."""
    for path in glob.glob(os.path.join(out_dir, ".tmp-*")) + glob.glob(os.path.join(out_dir, "checkpoints", ".tmp-*")):
        shutil.rmtree(path, ignore_errors=True)


def ensure_free_space(folder: str, needed: int, what: str) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise SystemExit(f"error: no space for {what} in {os.path.abspath(folder)}: it needs about "
                         f"{needed / 1e6:.1f} MB, {free / 1e6:.1f} MB are free (nothing was written; free some "
                         f"space, then --resume)")


def disk_error(folder: str, what: str, e: Exception) -> SystemExit:
    reason = getattr(e, "strerror", None) or str(e).split(": ")[-1]
    return SystemExit(f"error: could not write {what} in {os.path.abspath(folder)}: {reason} "
                      f"(the partial folder was removed; free some space, then --resume)")


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(folder) for n in names)


def link_weights(source: str, dest: str) -> None:
    """dest/ gets source's model and tokenizer files as hard links (no bytes copied; a copy where links fail)."""
    os.makedirs(dest)
    for name in os.listdir(source):
        path = os.path.join(source, name)
        if name in (MANIFEST, "trainer_state.pt") or os.path.isdir(path):  # optimizer, critic/, reference/
            continue
        try:
            os.link(path, os.path.join(dest, name))
        except OSError:
            shutil.copy2(path, os.path.join(dest, name))


def replace_folder(tmp: str, final: str) -> None:
    """Rename tmp to final; an existing final is moved aside first and removed after, so one of them is whole."""
    old = None
    if os.path.exists(final):
        old = f"{os.path.dirname(final)}/.tmp-old-{os.path.basename(final)}-{os.getpid()}"
        os.rename(final, old)
    os.rename(tmp, final)
    if old:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- the trainer's save and resume
def checkpoint_bytes(trainer, weights_only: bool = False) -> int:
    """About the bytes a checkpoint takes: the parameters, plus (unless `weights_only`) AdamW's two moments,
    the critic and its optimizer, and a reset reference model."""
    total = tensor_bytes(list(trainer.model.parameters())) + MARGIN_BYTES + tokenizer_bytes(trainer.tokenizer)
    if weights_only:
        return total
    total += adam_state_bytes(trainer.optimizer)
    if trainer.critic is not None:
        total += tensor_bytes(list(trainer.critic.model.parameters())) + adam_state_bytes(trainer.critic.optimizer)
    if trainer.args.ref_reset_every:
        total += tensor_bytes(list(trainer.ref_model.parameters()))
    return total


def save(trainer, out_dir: str, name: str | None = None, extra_state: dict | None = None) -> str | None:
    """A checkpoint of `trainer` (common/trainer/trainer.py), written to a temp folder and renamed: whole or absent.
    step_N: HF folder + trainer_state.pt (+ critic/, reference/), then older ones beyond --keep-checkpoints go.
    final: the model and tokenizer only (hard links to step_N's files when that exists).
    Sharded trainers all call it (the full state is gathered onto trainer 0, common/trainer/fsdp.py); trainer 0 writes."""
    name = name or f"step_{trainer.step}"
    weights_only = name == "final"
    sharded = trainer.dp.sharded  # every gather below is a collective: each trainer takes the same branches
    gathered = {"weights": full_state_dict(trainer.model) if sharded else None,
                "optimizer": None if weights_only else optimizer_state(trainer.model, trainer.optimizer),
                "critic": trainer.critic.state() if trainer.critic is not None and not weights_only else None,
                "reference": (full_state_dict(trainer.ref_model) if trainer.args.ref_reset_every and not weights_only
                              else None)}
    if trainer.dp.rank != 0:
        return None
    parent = os.path.join(out_dir, "checkpoints") if name.startswith("step_") else out_dir
    os.makedirs(parent, exist_ok=True)
    final, tmp = os.path.join(parent, name), os.path.join(parent, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    source = os.path.join(out_dir, "checkpoints", f"step_{trainer.step}") if weights_only else None
    source = source if source and os.path.exists(os.path.join(source, MANIFEST)) else None  # whole
    ensure_free_space(parent, MARGIN_BYTES if source else checkpoint_bytes(trainer, weights_only),
                      f"checkpoint {name}")
    try:
        if source:
            link_weights(source, tmp)
        else:
            _write(trainer, tmp, weights_only, extra_state, gathered)
        write_manifest(tmp)
        replace_folder(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed save leaves no partial folder
        if isinstance(e, (OSError, SafetensorError)):  # safetensors reports ENOSPC as its own error
            raise disk_error(parent, f"checkpoint {name}", e) from None
        raise
    if not weights_only:
        prune(out_dir, trainer.args.keep_checkpoints)
    return final


def _write(trainer, tmp: str, weights_only: bool, extra_state: dict | None, gathered: dict) -> None:
    """The files of a checkpoint into `tmp`: the HF folder (merged weights and the adapter with LoRA), the
    tokenizer, and unless `weights_only` the critic, a reset reference and trainer_state.pt (step, version,
    optimizer, schedule, RNGs, `extra_state`)."""
    if trainer.args.lora_rank:  # a plain HF folder of the merged weights, plus the adapter to resume from
        state = gathered["weights"] if trainer.dp.sharded else {n: p.detach() for n, p in
                                                                 trainer.model.named_parameters()}
        save_hf_folder(trainer.model.get_base_model(), merged_state(state, LoraSpec.from_args(trainer.args).scale),
                       tmp)
        if not weights_only:
            os.makedirs(os.path.join(tmp, "adapter"))
            trainer.model.peft_config[ADAPTER].save_pretrained(os.path.join(tmp, "adapter"))
            save_file(adapter_file_state(state), os.path.join(tmp, "adapter", "adapter_model.safetensors"),
                      metadata={"format": "pt"})
    elif trainer.dp.sharded:
        save_hf_folder(trainer.model, gathered["weights"], tmp)
    else:
        trainer.model.save_pretrained(tmp)
    trainer.tokenizer.save_pretrained(tmp)
    if weights_only:
        return
    if trainer.critic is not None:
        trainer.critic.save(tmp, gathered["critic"])
    if trainer.args.ref_reset_every:  # the reference is no longer the initial model: keep it
        save_hf_folder(trainer.ref_model, gathered["reference"], os.path.join(tmp, "reference"))
    torch.save({
        "step": trainer.step, "version": trainer.version, "optimizer": gathered["optimizer"],
        "sharded_optimizer": trainer.dp.sharded, "lr_scheduler": trainer.lr_scheduler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        **(extra_state or {}),
    }, os.path.join(tmp, "trainer_state.pt"))


def resume(trainer, out_dir: str) -> dict:
    """Load the newest complete checkpoint into `trainer`; returns its extra state ({} when there is none)."""
    path = newest_valid(out_dir, warn=False)
    if path is None:
        return {}
    if trainer.args.lora_rank:
        _load_adapter(trainer, path)
    else:
        _load_weights(trainer, trainer.model, path)
    if trainer.critic is not None:
        trainer.critic.load(path)
    if trainer.ref_model is not None and os.path.isdir(os.path.join(path, "reference")):
        _load_weights(trainer, trainer.ref_model, os.path.join(path, "reference"))  # else: never reset, the initial one
    try:
        state = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, OSError) as e:  # verified by its manifest, yet unreadable: say so
        raise SystemExit(f"error: --resume: {path}/trainer_state.pt is unreadable ({str(e).splitlines()[0]})")
    if state.get("sharded_optimizer", False) != trainer.dp.sharded:  # keyed by name vs by index
        raise SystemExit(f"error: --resume {path}: optimizer state saved with --trainer-shard "
                         f"{'fsdp' if state.get('sharded_optimizer') else 'none'}; resume with the same")
    load_optimizer_state(trainer.model, trainer.optimizer, state["optimizer"])
    trainer.lr_scheduler.load_state_dict(state["lr_scheduler"])
    trainer.step, trainer.version = state["step"], state["version"]
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    return state


def _load_adapter(trainer, path: str):
    """LoRA: the base stays the initial model; the trained adapter comes back from <checkpoint>/adapter."""
    file = os.path.join(path, "adapter", "adapter_model.safetensors")
    if not os.path.exists(file):
        raise SystemExit(f"error: --resume {path}: no LoRA adapter in the checkpoint (saved without --lora-rank?)")
    state = module_state(load_file(file, device=str(trainer.device)))
    names = {n for n, _ in trainer.model.named_parameters() if ".lora_" in n}
    if set(state) != names:
        raise SystemExit(f"error: --resume {file}: adapter does not match --lora-* "
                         f"({sorted(set(state) ^ names)[:3]})")
    load_full_state_dict(trainer.model, state, strict=False)  # sharded: each trainer keeps its shards


def _load_weights(trainer, model, path: str):
    """`model` (the policy or the reference) from the safetensors files of `path`."""
    weights = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        weights.update(load_file(f, device="cpu" if trainer.dp.sharded else str(trainer.device)))
    missing, unexpected = load_full_state_dict(model, weights, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"error: --resume {path}: weights do not match the model ({missing[:3]} {unexpected[:3]})")
