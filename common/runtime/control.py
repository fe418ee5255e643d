"""The control channel: what explorers tell the trainer besides experiences (held-out evaluation results, and the
final evaluation that closes a run), apart from the experience buffer (common/experience.py), which carries rollout
batches only, so the trainer never has to carry or drain control messages between them.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass


@dataclass
class Control:
    kind: str          # "eval": a held-out evaluation during the run; "final": the last one, after training
    explorer: int
    metrics: dict      # eval/accuracy, eval/version


class ControlChannel:
    """Control messages from explorers to trainer rank 0 over the run's mailbox (common/runtime/channel.py): few
    and small, never blocked by a full experience buffer."""

    def __init__(self, mailbox):
        self.mailbox = mailbox
        self._final: Control | None = None  # a final message that arrived while polling for evaluations

    def send(self, kind: str, metrics: dict, explorer: int = 0) -> None:
        self.mailbox.send_control(Control(kind, explorer, metrics))

    def poll(self) -> list[Control]:
        """The evaluations that have arrived, without waiting (a final message is kept for `wait_final`)."""
        out = []
        while True:
            try:
                msg = self.mailbox.get_control(timeout=0)
            except queue.Empty:
                return out
            if msg.kind == "final":
                self._final = msg
            else:
                out.append(msg)

    def wait_final(self, timeout: float) -> tuple[dict, list[Control]]:
        """Block until the final evaluation arrives: (its metrics, the other messages that came meanwhile)."""
        deadline, others = time.time() + timeout, []
        if self._final is not None:  # it came while the trainer was polling for evaluations
            return self._final.metrics, others
        while True:
            try:
                msg = self.mailbox.get_control(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                raise TimeoutError(f"trainer: no final evaluation from explorer0 for {timeout:.0f}s "
                                   "(explorer stalled?)") from None
            if msg.kind == "final":
                return msg.metrics, others
            others.append(msg)
