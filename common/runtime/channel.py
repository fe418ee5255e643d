"""Explorers -> trainer rank 0 across processes and nodes: the bounded experience buffer and the control channel.

Transport (nothing of our own on sockets): payloads are pickled into uint8 tensors and sent point-to-point over
gloo on the world's buffer group; admission and the run's flags go through the c10d store the elastic agent hosts.
The same path serves one node and many: on one node gloo runs over loopback TCP at about half a multiprocessing
queue's throughput (~100 MB/s of rollout batches here, bench/multinode.py), far more than explorers produce, so
there is no second, shared-memory path to keep true.

Bounded with backpressure, as a queue of `capacity` items: a batch may be sent only with a ticket, and tickets are
granted in order, `capacity` ahead of what the trainer has taken. An explorer with no grant blocks (its put times
out in slices, so an asynchronous explorer can take weights meanwhile); memory holds at most `capacity` batches at
the trainer. Each explorer sends one message at a time, so its messages arrive in order. Control messages
(evaluations, the end of the run) need no ticket: they are few and small, and must pass a full buffer.

Trainer rank 0 runs one receiving thread: a header (kind, size) from any explorer, then that explorer's payload.
A dead peer never leaves a wait hanging: the launcher's watchdog ends the process within --peer-timeout-s.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time

import torch
import torch.distributed as dist

BATCH, CONTROL, DONE = 0, 1, 2
HEADER_TAG, PAYLOAD_TAG = 11, 12


def poll_key(store, key: str, timeout: float, every: float = 0.01) -> bool:
    """Whether `key` appears in the store within `timeout` s (polled: the store's own timed wait logs a warning
    per timeout, and the explorers' waits time out by design)."""
    deadline = time.time() + timeout
    while not store.check([key]):
        if time.time() >= deadline:
            return False
        time.sleep(every)
    return True


class StoreFlag:
    """A run-wide event in the store (replaces multiprocessing.Event across nodes)."""

    def __init__(self, store, key: str):
        self.store, self.key = store, key

    def set(self) -> None:
        self.store.set(self.key, "1")

    def is_set(self) -> bool:
        return self.store.check([self.key])


class StoreValue:
    """A run-wide integer in the store (replaces multiprocessing.Value across nodes); starts at `initial`."""

    def __init__(self, store, key: str, initial: int):
        self.store, self.key, self.initial = store, key, initial

    @property
    def value(self) -> int:
        return self.initial + self.store.add(self.key, 0)

    @value.setter
    def value(self, v: int) -> None:
        self.store.set(self.key, str(v - self.initial))


class Mailbox:
    """One per rank. Explorers: `put_batch`, `send_control`, `close`. Trainer rank 0: `get_batch`,
    `get_control` (timeout 0: without waiting), `close`. Other trainers hold one and never use it."""

    def __init__(self, ctx, capacity: int, name: str = "buffer"):
        self.ctx, self.capacity = ctx, capacity
        self.store = dist.PrefixStore(name, ctx.store)
        self.dst = ctx.trainer_ranks[0]
        self._ticket: int | None = None  # explorer: holds a ticket, waiting for its grant
        self.batches: queue.Queue = queue.Queue()
        self.controls: queue.Queue = queue.Queue()
        self._taken = 0
        self._error: BaseException | None = None
        self._thread = None
        if ctx.rank == self.dst:
            for ticket in range(1, capacity + 1):
                self.store.set(f"grant/{ticket}", "")
            self._thread = threading.Thread(target=self._receive, name="tandem-buffer", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ explorer side
    def put_batch(self, item, timeout: float, who: str) -> None:
        """Send `item` once the buffer has room; TimeoutError after `timeout` s with no room (the ticket is kept:
        the next put goes first)."""
        if self._ticket is None:
            self._ticket = self.store.add("tickets", 1)
        if not poll_key(self.store, f"grant/{self._ticket}", timeout):
            raise TimeoutError(f"{who}: the experience buffer at {self.ctx.names[self.dst]} stayed full for "
                               f"{timeout:.0f}s (trainer stalled?)")
        self._ticket = None
        self._send(BATCH, item)

    def send_control(self, item) -> None:
        self._send(CONTROL, item)

    def _send(self, kind: int, item) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(item)), dtype=torch.uint8)
        dist.send(torch.tensor([kind, payload.numel()]), self.dst, group=self.ctx.buffer_group, tag=HEADER_TAG)
        dist.send(payload, self.dst, group=self.ctx.buffer_group, tag=PAYLOAD_TAG)

    # ------------------------------------------------------------------ trainer rank 0
    def _receive(self):
        open_ = set(self.ctx.explorer_ranks)
        header = torch.zeros(2, dtype=torch.long)
        try:
            while open_:
                src = dist.recv(header, group=self.ctx.buffer_group, tag=HEADER_TAG)
                kind, size = header.tolist()
                if kind == DONE:
                    open_.discard(src)
                    continue
                payload = torch.empty(size, dtype=torch.uint8)
                dist.recv(payload, src, group=self.ctx.buffer_group, tag=PAYLOAD_TAG)
                item = pickle.loads(payload.numpy().tobytes())
                (self.batches if kind == BATCH else self.controls).put(item)
        except BaseException as e:  # handed to the trainer's thread by the next get
            self._error = e

    def _check(self):
        if self._error is not None:
            raise RuntimeError(f"{self.ctx.name}: receiving from the explorers failed") from self._error

    def _get(self, received: queue.Queue, timeout: float):
        """The next item of `received` (queue.Empty after `timeout`); the receiving thread's failure is raised."""
        deadline = time.time() + timeout
        while True:
            self._check()
            try:
                return received.get(timeout=max(0.0, min(0.5, deadline - time.time())))
            except queue.Empty:
                if time.time() >= deadline:
                    raise

    def get_batch(self, timeout: float):
        """The next batch (queue.Empty after `timeout`); taking it grants the next ticket."""
        item = self._get(self.batches, timeout)
        self._taken += 1
        self.store.set(f"grant/{self._taken + self.capacity}", "")
        return item

    def get_control(self, timeout: float):
        return self._get(self.controls, timeout)

    def close(self, timeout: float) -> None:
        """Explorer: no more messages. Trainer rank 0: wait until every explorer has said so (what they sent
        after the trainer's last step is dropped)."""
        if self.ctx.role == "explorer":
            dist.send(torch.tensor([DONE, 0]), self.dst, group=self.ctx.buffer_group, tag=HEADER_TAG)
        elif self._thread is not None:
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"{self.ctx.name}: the explorers did not close the experience buffer within "
                                   f"{timeout:.0f}s")
            self._check()
