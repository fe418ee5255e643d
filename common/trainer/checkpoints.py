"""The files of checkpoints: whole or absent, verified before use, pruned, and never written to a full disk.

- A checkpoint is written to `.tmp-<name>-<pid>` and renamed; a failed write removes the temporary folder, and the
  launcher removes any `.tmp-*` left by a killed run before it starts (`remove_partial`).
- Each checkpoint ends with `manifest.json`: the size and CRC-32 of every file. `verify` recomputes them, so a
  truncated or damaged file is found (and named) before `--resume` loads it; `newest_valid` then falls back to the
  previous checkpoint with a one-line warning.
- `prune` keeps the newest `--keep-checkpoints` K step checkpoints (the older ones go once the newest is complete).
- `ensure_free_space` refuses, in one line naming the folder, a save the disk has no room for (nothing is written).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import zlib

import torch

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


def remove_newer(out_dir: str, step: int) -> list[str]:
    """Checkpoints after `step` (a resumed run abandons them: they are redone, once); returns what went."""
    gone = [path for s, path in step_checkpoints(out_dir) if s > step]
    for path in gone:
        shutil.rmtree(path)
    return gone


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
