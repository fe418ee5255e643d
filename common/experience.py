"""The experience record (DESIGN.md "Data"), its batching into padded tensors, and the bounded queue between them.

Experiences cross process boundaries as plain Python lists (cheap to pickle, no shared-memory file handles); the
trainer turns a list of them into CPU tensors with `collate`.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

import torch


@dataclass
class ImageInputs:
    """A prompt's images as the model's processor made them (common/vlm.py): what the image placeholder tokens in
    the prompt ids stand for. Every sample of a group holds the same object, so a batch carries it once."""
    pixel_values: torch.Tensor     # [patches, channels x patch volume]
    grid_thw: torch.Tensor         # [images, 3]: each image's (time, height, width) in patches
    tokens: int                    # image placeholder tokens in the prompt


@dataclass
class Experience:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]          # behaviour log-prob of each response token (sampling temperature included)
    loss_mask: list[int]           # 1 for model-generated tokens that are trained, 0 for env/tool tokens
    reward: float
    group_id: int                  # samples of one task in one rollout share it
    task_id: str
    policy_version: int            # version of the weights that finished the response (how old it is for training:
                                   # common/trainer/filters.py trained_version, from segment_versions)
    reward_info: dict = field(default_factory=dict)
    finish_reason: str = "stop"    # "stop" or "length" (truncated)
    segment_versions: list[int] = field(default_factory=list)  # weights version of each response token (partial
                                   # rollouts: a response's segments may come from different versions)
    turn_ends: list[int] = field(default_factory=list)     # per assistant turn: the end of its sampled ids in
                                   # response_ids (a single-turn response: one turn)
    turn_rewards: list[float] = field(default_factory=list)  # reward credited at each turn's end (sums to reward)
    images: ImageInputs | None = None  # an image prompt's pixel values (shared by the group), else None


@dataclass
class Batch:
    input_ids: torch.Tensor        # [B, T] prompt + response, right-padded
    attention_mask: torch.Tensor   # [B, T]
    response_mask: torch.Tensor    # [B, T-1] 1 where the *next* token is a trained response token
    old_logprobs: torch.Tensor     # [B, T-1] behaviour log-probs aligned with response_mask (0 elsewhere)
    rewards: torch.Tensor          # [B]
    group_ids: torch.Tensor        # [B]
    versions: torch.Tensor         # [B]
    turn_rewards: torch.Tensor     # [B, T-1] each turn's reward at its last sampled token (turn-level credit)
    turn_ends: torch.Tensor        # [B, T-1] 1 at each turn's last sampled token
    images: list | None = None     # per row its ImageInputs or None (rows of a group share one); None: no images

    def __len__(self):
        return self.input_ids.shape[0]

    def select(self, idx) -> "Batch":
        tensors = {f: getattr(self, f)[idx] for f in self.__dataclass_fields__ if f != "images"}
        images = None if self.images is None else [self.images[i] for i in torch.as_tensor(idx).tolist()]
        return Batch(**tensors, images=images)

    def to(self, device) -> "Batch":  # images stay on the CPU until a forward needs them
        tensors = {f: getattr(self, f).to(device) for f in self.__dataclass_fields__ if f != "images"}
        return Batch(**tensors, images=self.images)


def zero_signal_groups(experiences: list[Experience]) -> set[int]:
    """The group ids whose rewards are all equal: their group advantage is 0, so they carry no policy gradient
    (DAPO's dynamic sampling drops them and samples others)."""
    rewards: dict[int, set] = {}
    for e in experiences:
        rewards.setdefault(e.group_id, set()).add(e.reward)
    return {g for g, values in rewards.items() if len(values) == 1}


def collate(experiences: list[Experience], pad_id: int) -> Batch:
    """Right-pad prompt+response; log-probs and masks are shifted by one to line up with next-token predictions."""
    lengths = [len(e.prompt_ids) + len(e.response_ids) for e in experiences]
    B, T = len(experiences), max(lengths)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, T, dtype=torch.long)
    response_mask = torch.zeros(B, T - 1)
    old_logprobs = torch.zeros(B, T - 1)
    turn_rewards, turn_ends = torch.zeros(B, T - 1), torch.zeros(B, T - 1)
    for i, e in enumerate(experiences):
        p, r = len(e.prompt_ids), len(e.response_ids)
        input_ids[i, : p + r] = torch.tensor(e.prompt_ids + e.response_ids)
        attention_mask[i, : p + r] = 1
        # Position t of the shifted tensors predicts token t+1, so response token j sits at p-1+j.
        response_mask[i, p - 1 : p - 1 + r] = torch.tensor(e.loss_mask, dtype=torch.float)
        old_logprobs[i, p - 1 : p - 1 + r] = torch.tensor(e.logprobs, dtype=torch.float)
        ends = e.turn_ends or [r]
        credit = e.turn_rewards or [0.0] * (len(ends) - 1) + [e.reward]
        for end, reward in zip(ends, credit):
            if end > 0:
                turn_ends[i, p - 2 + end] = 1.0
                turn_rewards[i, p - 2 + end] = reward
    return Batch(
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask, old_logprobs=old_logprobs,
        rewards=torch.tensor([e.reward for e in experiences], dtype=torch.float),
        group_ids=torch.tensor([e.group_id for e in experiences]),
        versions=torch.tensor([e.policy_version for e in experiences]),
        turn_rewards=turn_rewards, turn_ends=turn_ends,
        images=[e.images for e in experiences] if any(e.images is not None for e in experiences) else None,
    )


