"""Math verifier: the final answer from the last `\\boxed{}` or `Answer:` line, checked with math-verify.

math-verify's own timeouts use SIGALRM, which works only on a main thread; they are switched off here and the
time limit is enforced by `rewards.RewardPool`, which runs verifiers in child processes it can kill.
"""

from __future__ import annotations

import re
from decimal import Decimal

from rewards.base import Reward

PLAIN_NUMBER = re.compile(r"^[-+]?\d+(?:\.\d+)?$")
ANSWER_LINE = re.compile(r"answer\s*[:：]\s*(.+)", re.IGNORECASE)


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (balanced braces), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1: j].strip()
    return None


def extract_answer(response: str) -> str | None:
    """The final answer a response commits to: last \\boxed{} wins, else the last 'Answer:' line."""
    boxed = last_boxed(response)
    if boxed:
        return boxed
    matches = ANSWER_LINE.findall(response)
    if matches:
        # Markdown emphasis, a closing period and $...$ are decoration, not part of the answer.
        answer = matches[-1].strip().strip("*`").strip().rstrip(".").strip()
        return answer.strip("$").strip().strip("*`").strip() or None
    return None


def format_score(response: str) -> float:
    """1 when the response ends in a parseable final answer in the expected format."""
    return 1.0 if extract_answer(response) is not None else 0.0


def is_equivalent(pred: str, gold: str) -> bool:
    if PLAIN_NUMBER.match(pred) and PLAIN_NUMBER.match(gold):
        # Fast path for the common case (arithmetic tasks): exact decimal comparison, ~100x cheaper than parsing.
        return Decimal(pred) == Decimal(gold)
    from math_verify import parse, verify

    def parsed(text: str):
        # Wrapping in $...$ lets the LaTeX extractor see bare answers like 1/2, 50%, (1, 2].
        return parse(f"${text}$", parsing_timeout=None) or parse(text, parsing_timeout=None)

    gold_p, pred_p = parsed(gold), parsed(pred)
    if not gold_p or not pred_p:
        return pred.strip() == gold.strip()
    return bool(verify(gold_p, pred_p, timeout_seconds=None))


def score(response: str, task: dict):
    pred = extract_answer(response)
    if pred is None:
        return Reward(0.0, {"reason": "no answer", "format_ok": False})
    ok = is_equivalent(pred, str(task["answer"]))
    return Reward(1.0 if ok else 0.0, {"reason": "correct" if ok else "wrong", "pred": pred, "format_ok": True})
