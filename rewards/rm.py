"""Learned reward model: an `AutoModelForSequenceClassification` scoring (prompt, response) pairs.

- `score(response, task)`: in this process (the model is loaded once per process and cached), mainly for tests and
  one-off use. `task["rm_model"]` names the model folder.
- `RMServer` / `RMClient`: the model served by its own (spawned) process on its own device, fed batches of
  eval requests over a pipe; `rewards.RewardPool` routes every `reward: rm` task there, so rollouts and RM
  forward passes overlap and the policy's device never holds the RM. Scores come back one per response, in order.

The raw head output is mapped to [0, 1]: sigmoid of the single logit, or the probability of the last class when
the head has several labels.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections import deque

from rewards.base import Reward, failed

MAX_REQUEST = 256  # items per request to the server; it splits them into batches of `batch_size`


def rm_text(tokenizer, task: dict, response: str) -> str:
    """The text the RM reads: the chat (prompt + response) in the RM's chat template when it has one."""
    messages = task.get("messages") or ([{"role": "user", "content": task["prompt"]}] if task.get("prompt") else [])
    if getattr(tokenizer, "chat_template", None) and messages:
        return tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": response}], tokenize=False)
    prompt = "\n".join(m["content"] for m in messages)
    return f"{prompt}\n{response}" if prompt else response


@functools.lru_cache(maxsize=2)  # `score` in a reward worker: loaded once per model and device
def load(model_path: str, device: str = "cpu"):
    """(tokenizer, model) in eval mode on `device`; the pad token is set so batches can be padded."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer, model


def score_texts(tokenizer, model, texts: list[str], batch_size: int = 16, max_length: int = 2048) -> list[float]:
    """One score in [0, 1] per text, in order."""
    import torch

    scores: list[float] = []
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(texts[start: start + batch_size], return_tensors="pt", padding=True, truncation=True,
                            max_length=max_length).to(model.device)
            logits = model(**enc).logits.float()
            if logits.shape[-1] == 1:
                probs = torch.sigmoid(logits[:, 0])
            else:
                probs = torch.softmax(logits, dim=-1)[:, -1]
            scores.extend(probs.tolist())
    return scores


def score(response: str, task: dict):
    model_path = task.get("rm_model")
    if not model_path:
        raise ValueError(f"task {task.get('id')}: reward 'rm' needs task['rm_model'] (or a RewardPool rm_model)")
    tokenizer, model = load(model_path, task.get("rm_device", "cpu"))
    value = score_texts(tokenizer, model, [rm_text(tokenizer, task, response)])[0]
    return Reward(value, {"reason": "reward model", "rm": value})


def _serve(conn, model_path: str, device: str, batch_size: int, parent_pid: int):
    """RM server process: load once, say ready, then answer [(task, response), ...] with ("scores", [...])."""
    from common.runtime.procs import die_with_parent

    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        tokenizer, model = load(model_path, device)
    except Exception as e:  # noqa: BLE001  (a bad path or device: the client fails the items with this reason)
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send("ready")
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        try:
            texts = [rm_text(tokenizer, task, response) for task, response in request]
            conn.send(("scores", score_texts(tokenizer, model, texts, batch_size)))
        except Exception as e:  # noqa: BLE001  (e.g. out of memory: fail that request, keep serving)
            conn.send(("error", f"{type(e).__name__}: {e}"))


class RMClient:
    """The dispatcher-side handle of one RM server process (used by `rewards.RewardPool`, on its thread).

    Items are queued with `add`; whenever the server is idle everything queued (up to MAX_REQUEST) goes out as one
    request. A request has `timeout_s` (loading has its own `load_timeout_s`); a server that dies or times out fails
    its items with the reason and is restarted for the next ones.
    """

    def __init__(self, ctx, model_path: str, device: str, batch_size: int, timeout_s: float,
                 on_start=None, on_stop=None, load_timeout_s: float = 600.0):
        self.ctx, self.model_path, self.device, self.batch_size = ctx, model_path, device, batch_size
        self.timeout_s, self.load_timeout_s = timeout_s, load_timeout_s
        self.on_start, self.on_stop = on_start or (lambda p: None), on_stop or (lambda p: None)
        self.waiting: deque = deque()  # (future, index, response, task)
        self.in_flight: list = []  # (future, index)
        self.proc = self.conn = None
        self.ready = False
        self.deadline = 0.0
        self.stats = {"requests": 0, "items": 0, "restarts": 0}

    @property
    def busy(self) -> bool:
        return self.conn is not None and (not self.ready or bool(self.in_flight))

    def _start(self):
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_serve, name="reward-model",
                                     args=(child, self.model_path, self.device, self.batch_size, os.getpid()))
        self.proc.start()
        child.close()
        self.on_start(self.proc)
        self.conn, self.ready, self.deadline = parent, False, time.time() + self.load_timeout_s

    def _stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(timeout=5)
            self.on_stop(self.proc)
            self.conn.close()
        self.proc = self.conn = None
        self.ready = False

    def add(self, future, index: int, response: str, task: dict, finish=None):
        if self.model_path.startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(self.model_path)):
            # A local path that is not there: say so at once instead of starting a process to find out.
            self._fail([(future, index)], f"error: reward model {self.model_path}: no such folder", finish)
            return
        self.waiting.append((future, index, response, task))
        if self.conn is None:
            self._start()
        self._send()

    def _send(self):
        if not self.ready or self.in_flight or not self.waiting:
            return
        batch = [self.waiting.popleft() for _ in range(min(MAX_REQUEST, len(self.waiting)))]
        self.in_flight = [(f, i) for f, i, _, _ in batch]
        self.deadline = time.time() + self.timeout_s
        self.stats["requests"] += 1
        self.stats["items"] += len(batch)
        self.conn.send([(task, response) for _, _, response, task in batch])

    def _fail(self, items, reason: str, finish):
        for future, index, *_ in items:
            finish(future, index, failed(reason))

    def receive(self, finish):
        """Handle one message from the server (called when its pipe is readable)."""
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            code = self.proc.exitcode
            self._fail(self.in_flight, f"reward model process died (exit code {code})", finish)
            self.in_flight = []
            self.stats["restarts"] += 1
            self._stop()
            if self.waiting:
                self._start()
            return
        if msg == "ready":
            self.ready = True
        elif msg[0] == "scores":
            for (future, index), value in zip(self.in_flight, msg[1]):
                finish(future, index, Reward(float(value), {"reason": "reward model", "rm": float(value)}))
            self.in_flight = []
        elif msg[0] == "error":
            if not self.ready:  # could not load: everything queued fails with that reason
                self._fail(self.waiting, f"error: reward model {self.model_path}: {msg[1]}", finish)
                self.waiting.clear()
                self._stop()
                return
            self._fail(self.in_flight, f"error: reward model: {msg[1]}", finish)
            self.in_flight = []
        self._send()

    def poll(self, finish):
        """Enforce the deadline of the request (or load) in flight."""
        if self.busy and time.time() >= self.deadline:
            what = "loading" if not self.ready else "scoring"
            self._fail(self.in_flight, f"timeout: reward model {what} took over "
                       f"{self.timeout_s if self.ready else self.load_timeout_s:g}s", finish)
            if not self.ready:
                self._fail(self.waiting, "timeout: reward model did not load", finish)
                self.waiting.clear()
            self.in_flight = []
            self.stats["restarts"] += 1
            self._stop()
            if self.waiting:
                self._start()

    def futures(self):
        return [f for f, *_ in self.waiting] + [f for f, _ in self.in_flight]

    def close(self):
        self._stop()
