"""Math verifier: the final answer from the last `\\boxed{}` or `Answer:` line, checked with math-verify.

math-verify's own timeouts use SIGALRM, which works only on a main thread; they are switched off here and the
time limit is enforced by `rewards.RewardPool`, which runs verifiers in child processes it can kill.

How numbers compare (the policy picks its answer to be judged equal, so a tolerance must not be loose in any
direction it can reach):
- Both sides exact (integers, fractions, radicals, pi, ...): exact, structurally or by simplifying the difference
  to zero. `10^{-20}` is not `-10^{-20}` (math-verify's own numeric check evaluates the difference with `chop=True`,
  which rounds tiny values to 0).
- Either side a decimal: equal iff |a - b| <= REL_TOL * max(|a|, |b|), i.e. a decimal correct to 6 significant
  digits. A relative tolerance cannot make values of different sign, or of different orders of magnitude, equal;
  0 equals only 0. (math-verify rounds both to 6 decimal places, which makes every pair of tiny values equal.)
- Percent: "%" is a unit, not a factor of 1/100: "37%" equals "37" and "37\\%", and does not equal "0.37". One
  reading, so that a reply cannot cover two golds of different magnitude at once; this is the K-12 verifier's
  reading too, and the usual convention of datasets whose "what percent" golds omit the sign.
Both rules replace math-verify's numeric comparison everywhere it is used (inside sets, intervals, tuples, equations
and matrices too); its symbolic comparison (simplify(a - b) == 0) stays.
"""

from __future__ import annotations

import functools
import re
from decimal import Decimal

from rewards.base import Reward

REL_TOL = 5e-6  # a decimal rounded to 6 significant digits is within this of the exact value
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


def _is_percent(expr) -> bool:
    """latex2sympy's form of "X%": Mul(X, UnevaluatedExpr(1/100))."""
    from sympy import Mul, Rational, UnevaluatedExpr

    return isinstance(expr, Mul) and len(expr.args) == 2 and expr.args[1] == UnevaluatedExpr(Rational(1, 100))


def _drop_percent(expr):
    """"X%" -> X everywhere in a parsed answer (the percent sign is a unit, see the module docstring)."""
    from sympy import Basic

    if not isinstance(expr, Basic):
        return expr
    try:
        return expr.replace(_is_percent, lambda e: e.args[0])
    except (TypeError, ValueError, AttributeError):
        return expr


def numeric_eq(a, b, float_rounding=None, numeric_precision=None) -> bool:
    """Numeric equality of two parsed values (see the module docstring); installed as math-verify's
    `sympy_numeric_eq` (same signature; its rounding arguments are ignored)."""
    from math_verify.grader import safe_sympy_doit
    from sympy import Basic, Float, MatrixBase
    from sympy.matrices.expressions import MatrixExpr

    if isinstance(a, (MatrixBase, MatrixExpr)) and isinstance(b, (MatrixBase, MatrixExpr)):
        a, b = safe_sympy_doit(a), safe_sympy_doit(b)
        if isinstance(a, MatrixBase) and isinstance(b, MatrixBase) and a.shape == b.shape:
            return all(numeric_eq(x, y) for x, y in zip(a.flat(), b.flat()))
        return False
    if not (isinstance(a, Basic) and isinstance(b, Basic)) or a.free_symbols or b.free_symbols:
        return False  # symbolic: math-verify's simplify(a - b) == 0 decides
    a, b = safe_sympy_doit(a), safe_sympy_doit(b)
    if not (a.has(Float) or b.has(Float)):
        return bool(a == b)  # both exact: no tolerance (simplify(a - b) == 0 is tried after this)
    try:
        x, y = complex(a.evalf(30)), complex(b.evalf(30))
    except (TypeError, ValueError, OverflowError):
        return False  # not a finite number (zoo, nan, an unevaluated function)
    return abs(x - y) <= REL_TOL * max(abs(x), abs(y))


@functools.cache
def _math_verify():
    """math-verify with `numeric_eq` in place of its own numeric comparison (it is looked up by name at every
    comparison, including those inside sets, intervals and equations)."""
    import math_verify
    from math_verify import grader

    grader.sympy_numeric_eq = numeric_eq
    return math_verify


def is_equivalent(pred: str, gold: str) -> bool:
    if PLAIN_NUMBER.match(pred) and PLAIN_NUMBER.match(gold):
        # Fast path for the common case (arithmetic tasks): exact decimal comparison, ~100x cheaper than parsing.
        return Decimal(pred) == Decimal(gold)
    mv = _math_verify()

    def parsed(text: str):
        # Wrapping in $...$ lets the LaTeX extractor see bare answers like 1/2, 50%, (1, 2].
        found = mv.parse(f"${text}$", parsing_timeout=None) or mv.parse(text, parsing_timeout=None)
        return [_drop_percent(x) for x in found]

    gold_p, pred_p = parsed(gold), parsed(pred)
    if not gold_p or not pred_p:
        return pred.strip() == gold.strip()
    return bool(mv.verify(gold_p, pred_p, timeout_seconds=None))


def answer_key(pred: str) -> str:
    """The answer in a normal form, for majority votes (common/explorer/eval_metrics.py): a plain number as its
    shortest decimal (7.50 and 7.5 vote together), anything else without its whitespace."""
    if PLAIN_NUMBER.match(pred):
        number = Decimal(pred).normalize()
        return "0" if number == 0 else format(number, "f")
    return "".join(pred.split())


def score(response: str, task: dict):
    pred = extract_answer(response)
    if pred is None:
        return Reward(0.0, {"reason": "no answer", "format_ok": False})
    ok = is_equivalent(pred, str(task["answer"]))
    return Reward(1.0 if ok else 0.0, {"reason": "correct" if ok else "wrong", "pred": pred,
                                       "answer_key": answer_key(pred), "format_ok": True})
