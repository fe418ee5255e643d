"""Logged completions (--log-samples-every, --log-samples): what the policy actually wrote, next to its reward.

Rows go to out_dir/samples.jsonl (one JSON object per sample) and, with --track, to a W&B table `samples`. The
text is decoded for people to read only; the trainer trains on the token ids it was given (token-in/token-out).
"""

from __future__ import annotations

import json
import os

from common.experience import Experience

COLUMNS = ["step", "version", "task_id", "prompt", "response", "reward", "finish_reason"]


def samples_due(step: int, every: int) -> bool:
    """Step 1 and every `every` trainer steps after it (never with 0)."""
    return bool(every) and (step - 1) % every == 0


def mask_spans(mask: list[int]) -> list[list[int]]:
    """[start, end) runs of response tokens with loss mask 1 (what was trained)."""
    spans, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append([start, i])
            start = None
    return spans


def turn_texts(e: Experience, tokenizer) -> list[str]:
    """Each turn's text: its sampled tokens and the observation before it (everything since the last turn)."""
    starts = [0] + list(e.turn_ends[:-1])
    return [tokenizer.decode(e.response_ids[a:b], skip_special_tokens=True) for a, b in zip(starts, e.turn_ends)]


def sample_rows(experiences: list[Experience], tokenizer, step: int, n: int) -> list[dict]:
    """The first `n` samples of a trainer step's batch as readable rows (the version is the weights' that wrote
    the response; step is the trainer step that trained on it). Episodes add per-turn text, the loss-mask spans,
    per-turn rewards and the end reason."""
    rows = []
    for e in experiences[:n]:
        row = {"step": step, "version": e.policy_version, "task_id": e.task_id,
               "prompt": tokenizer.decode(e.prompt_ids, skip_special_tokens=True),
               "response": tokenizer.decode(e.response_ids, skip_special_tokens=True),
               "reward": e.reward, "finish_reason": e.finish_reason}
        if "end_reason" in e.reward_info:  # an episode
            row.update({"turns": turn_texts(e, tokenizer), "loss_mask_spans": mask_spans(e.loss_mask),
                        "turn_rewards": list(e.turn_rewards), "env_turn_rewards": e.reward_info.get("turn_rewards"),
                        "end_reason": e.reward_info["end_reason"]})
        if e.reward_info.get("error"):  # a failed sample says why
            row["error"] = e.reward_info["error"]
        rows.append(row)
    return rows


class SamplesLog:
    """Appends rows to samples.jsonl; with a W&B run, logs the table of every row so far under `samples`."""

    def __init__(self, out_dir: str, wandb_run=None):
        self.path = os.path.join(out_dir, "samples.jsonl")
        self.wandb_run = wandb_run
        self.rows: list[list] = []

    def log(self, rows: list[dict]):
        if not rows:
            return
        with open(self.path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            import wandb

            self.rows += [[row[c] for c in COLUMNS] for row in rows]
            self.wandb_run.log({"samples": wandb.Table(columns=COLUMNS, data=self.rows)}, step=rows[0]["step"])
