"""--sync-method colocated: explorers that share trainer rank 0's device hand weights over through one shared buffer,
with no socket and no collective: the trainer writes once, every explorer reads once.

The buffer (the slot) is one flat byte buffer in trainer 0's memory holding every weight at a fixed offset
(`common.buckets.flat_layout`, HF named_parameters order and names):
- CPU: a file in /dev/shm that trainer and explorers map (torch.from_file, shared);
- CUDA: a tensor on trainer 0's GPU whose CUDA IPC handle (torch.multiprocessing's reduction, the one its
  Queue uses) explorers on that same GPU open; their copy out of it is a device-to-device copy.
Both take the same code path; only opening the slot differs (`open_slot`). An engine that opens the slot itself
(`Slot`: vLLM, whose worker maps the file or opens the CUDA IPC handle on its own GPU) loads straight from it;
others get the weights copied into their `weight_buffers()` and load those (`Buffers`). The file's name is removed
once every explorer has mapped it (the memory lives as long as a mapping does), so a run that is killed later leaves
nothing in /dev/shm.

One slot, guarded by a handshake in the run's store (each key written by one side only):
- `writing` (trainer 0) is set before it writes and cleared after the new version is published;
- `reading/<i>` (explorer i) is set before it reads and cleared once its copy has finished.
Each side raises its own flag, then reads the other's (the store orders every operation): an explorer that sees
`writing` lowers its flag and tries later; the trainer waits (a copy, milliseconds on a GPU) until no explorer
reads. So a version is never read while written, and what an explorer reads is exactly the published version.
The trainer never waits for an explorer to come and fetch (it writes into the slot when no copy is running, as the
in-flight broadcast snapshots): explorers take the newest version between generation batches, or between decode
steps with vLLM, and may skip versions as with checkpoint sync. `pull` blocks for a version newer than the one
held (the synchronous schedules, whose trainer pushes each version before it can make the next).

Applies when every explorer runs on trainer 0's node and device (all cpu, or the same GPU); checked at start-up.
`--sync-method auto` (the default) picks it there (common/weight_sync/__init__.py).
"""

from __future__ import annotations

import atexit
import io
import json
import os
import pickle
import time
import uuid

import torch

from common.buckets import flat_layout, flat_views, map_shared_file, remove_shared_file, shared_memory_dir
from common.runtime.channel import StoreValue
from common.weight_sync.base import Buffers, Slot, WeightSync, full_tensor


def colocated(ctx) -> tuple[bool, str]:
    """(every explorer runs on trainer 0's node and device, why not), from the places every rank published when the
    world formed (common/runtime/worker.py gather_places): a GPU by its UUID, so two ranks that each see their own GPU
    as cuda:0 are not taken for one. Every rank reaches the same answer."""
    trainer = ctx.places[ctx.sync_src]
    for r in ctx.explorer_ranks:
        where = ctx.places[r]
        if not where.same(trainer):
            return False, (f"{ctx.names[r]} runs on {where.device} ({where.id}) of node {where.node}, trainer0 on "
                           f"{trainer.device} ({trainer.id}) of node {trainer.node}")
    return True, ""


def shared_file(path: str, size: int) -> bytes:
    """How another process opens a flat buffer in a /dev/shm file (`open_slot`)."""
    return pickle.dumps({"path": path, "size": size})


def _share(slot: torch.Tensor, path: str | None) -> bytes:
    """How another process opens the slot: the /dev/shm file, or the CUDA IPC handle of the GPU tensor."""
    if slot.device.type == "cpu":
        return shared_file(path, slot.numel())
    from torch.multiprocessing.reductions import reduce_tensor

    buf = io.BytesIO()
    pickle.dump({"cuda": reduce_tensor(slot)}, buf)
    return buf.getvalue()


def open_slot(shared: bytes, device: torch.device) -> torch.Tensor:
    """The trainer's slot in this process: the same memory, no copy (CPU: mapped file; CUDA: IPC handle, opened on
    `device`, this process's number for the slot's GPU: a vLLM worker sees only its own GPU, as cuda:0)."""
    desc = pickle.loads(shared)
    if "path" in desc:
        return map_shared_file(desc["path"], desc["size"])
    rebuild, args = desc["cuda"]
    args = (*args[:6], device.index if device.index is not None else args[6], *args[7:])  # rebuild_cuda_tensor's
    slot = rebuild(*args)  # storage_device
    if slot.device != device:
        raise RuntimeError(f"colocated weight sync: trainer0's slot is on {slot.device}, this explorer on {device}")
    return slot


