"""Generic checks of every configuration knob, before any worker starts (one line naming the field, no traceback).

- `check_numeric_ranges(args)`: every int/float field must be finite (no NaN, no infinities) and inside its range.
  Each config class lists in its own `RANGES` the fields whose `Range` is not the default `>= 0` (the classes of
  its MRO merged); a numeric field that is not listed (a new one included) must be a finite number >= 0.
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


@dataclasses.dataclass(frozen=True)
class Range:
    """A numeric field's allowed values, one line of a config class's `RANGES`: `ge` or `gt` bounds it below
    (included or not), `le` or `lt` above, an end left out is open; `why` is said in the error."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    why: str = ""

    def __contains__(self, value) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def __str__(self) -> str:
        """How the error says it: '>= 1', '> 0', 'in (0, 1]'."""
        low = self.ge if self.ge is not None else self.gt
        high = self.le if self.le is not None else self.lt
        if high is None:
            return f"{'>=' if self.ge is not None else '>'} {low}"
        if low is None:
            return f"{'<=' if self.le is not None else '<'} {high}"
        return f"in {'[' if self.ge is not None else '('}{low}, {high}{']' if self.le is not None else ')'}"


DEFAULT_RANGE = Range(ge=0)
"""The range of a numeric field that no `RANGES` lists."""


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def field_types(cls) -> dict[str, object]:
    """Resolved annotation of every dataclass field of `cls` (string annotations included)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls)}


def _numeric(tp) -> bool:
    return tp in (int, float) or any(a in (int, float) for a in typing.get_args(tp) if a is not type(None))


def declared_ranges(cls) -> dict[str, Range]:
    """The `RANGES` of `cls` and of the classes it derives from (a subclass's entry wins)."""
    out: dict[str, Range] = {}
    for klass in reversed(cls.__mro__):
        out.update(vars(klass).get("RANGES", {}))
    return out


def check_numeric_ranges(args) -> None:
    """Every numeric field finite and in range; SystemExit('error: --field ...') on the first that is not."""
    ranges = declared_ranges(type(args))
    for name, tp in field_types(type(args)).items():
        value = getattr(args, name)
        if not _numeric(tp) or value is None or isinstance(value, bool):
            continue
        if not isinstance(value, (int, float)):
            raise ConfigError(f"{_flag(name)} must be a number (got {value!r})")
        if not math.isfinite(value):
            raise ConfigError(f"{_flag(name)} must be a finite number (got {value})")
        allowed = ranges.get(name, DEFAULT_RANGE)
        if value not in allowed:
            why = f"; {allowed.why}" if allowed.why else ""
            raise ConfigError(f"{_flag(name)} must be {allowed} (got {value}{why})")


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
