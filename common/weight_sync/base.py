"""What every weight-sync method shares: the `WeightSync` interface (trainer rank 0 sends, explorers receive), the
version handshake of the asynchronous schedule's end, whole tensors from sharded trainers, the weights hash.

A method subclasses `WeightSync` and writes `_send` (trainer rank 0) and `pull` / `poll` (an explorer); the rest
(data-parallel trainers joining the gathers of sharded weights, `--verify-sync` hashes, the final handshake) is
here. Sender and receiver exchange HF `named_parameters()` order and shapes; the receiver hands the engine one
weight source (`Buffers`, `Slot`, `Folder`) through its `load_weights`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from common.runtime.channel import StoreValue


# ----------------------------------------------------------------------------- where an engine takes new weights from
# Each sync method picks one; an engine lists those it takes in `RolloutEngine.accepts`.
@dataclass(frozen=True)
class Buffers:
    """The engine's own `weight_buffers()`, just written by the sync method."""


@dataclass(frozen=True)
class Slot:
    """A flat buffer another process laid out (`common.buckets.flat_layout`, HF names: the colocated sync's slot),
    which the engine opens itself where it computes (vLLM: in its worker): `shared` says how
    (common/weight_sync/colocated.py `open_slot`: a /dev/shm file on the CPU, a CUDA IPC handle on a GPU); no copy
    through the explorer's process."""
    shared: bytes
    layout: list


@dataclass(frozen=True)
class Folder:
    """A safetensors folder: a sync checkpoint `vN/` or an HF save_pretrained folder."""
    path: str


WeightSource = Buffers | Slot | Folder


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor shard is all-gathered (every rank of its mesh must call this in the same order);
    a plain tensor is returned as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def has_dtensors(named_tensors) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for _, t in named_tensors)


def join_gathers(named_tensors, passes: int = 1) -> None:
    """A trainer other than 0 takes part in trainer 0's `passes` gathers of sharded weights (results dropped)."""
    from torch.distributed.tensor import DTensor

    for _ in range(passes):
        for _, t in named_tensors:
            if isinstance(t, DTensor):
                t.full_tensor()


def tensor_digest(named_tensors) -> tuple[str, dict[str, str]]:
    """(sha256 over names and raw bytes in order, per-name sha256 of the bytes): equal iff bit-identical."""
    total, per_name = hashlib.sha256(), {}
    for name, t in named_tensors:
        data = full_tensor(t).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        total.update(name.encode())
        total.update(data)
        per_name[name] = hashlib.sha256(data).hexdigest()
    return total.hexdigest(), per_name


def weights_hash(named_tensors) -> str:
    """sha256 over names and raw bytes: equal iff the weights are bit-identical."""
    return tensor_digest(named_tensors)[0]


class WeightSync:
    """One weight-sync method, both sides. Trainer rank 0: `push` each version, `finish` at the end of an
    asynchronous run. An explorer: `pull` (block for the next version), `poll` (take a newer one if there is one,
    between generation batches or decode steps), `take_final`. `version` is the version the explorer's engine holds.

    Subclasses set `name` and write `_send`, `pull` and `poll`; `check` (start-up, every rank, before any model
    loads) and `wait` (in-flight sends done) where they need them.
    """

    name = ""

    def __init__(self, ctx, args, timeline, engine=None):
        self.ctx, self.args, self.timeline, self.engine = ctx, args, timeline, engine
        self.version = -1  # explorer: the version its engine holds
        self.sent = -1     # trainer rank 0: the last version pushed
        self.final = StoreValue(ctx.store, "weight_sync/final", -1)  # the version an asynchronous run ends with

    @classmethod
    def check(cls, ctx, args) -> None:
        """Start-up checks on every rank, before any model loads (one-line errors)."""

    # ------------------------------------------------------------------ trainer side
    def push(self, named_tensors, version: int, step: int, wait: bool = True) -> None:
        """Send `version`. wait=False: the method may return before explorers hold it (in flight) and explorers
        take it between generation batches; every method returns with the weights safe from later optimizer steps."""
        if self.ctx.index != 0:  # data-parallel trainers other than rank 0 are not in the sync group, but trainer 0
            join_gathers(named_tensors, 1 + bool(self.args.verify_sync))  # gathers from their shards: hash, send
            self.sent = version
            return
        self.wait()  # one send at a time: the previous in-flight one finishes first
        check = {"hash": weights_hash(named_tensors)} if self.args.verify_sync else {}
        self._send(named_tensors, version, step, wait, check)
        self.sent = version

    def _send(self, named_tensors, version: int, step: int, wait: bool, check: dict) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        """Block until in-flight sends are complete (a no-op for methods without any)."""

    def finish(self, named_tensors, version: int, step: int, stop) -> None:
        """The end of an asynchronous run: announce the final version, set `stop` (explorers stop generating and
        take every version up to it), complete in-flight sends, send the final version if it was not sent yet."""
        if self.ctx.index == 0:
            self.final.value = version
        stop.set()
        if self.ctx.index == 0:
            self.wait()
        if self.sent != version:
            self.push(named_tensors, version, step)

    # ------------------------------------------------------------------ explorer side
    def pull(self, step: int) -> int:
        """Block until the trainer's next version is in the engine; returns it."""
        raise NotImplementedError

    def poll(self, step: int) -> bool:
        """Take a newer version if the trainer has sent one (never blocks for long); True when it did."""
        raise NotImplementedError

    def take_final(self, step: int) -> int:
        """After `stop`: take every version up to the trainer's final one (`finish`). Up to, not each: a method with
        one slot (colocated, checkpoint) hands over the newest, so versions may be skipped."""
        while self.version < self.final.value:
            self.pull(step)
        return self.version

    def _checked(self) -> dict:
        """--verify-sync: the hash of what the engine computes with (vLLM: read back from its worker)."""
        return {"hash": self.engine.weights_checksum()} if self.args.verify_sync else {}