class ColocatedSync(WeightSync):
    name = "colocated"

    def __init__(self, ctx, args, timeline, engine=None):
        super().__init__(ctx, args, timeline, engine)
        self.published = StoreValue(ctx.store, "weight_sync/colocated/version", -1)
        self.writing = StoreValue(ctx.store, "weight_sync/colocated/writing", 0)
        self.opened = StoreValue(ctx.store, "weight_sync/colocated/opened", 0)
        self.reading = [StoreValue(ctx.store, f"weight_sync/colocated/reading/{i}", 0)
                        for i in range(len(ctx.explorer_ranks))]
        self.slot: torch.Tensor | None = None
        self.views: dict[str, torch.Tensor] = {}
        self.path: str | None = None  # CPU: the slot's /dev/shm file, removed once every explorer has mapped it
        self.layout: list = []
        self.shared: bytes | None = None  # an explorer: how the slot is opened (`open_slot`)

    @classmethod
    def check(cls, ctx, args):
        ok, why = colocated(ctx)
        if not ok:
            raise SystemExit(f"error: --sync-method colocated needs every explorer on trainer0's device: {why} "
                             "(use --sync-method broadcast)")

    # ------------------------------------------------------------------ trainer 0
    def _allocate(self, named_tensors) -> None:
        device = named_tensors[0][1].device if named_tensors else torch.device("cpu")
        layout, size = flat_layout([(n, tuple(t.shape), t.dtype) for n, t in named_tensors])
        if device.type == "cuda":
            self.slot = torch.empty(size, dtype=torch.uint8, device=device)
        else:
            shm = shared_memory_dir()
            self.path = os.path.join(shm, f"tandem-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            atexit.register(self._unlink)
            self.slot = map_shared_file(self.path, size, create=True)
        self.views = dict(flat_views(self.slot, layout))
        self.ctx.store.set("weight_sync/colocated/slot", _share(self.slot, self.path))
        self.ctx.store.set("weight_sync/colocated/layout", json.dumps(layout))

    def _unlink(self) -> None:
        if self.path is not None:
            remove_shared_file(self.path)
        self.path = None

    @torch.no_grad()
    def _send(self, named_tensors, version, step, wait, check):
        # a sharded trainer's full_tensor gathers are collectives over the trainers: every trainer reaches them
        with self.timeline.phase("sync", step=step, version=version, **check):
            if self.slot is None:
                self._allocate(named_tensors)
            self.writing.value = 1
            try:
                self._wait_for_readers()
                for name, t in named_tensors:
                    self.views[name].copy_(full_tensor(t).detach())
                if self.slot.device.type == "cuda":
                    torch.cuda.synchronize(self.slot.device)  # written before anyone is told
                self.published.value = version
            finally:
                self.writing.value = 0
        if self.path is not None and self.opened.value >= len(self.ctx.explorer_ranks):
            self._unlink()

    def _wait_for_readers(self) -> None:
        start = time.time()
        for i, flag in enumerate(self.reading):
            while flag.value:
                if time.time() - start > self.args.timeout_s:
                    raise TimeoutError(f"trainer0: explorer{i} still copying the colocated weights after "
                                       f"{self.args.timeout_s:.0f}s")
                time.sleep(0.001)

    # ------------------------------------------------------------------ an explorer
    def _attach(self) -> None:
        """Where the slot is; opened here only for an engine that cannot open it itself."""
        self.shared = self.ctx.wait_key("weight_sync/colocated/slot", self.args.timeout_s, "trainer0's weight slot")
        self.layout = json.loads(self.ctx.wait_key("weight_sync/colocated/layout", self.args.timeout_s,
                                                   "trainer0's weight layout"))
        self.path = pickle.loads(self.shared).get("path")
        if Slot not in self.engine.accepts:
            self.slot = open_slot(self.shared, self.ctx.device)
            self.views = dict(flat_views(self.slot, self.layout))

    @torch.no_grad()
    def _take(self, step: int) -> float | None:
        """Copy the published version into the engine if it is newer and not being written; returns when the copy
        started, None when there was nothing to take."""
        if self.published.value <= self.version:
            return None
        if self.shared is None:
            self._attach()
        # An engine that opens the slot itself (vLLM: its worker maps the file or opens the CUDA IPC handle) loads
        # straight from it, within the reading window; others get the weights copied into their buffers, then load
        # those.
        direct = Slot(self.shared, self.layout) if Slot in self.engine.accepts else None
        mine = self.reading[self.ctx.index]
        mine.value = 1
        try:
            if self.writing.value:
                return None
            start, version = time.time(), self.published.value
            if direct is not None:
                self.engine.load_weights(direct, version)
            else:
                buffers = self.engine.weight_buffers()
                for name, t in buffers:
                    src = self.views.get(name)
                    if src is None:
                        raise KeyError(f"colocated weight sync: trainer0 sends no {name}")
                    t.copy_(src)
                if self.slot.device.type == "cuda":
                    torch.cuda.synchronize(self.slot.device)  # the copy has finished reading the slot
        finally:
            mine.value = 0
        if direct is None:
            self.engine.load_weights(Buffers(), version)
        if self.version < 0 and self.ctx.store.add("weight_sync/colocated/opened", 1) >= len(self.reading) \
                and self.path is not None:
            remove_shared_file(self.path)  # every explorer (and vLLM worker) has the file mapped: its name can go
        self.version = version
        self.timeline.record("sync", start, time.time(), step=step, version=version, **self._checked())
        return start

    def pull(self, step):
        """Wait until trainer0 has published a version newer than the one held, and take it."""
        start = time.time()
        while (took := self._take(step)) is None:
            if time.time() - start > self.args.timeout_s:
                raise TimeoutError(f"{self.ctx.name}: no weights newer than v{self.version} from trainer0 after "
                                   f"{self.args.timeout_s:.0f}s (trainer stalled?)")
            time.sleep(0.001)
        self.timeline.record("wait", start, took, step=step)
        return self.version

    def poll(self, step):
        return self._take(step) is not None
