"""Parity verifier: the share of a response's characters whose code point has the parity the task asks for.

The smoke-test reward (`--taskset parity`): it scores a property of the sampled tokens, not of their meaning, so even
the random `--model tiny` earns mixed, continuous rewards (about half its characters match; two samples rarely tie)
and every group carries a learning signal. A model learns it by shifting probability to matching bytes.
"""

from __future__ import annotations

from rewards.base import Reward


def score(response: str, task: dict) -> Reward:
    want = {"even": 0, "odd": 1}[task["parity"]]
    if not response:
        return Reward(0.0, {"reason": "empty response"})
    hits = sum(ord(c) % 2 == want for c in response)
    return Reward(hits / len(response), {"reason": f"{hits}/{len(response)} characters {task['parity']}"})