def too_stale(made: int, version: int, max_staleness: int) -> bool:
    """The staleness rule, stated once: what weights `made` made is too old to train at trainer version `version`
    when it is more than --max-staleness versions behind. The trainer drops such samples (common/trainer/filters.py
    `drop_stale`); a streaming explorer starts no group that would be (common/tasks/stream.py `StreamPositions`)."""
    return version - made > max_staleness


@dataclass
class RolloutBatch:
    """What an explorer puts on the queue: one batch of experiences plus the metrics of the rollout that made them
    (times, tokens/s, failed verifiers). Evaluations and the end of the run go on the control channel
    (common/runtime/control.py), never here."""
    step: int
    experiences: list[Experience]
    metrics: dict
    explorer: int = 0
    positions: list[int] = field(default_factory=list)  # task stream positions used (train_async.py's resume)


class ExperienceQueue:
    """Bounded buffer of rollout batches between explorer(s) and trainer rank 0, on any nodes (the run's mailbox:
    common/runtime/channel.py).

    Bounded so a fast explorer blocks (backpressure) instead of growing memory. Every wait has a timeout and
    fails with a message saying who waited for what.
    """

    def __init__(self, mailbox, stop_requested=None):
        self.mailbox = mailbox
        self.stop_requested = stop_requested  # trainer: a SIGTERM / Ctrl-C ends a wait for experiences

    def put(self, item, timeout: float, who: str = "explorer"):
        self.mailbox.put_batch(item, timeout, who)

    def get(self, timeout: float, who: str = "trainer", on_stall=None, stall_every: float = 60.0):
        """The next item. While none arrives, `on_stall(seconds_waited)` is called every `stall_every` seconds
        (the trainer logs whom it waits for); after `timeout` seconds in all, TimeoutError."""
        start, next_stall = time.time(), stall_every
        while True:
            if self.stop_requested is not None and self.stop_requested.is_set():
                raise KeyboardInterrupt
            waited = time.time() - start
            if waited >= timeout:
                raise TimeoutError(f"{who}: no experiences arrived for {timeout:.0f}s (explorer stalled?)")
            try:
                return self.mailbox.get_batch(timeout=max(0.01, min(0.5, timeout - waited, next_stall - waited)))
            except queue.Empty:
                if on_stall is not None and time.time() - start >= next_stall:
                    on_stall(time.time() - start)
                    next_stall += stall_every
