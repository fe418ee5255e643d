"""K-12 verifier: multiple choice, true/false, short answers (text, or numbers with units and a tolerance), with an
optional generative judge.

Task fields:
- `answer`: the reference. A letter ("B"), several letters for multi-select ("AC"), an option's text, a bool,
  a number with or without a unit ("12 cm"), a text, or a list of acceptable texts.
- `choices` (optional): option texts, a list (lettered A, B, ...) or a dict {"A": text, ...}. Makes it multiple choice.
- `type` (optional): "choice" | "true_false" | "number" | "short"; inferred from the fields when absent.
- `tolerance` (optional, numbers): relative tolerance, default 1e-4 (and `abs_tol`, default 1e-9).
- `judge_model` (optional): a local causal LM folder; when the rules say "wrong" for a short answer, the model is
  asked whether the response matches the reference ("yes"/"no", compared by log-likelihood). `judge: "always"`
  asks it for every short answer, `judge: "never"` never.
The response's answer is its last \\boxed{} or `Answer:` line (as in math), else its last non-empty line.
"""

from __future__ import annotations

import functools
import math
import re
import string
import unicodedata

from rewards.base import Reward
from rewards.math import extract_answer

LETTERS = string.ascii_uppercase
TRUE_WORDS = {"true", "t", "yes", "y", "correct", "right", "对", "正确", "是", "√", "✓", "✔"}
FALSE_WORDS = {"false", "f", "no", "n", "incorrect", "wrong", "错", "错误", "否", "×", "✗", "✘"}
NUMBER_WORDS = {w: i for i, w in enumerate([
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"])}
# Units to a base unit (factor), so "120 cm" equals "1.2 m". Symbols are case-sensitive as in SI ("mW" is not
# "MW", "T" is not "t"); a symbol of two letters or more written in another case is read as a unit only where that
# is unambiguous ("KM", "pa", "ML").
UNITS = {
    "mm": ("m", 1e-3), "cm": ("m", 1e-2), "dm": ("m", 0.1), "m": ("m", 1.0), "km": ("m", 1e3),
    "mg": ("g", 1e-3), "g": ("g", 1.0), "kg": ("g", 1e3), "t": ("g", 1e6),
    "ms": ("s", 1e-3), "s": ("s", 1.0), "min": ("s", 60.0), "h": ("s", 3600.0),
    "mL": ("L", 1e-3), "L": ("L", 1.0),
    "mm2": ("m2", 1e-6), "cm2": ("m2", 1e-4), "m2": ("m2", 1.0), "km2": ("m2", 1e6),
    "cm3": ("m3", 1e-6), "m3": ("m3", 1.0), "%": ("%", 1.0), "deg": ("deg", 1.0),
    "N": ("N", 1.0), "kN": ("N", 1e3), "J": ("J", 1.0), "kJ": ("J", 1e3), "W": ("W", 1.0), "kW": ("W", 1e3),
    "V": ("V", 1.0), "A": ("A", 1.0), "Pa": ("Pa", 1.0), "kPa": ("Pa", 1e3), "m/s": ("m/s", 1.0),
    "km/h": ("m/s", 1 / 3.6),
}
_FOLDED = {}
for _symbol in UNITS:
    _FOLDED.setdefault(_symbol.lower(), []).append(_symbol)
UNITS_ANY_CASE = {low: symbols[0] for low, symbols in _FOLDED.items() if len(symbols) == 1 and len(low) > 1}
# Words and other spellings of the units above (compared lowercased: a word has no case-sensitive meaning).
UNIT_ALIASES = {"meter": "m", "meters": "m", "metre": "m", "metres": "m", "centimeter": "cm", "centimeters": "cm",
                "millimeter": "mm", "millimeters": "mm", "kilometer": "km", "kilometers": "km", "gram": "g",
                "grams": "g", "kilogram": "kg", "kilograms": "kg", "second": "s", "seconds": "s", "sec": "s",
                "secs": "s", "minute": "min", "minutes": "min", "mins": "min", "hour": "h", "hours": "h", "hr": "h",
                "hrs": "h", "liter": "L", "liters": "L", "litre": "L", "litres": "L", "milliliter": "mL",
                "milliliters": "mL", "millisecond": "ms", "milliseconds": "ms", "newton": "N", "newtons": "N",
                "joule": "J", "joules": "J", "watt": "W", "watts": "W", "volt": "V", "volts": "V", "ampere": "A",
                "amperes": "A", "amp": "A", "amps": "A", "pascal": "Pa", "pascals": "Pa", "tonne": "t",
                "tonnes": "t", "l": "L", "m²": "m2", "cm²": "cm2", "km²": "km2", "mm²": "mm2", "m^2": "m2",
                "cm^2": "cm2",
                "km^2": "km2", "mm^2": "mm2", "cm³": "cm3", "m³": "m3", "cm^3": "cm3", "m^3": "m3", "°": "deg",
                "degrees": "deg", "degree": "deg", "percent": "%", "kmh": "km/h", "kph": "km/h"}


def canonical_unit(unit: str) -> str:
    """A known unit's symbol ("Meters" -> "m", "KM" -> "km", "ms" stays "ms"), or the text as written (an unknown
    unit: "apples"). Never strips letters to find a unit: "ms" is not "m", "Pas" is not "Pa"."""
    if unit in UNITS:
        return unit
    low = unit.lower()
    return UNIT_ALIASES.get(low) or UNITS_ANY_CASE.get(low) or unit


def same_unit_word(a: str, b: str) -> bool:
    """Two units that are not known symbols: the same word, ignoring case and an English plural ("3 apples" = "3
    apple", "2 boxes" = "2 box"). Short symbols (under 3 letters) must match exactly."""
    if a == b:
        return True
    a, b = a.lower(), b.lower()
    if min(len(a), len(b)) < 3 or not (a.isalpha() and b.isalpha()):
        return False
    short, long = sorted((a, b), key=len)
    return long in (short, short + "s", short + "es")


NUMBER = re.compile(r"^\s*([-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?)\s*(.*?)\s*$")


def normalize_text(text: str, drop_articles: bool = True) -> str:
    """Lowercase, NFKC, no punctuation, no articles, single spaces: "The Nile River." == "nile river"."""
    text = unicodedata.normalize("NFKC", str(text)).lower()
    text = re.sub(r"\\text\{([^}]*)\}", r"\1", text)
    text = "".join(" " if unicodedata.category(c).startswith("P") or c in "$`*" else c for c in text)
    words = [w for w in text.split() if not (drop_articles and w in {"a", "an", "the"})]
    return " ".join(words)


def response_answer(response: str) -> tuple[str | None, bool]:
    """(the answer the response commits to, whether it used the expected Answer:/boxed format)."""
    pred = extract_answer(response)
    if pred is not None:
        return pred, True
    lines = [ln.strip() for ln in response.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else None), False


# ---------------------------------------------------------------- numbers with units
def parse_quantity(text: str) -> tuple[float, str | None] | None:
    """"1,200 cm" -> (1200.0, "cm"); "three" -> (3.0, None); "x = 2.5 m" -> (2.5, "m"). None if not a number."""
    text = str(text).strip().rstrip(".").replace("−", "-")
    text = re.sub(r"^[a-zA-Z]\s*=\s*", "", text)  # "x = 5"
    text = re.sub(r"\\(?:,|;|!| )", "", text).replace("\\%", "%")
    word = normalize_text(text)
    if word in NUMBER_WORDS:
        return float(NUMBER_WORDS[word]), None
    fraction = re.match(r"^\s*([-+]?\d+)\s*/\s*(\d+)\s*(.*)$", text) or re.match(
        r"^\s*([-+]?)\\[dt]?frac\{(\d+)\}\{(\d+)\}\s*(.*)$", text)
    match = NUMBER.match(text)
    if fraction and fraction.re.groups == 4:  # \frac{a}{b}
        sign, num, den, unit = fraction.groups()
        if int(den) == 0:
            return None
        value = (-1 if sign == "-" else 1) * int(num) / int(den)
    elif fraction:
        if int(fraction.group(2)) == 0:
            return None
        value, unit = int(fraction.group(1)) / int(fraction.group(2)), fraction.group(3)
    elif match and re.search(r"\d", match.group(1) or ""):
        value, unit = float(match.group(1).replace(",", "")), match.group(2)
    else:
        return None
    unit = unit.strip().rstrip(".")
    unit = re.sub(r"\\text\{([^}]*)\}|\\mathrm\{([^}]*)\}", lambda m: m.group(1) or m.group(2), unit).strip()
    unit = canonical_unit(unit)
    if unit and len(unit.split()) > 2:  # "3 apples and ..." is a sentence, not a quantity
        return None
    return value, unit or None


def same_quantity(pred: str, gold: str, rel_tol: float = 1e-4, abs_tol: float = 1e-9) -> bool | None:
    """True/False when both are numbers (units converted when both have one), None when either is not."""
    p, g = parse_quantity(pred), parse_quantity(gold)
    if p is None or g is None:
        return None
    (pv, pu), (gv, gu) = p, g
    if pu and gu and pu != gu:
        if pu in UNITS and gu in UNITS:
            if UNITS[pu][0] != UNITS[gu][0]:  # another dimension: "5 ms" is not "5 m"
                return False
            pv, gv = pv * UNITS[pu][1], gv * UNITS[gu][1]
        elif pu in UNITS or gu in UNITS or not same_unit_word(pu, gu):
            return False
    return math.isclose(pv, gv, rel_tol=rel_tol, abs_tol=abs_tol)


# ---------------------------------------------------------------- choices and true/false
def _options(task: dict) -> dict[str, str]:
    choices = task["choices"]
    if isinstance(choices, dict):
        return {str(k).strip().upper(): str(v) for k, v in choices.items()}
    return {LETTERS[i]: str(c) for i, c in enumerate(choices)}


def choice_letters(text: str, options: dict[str, str]) -> set[str] | None:
    """The option letter(s) a text names: "B", "(b)", "B. Paris", "Option B", "A, C", or an option's text."""
    raw = str(text).strip()
    norm = normalize_text(raw)
    by_text = {normalize_text(v): k for k, v in options.items()}
    if norm in by_text:
        return {by_text[norm]}
    letters_only = normalize_text(raw, drop_articles=False)  # "a" is option A here, not an article
    cleaned = re.sub(r"^(?:the\s+)?(?:answer|options?|choices?)\s*(?:is|are)?\s*", "", letters_only).strip()
    tokens = cleaned.upper().replace("AND", " ").split()
    if tokens and all(t in options for t in tokens):
        return set(tokens)
    if cleaned.upper() and all(c in options for c in cleaned.upper().replace(" ", "")) and len(cleaned) <= len(options):
        return set(cleaned.upper().replace(" ", ""))  # "AC"
    lead = re.match(r"^\(?([A-Za-z])[).:\s]", raw + " ")  # "B) Paris", "(B) ...", "B. Paris"
    if lead and lead.group(1).upper() in options:
        rest = normalize_text(raw[lead.end():])
        if not rest or rest == normalize_text(options[lead.group(1).upper()]):
            return {lead.group(1).upper()}
    return None


def truth_value(text) -> bool | None:
    if isinstance(text, bool):
        return text
    norm = normalize_text(text)
    if norm in TRUE_WORDS or str(text).strip() in TRUE_WORDS:
        return True
    if norm in FALSE_WORDS or str(text).strip() in FALSE_WORDS:
        return False
    return None


def task_type(task: dict) -> str:
    if task.get("type"):
        return task["type"]
    if task.get("choices"):
        return "choice"
    answer = task["answer"]
    if isinstance(answer, bool) or (isinstance(answer, str) and truth_value(answer) is not None
                                    and normalize_text(answer) not in {"t", "n", "y", "f"}):
        return "true_false"
    if not isinstance(answer, list) and parse_quantity(str(answer)) is not None:
        return "number"
    return "short"


# ---------------------------------------------------------------- generative judge
JUDGE_PROMPT = ("Question: {question}\nReference answer: {gold}\nStudent answer: {pred}\n"
                "Does the student answer mean the same as the reference answer? Reply yes or no.")


@functools.lru_cache(maxsize=2)
def _judge_model(path: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    return tokenizer, model


def judge(question: str, gold: str, pred: str, model_path: str, device: str = "cpu") -> float:
    """P(yes) from the judge LM, comparing the log-likelihoods of the replies "yes" and "no" after the prompt."""
    import torch

    tokenizer, model = _judge_model(model_path, device)
    text = JUDGE_PROMPT.format(question=question, gold=gold, pred=pred)
    if getattr(tokenizer, "chat_template", None):
        prefix = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True)
    else:
        prefix = text + "\nAnswer: "
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    scores = []
    with torch.inference_mode():
        for reply in ("yes", "no"):
            reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prefix_ids + reply_ids], device=model.device)
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            targets = ids[0, 1:]
            token_lp = logprobs.gather(1, targets[:, None])[:, 0][len(prefix_ids) - 1:]
            scores.append(token_lp.sum().item())
    return float(torch.softmax(torch.tensor(scores), dim=0)[0])


# ---------------------------------------------------------------- score
def check(pred: str, task: dict) -> tuple[bool, str]:
    """Rule-based verdict and the reason."""
    kind = task_type(task)
    gold = task["answer"]
    if kind == "choice":
        options = _options(task)
        want = choice_letters(gold, options) if not isinstance(gold, int) or isinstance(gold, bool) \
            else {LETTERS[gold]}
        if want is None:
            raise ValueError(f"task {task.get('id')}: answer {gold!r} is none of the choices {list(options)}")
        got = choice_letters(pred, options)
        if got is None:
            return False, "no recognisable choice"
        return got == want, f"chose {''.join(sorted(got))}"
    if kind == "true_false":
        got = truth_value(pred)
        if got is None:
            return False, "not true/false"
        return got == truth_value(gold), f"said {got}"
    golds = gold if isinstance(gold, list) else [gold]
    for g in golds:
        same = same_quantity(pred, str(g), float(task.get("tolerance", 1e-4)), float(task.get("abs_tol", 1e-9)))
        if same or (same is None and normalize_text(pred) == normalize_text(g)):
            return True, "matches"
    return False, "no match"


def score(response: str, task: dict):
    if "answer" not in task:
        raise ValueError(f"task {task.get('id')}: a k12 task needs `answer`")
    pred, format_ok = response_answer(response)
    if pred is None:
        return Reward(0.0, {"reason": "no answer", "format_ok": False})
    ok, reason = check(pred, task)
    info = {"reason": reason, "pred": pred, "format_ok": format_ok, "type": task_type(task)}
    mode = task.get("judge", "fallback")
    if task.get("judge_model") and info["type"] in ("short", "number") and mode != "never" and (
            mode == "always" or not ok):
        question = task.get("question") or task.get("prompt") or ""
        p_yes = judge(question, str(task["answer"]), pred, task["judge_model"], task.get("judge_device", "cpu"))
        ok = p_yes > 0.5
        info.update(reason=f"judge {'yes' if ok else 'no'} (rules: {reason})", judge_p_yes=p_yes)
    return Reward(1.0 if ok else 0.0, info)
