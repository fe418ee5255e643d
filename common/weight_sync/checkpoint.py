"""--sync-method checkpoint: trainer rank 0 writes each version as safetensors files in `<out_dir>/sync`, atomically;
explorers poll the folder (it must be shared across nodes: checked at start-up with a token file)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid

from safetensors.torch import save_file

from common.weight_sync.base import Folder, WeightSync, full_tensor


def write_sync_checkpoint(sync_dir: str, named_tensors, version: int, keep: int = 3) -> str:
    """safetensors + version, atomically: written to a temp folder, renamed, then LATEST is replaced by rename.

    A reader that sees LATEST = v finds v complete; a writer killed mid-save leaves only a temp folder behind.
    """
    os.makedirs(sync_dir, exist_ok=True)
    final = os.path.join(sync_dir, f"v{version}")
    tmp = os.path.join(sync_dir, f".tmp-v{version}-{os.getpid()}")
    os.makedirs(tmp, exist_ok=True)
    # sharded: gathered one tensor at a time into host memory (the file is written whole)
    save_file({name: full_tensor(t).detach().cpu().contiguous() for name, t in named_tensors},
              os.path.join(tmp, "model.safetensors"))
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    with open(os.path.join(sync_dir, ".LATEST.tmp"), "w") as f:
        f.write(str(version))
    os.replace(os.path.join(sync_dir, ".LATEST.tmp"), os.path.join(sync_dir, "LATEST"))
    for old in sorted((int(d[1:]) for d in os.listdir(sync_dir) if d.startswith("v") and d[1:].isdigit()))[:-keep]:
        shutil.rmtree(os.path.join(sync_dir, f"v{old}"), ignore_errors=True)
    return final


def latest_sync_version(sync_dir: str) -> int:
    try:
        with open(os.path.join(sync_dir, "LATEST")) as f:
            return int(f.read().strip())
    except FileNotFoundError:
        return -1


def check_shared_folder(ctx, folder: str, timeout_s: float) -> None:
    """Every explorer must see the folder trainer rank 0 writes (a shared filesystem across nodes); checked with a
    token file before any model loads."""
    probe = os.path.join(folder, ".probe")
    if ctx.rank == 0:
        os.makedirs(folder, exist_ok=True)
        mine = {"token": uuid.uuid4().hex, "folder": os.path.abspath(folder), "node": socket.gethostname()}
        with open(probe, "w") as f:
            f.write(mine["token"])
        ctx.store.set("probe", json.dumps(mine))
        return
    if ctx.role != "explorer":
        return
    trainer = json.loads(ctx.wait_key("probe", timeout_s, "sync folder token from trainer0"))
    seen = open(probe).read() if os.path.exists(probe) else None
    if seen != trainer["token"]:
        raise SystemExit(f"error: {ctx.name} on node {socket.gethostname()}: --sync-method checkpoint needs "
                         f"trainer0's folder {trainer['folder']} (node {trainer['node']}) here as "
                         f"{os.path.abspath(folder)}, and this node does not see it: put --out-dir on a shared "
                         "filesystem or use --sync-method broadcast")


class CheckpointSync(WeightSync):
    name = "checkpoint"

    def __init__(self, ctx, args, timeline, engine=None):
        super().__init__(ctx, args, timeline, engine)
        self.sync_dir = os.path.join(args.out_dir, "sync")

    @classmethod
    def check(cls, ctx, args):
        check_shared_folder(ctx, os.path.join(args.out_dir, "sync"), args.timeout_s)

    def _send(self, named_tensors, version, step, wait, check):
        with self.timeline.phase("sync-checkpoint", step=step, version=version, **check):
            write_sync_checkpoint(self.sync_dir, named_tensors, version)

    def pull(self, step):
        """Wait for the trainer's next checkpoint, then take the newest one."""
        start, wanted = time.time(), self.version + 1
        while latest_sync_version(self.sync_dir) < wanted:
            if time.time() - start > self.args.timeout_s:
                raise TimeoutError(f"{self.ctx.name}: no sync checkpoint v{wanted} in {self.sync_dir} after "
                                   f"{self.args.timeout_s:.0f}s (trainer stalled?)")
            time.sleep(0.02)
        self.timeline.record("wait", start, time.time(), step=step)
        self.poll(step)
        return self.version

    def poll(self, step):
        latest = latest_sync_version(self.sync_dir)
        if latest <= self.version:
            return False
        start = time.time()
        self.engine.load_weights(Folder(os.path.join(self.sync_dir, f"v{latest}")), latest)
        self.version = latest
        self.timeline.record("sync-checkpoint", start, time.time(), step=step, version=latest, **self._checked())
        return True
