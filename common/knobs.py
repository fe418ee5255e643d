"""Generic checks of every configuration knob, before any worker starts (one line naming the field, no traceback).

- `check_numeric_ranges(args)`: every int/float field must be finite (no NaN, no infinities) and inside its range.
  `RANGES` lists the fields whose range is not the default `>= 0`; a numeric field that is not listed (a new one
  included) must be a finite number >= 0. Schedule-specific fields (train_async.py's) are listed here too.
- `coerce_value(value, type)`: a YAML / saved-config value checked against the field's annotated type (int, float,
  bool, str, `X | None`, `Literal[...]`); a YAML string that spells a number ('1e-5') is taken as that number.
- `read_utf8_lines(path)`: lines of a text file, `file:line: not UTF-8` on the first bad byte.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing


class ConfigError(SystemExit):
    """A one-line, user-facing configuration error: Python prints the message and exits with status 1."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")

# field -> (low, low_inclusive, high, high_inclusive, why). None = unbounded on that side.
RANGES: dict[str, tuple] = {
    "steps": (1, True, None, False, ""),
    "timeout_s": (0, False, None, False, "a wait of 0 s fails at once"),
    "peer_timeout_s": (2, True, None, False, "a live worker may be silent for a second between its beats"),
    "stall_log_s": (0, False, None, False, ""),
    "vllm_gpu_memory_utilization": (0, False, 1, True, ""),
    "vllm_kv_cache_gb": (0, False, None, False, ""),
    "difficulty": (1, True, 4, True, "the arith levels"),
    "eval_size": (1, True, None, False, ""),
    "tasks_per_step": (1, True, None, False, ""),
    "samples_per_task": (1, True, None, False, ""),
    "temperature": (0, False, None, False, "sampling needs a positive temperature"),
    "top_p": (0, False, 1, True, ""),
    "max_new_tokens": (1, True, None, False, ""),
    "reward_workers": (1, True, None, False, ""),
    "reward_timeout_s": (0, False, None, False, ""),
    "reward_memory_mb": (256, True, None, False, "a worker needs ~150 MB for its imports"),
    "lr": (0, False, None, False, ""),
    "ppo_epochs": (1, True, None, False, ""),
    "minibatch_size": (1, True, None, False, ""),
    "micro_batch_size": (1, True, None, False, ""),
    "clip_eps": (0, False, None, False, "0 clips every update away"),
    "max_grad_norm": (0, False, None, False, "a negative norm flips the gradient"),
    "correction_cap": (1, True, None, False, "a cap below 1 cuts even on-policy weights"),
    "critic_lr": (0, False, None, False, ""),
    "gamma": (0, True, 1, True, ""),
    "lam": (0, True, 1, True, ""),
    "sync_bucket_mb": (1, True, None, False, ""),
    "max_reuse": (1, True, None, False, "1 = no replay"),
    "keep_checkpoints": (0, True, None, False, "0 = keep every one"),
    # train_async.py
    "num_explorers": (1, True, None, False, ""),
    "sync_interval": (1, True, None, False, ""),
}
DEFAULT_RANGE = (0, True, None, False, "")


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _describe(lo, lo_inc, hi, hi_inc) -> str:
    if hi is None:
        return f"{'>=' if lo_inc else '>'} {lo}"
    return f"in {'[' if lo_inc else '('}{lo}, {hi}{']' if hi_inc else ')'}"


def field_types(cls) -> dict[str, object]:
    """Resolved annotation of every dataclass field of `cls` (string annotations included)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls)}


def _numeric(tp) -> bool:
    return tp in (int, float) or any(a in (int, float) for a in typing.get_args(tp) if a is not type(None))


def check_numeric_ranges(args) -> None:
    """Every numeric field finite and in range; SystemExit('error: --field ...') on the first that is not."""
    for name, tp in field_types(type(args)).items():
        value = getattr(args, name)
        if not _numeric(tp) or value is None or isinstance(value, bool):
            continue
        if not isinstance(value, (int, float)):
            raise ConfigError(f"{_flag(name)} must be a number (got {value!r})")
        if not math.isfinite(value):
            raise ConfigError(f"{_flag(name)} must be a finite number (got {value})")
        lo, lo_inc, hi, hi_inc, why = RANGES.get(name, DEFAULT_RANGE)
        ok = (value >= lo if lo_inc else value > lo) and (hi is None or (value <= hi if hi_inc else value < hi))
        if not ok:
            raise ConfigError(f"{_flag(name)} must be {_describe(lo, lo_inc, hi, hi_inc)} (got {value}"
                             f"{'; ' + why if why else ''})")


def coerce_value(value, tp, where: str):
    """`value` as a valid value of type `tp`, or SystemExit naming `where` (e.g. 'config.yaml: lr')."""
    origin, options = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return coerce_value(value, option, where)
            except SystemExit as e:
                errors.append(str(e.code))
        raise ConfigError(errors[0].removeprefix("error: ") if len(errors) == 1 else
                         f"{where}: {value!r} is none of {', '.join(_name(o) for o in options)}")
    if origin is typing.Literal:
        if value in options:
            return value
        raise ConfigError(f"{where}: must be one of {', '.join(map(str, options))} (got {value!r})")
    if origin is tuple:  # JSON / YAML lists -> tuple fields (--wandb-tags, --processors)
        if isinstance(value, (list, tuple)):
            return tuple(value)
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        return value  # a type these checks do not know: tyro / the field's own validation decide
    raise ConfigError(f"{where}: expected {_name(tp)}, got {value!r}")


def _name(tp) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "text"}.get(tp, str(tp))


def read_utf8_lines(path: str) -> list[str]:
    """The file's lines (decoded); SystemExit('error: file:line: not UTF-8') at the first line that is not."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x})") from None
