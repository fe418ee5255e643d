"""The command line behind `config.parse_args`: flat `Args` dataclasses, a `--help` grouped by concern, and
one-line errors for wrong choices.

The config fields stay flat (`args.lr`, `args.algo`: every module reads them so), declared under section comments
in common/config.py (`# --- run ---`). For tyro, each section becomes a nested dataclass of its own (shown as one
box in `--help`, flags unprefixed: still `--lr`), and the parsed result is flattened back into the flat `Args`.
The fields of an entry script's own `Args` form the "schedule" group.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import typing
from typing import Annotated, Literal

# Section comments of common/config.py -> the --help group they belong to (a section not listed is its own group).
SCHEDULE = ("schedule", "when and how weights and experiences move between explorers and trainers")
GROUPS = {
    "run": ("run", "outputs, length, resume, tracking, timeouts"),
    "model and devices": ("model / engine", "the policy model, its dtype, devices and the rollout engine"),
    "tasks": ("data", "tasksets, held-out evaluation and how rollouts are sampled"),
    "rollout": ("data", "tasksets, held-out evaluation and how rollouts are sampled"),
    "rewards": ("rewards", "verifiers, reward models, shaping (rewards/)"),
    "optimisation": ("algorithm", "the loss, its advantages and the optimizer (common/trainer/losses.py)"),
    "PPO / critic, reference model, experience filters": ("algorithm", ""),
    "weight sync": SCHEDULE,
    "Kimi k1.5: partial rollouts, replay, curriculum": ("Kimi extras", "partial rollouts, replay, "
                                                        "prioritized sampling, curriculum (Kimi k1.5)"),
}
SECTION = re.compile(r"^\s*# -+ (?:ALGO LOGIC: )?(.+?) -*$")
FIELD = re.compile(r"^ {4}(\w+)\s*:")


def field_groups(cls) -> dict[str, tuple[str, str]]:
    """field name -> (group title, group description), from the section comments above the fields (base classes
    first; a subclass's own fields are the schedule's)."""
    out: dict[str, tuple[str, str]] = {}
    dataclass_bases = [k for k in reversed(cls.__mro__) if dataclasses.is_dataclass(k)]
    for i, klass in enumerate(dataclass_bases):
        group = GROUPS["run"] if i == 0 else SCHEDULE  # an entry script's own fields: the schedule's
        for line in inspect.getsource(klass).splitlines():
            section = SECTION.match(line)
            if section:
                title = section.group(1).strip()
                group = next((g for key, g in GROUPS.items() if title.startswith(key)), (title, ""))
                continue
            field = FIELD.match(line)
            if field and field.group(1) in klass.__dataclass_fields__ and field.group(1) not in out:
                out[field.group(1)] = group
    for name in cls.__dataclass_fields__:  # declared some other way: keep it reachable
        out.setdefault(name, GROUPS["run"])
    return out


def choices(cls) -> dict[str, tuple]:
    """The Literal fields of `cls` and their allowed values."""
    hints = typing.get_type_hints(cls)
    return {name: typing.get_args(t) for name, t in hints.items()
            if name in cls.__dataclass_fields__ and typing.get_origin(t) is Literal}


@functools.lru_cache(maxsize=None)
def grouped_type(cls):
    """A dataclass with one nested dataclass per group (flags unprefixed), and {attribute: (group class, names)}."""
    import tyro
    def doc(name: str) -> str:  # the field's docstring, read the way tyro reads it (private API: may move)
        try:
            from tyro._docstrings import get_field_docstring
        except ImportError:
            return ""
        return " ".join((get_field_docstring(cls, name, ()) or "").split())

    hints = typing.get_type_hints(cls, include_extras=True)
    by_group: dict[str, list[str]] = {}
    descriptions: dict[str, str] = {}
    for name, (title, description) in field_groups(cls).items():
        by_group.setdefault(title, []).append(name)
        descriptions[title] = descriptions.get(title) or description
    top, parts = [], {}
    for title, names in by_group.items():
        attr = re.sub(r"\W+", "_", title).strip("_").lower()
        fields = [(n, Annotated[hints[n], tyro.conf.arg(help=doc(n))], dataclasses.field(default=None)) for n in names]
        group = dataclasses.make_dataclass(title.replace(" / ", "/"), fields)
        parts[attr] = (group, names)
        top.append((attr, Annotated[tyro.conf.OmitArgPrefixes[group], tyro.conf.arg(help=descriptions[title])],
                    dataclasses.field(default=None)))
    return dataclasses.make_dataclass(cls.__name__, top), parts


def check_choice(name: str, value, allowed: tuple, where: str = "") -> None:
    """A one-line ConfigError naming the flag, the value and the choices when `value` is not one of them."""
    if value not in allowed:
        from common.config import ConfigError

        flag = f"--{name.replace('_', '-')}"
        raise ConfigError(f"{where}{flag} {value!r}: not one of {', '.join(map(str, allowed))}")


def check_argv_choices(cls, argv: list[str]) -> None:
    """A wrong choice on the command line is a one-line error naming the flag and the choices (tyro's own message
    is a box of several lines)."""
    allowed = choices(cls)
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        key, eq, value = arg[2:].partition("=")
        name = key.replace("-", "_")
        if name in allowed:
            if not eq:
                if i + 1 >= len(argv):
                    continue  # tyro says the value is missing
                value = argv[i + 1]
            check_choice(name, value, allowed[name])


def cli(cls, argv: list[str], defaults):
    """tyro over the grouped form of `cls`, starting from the flat `defaults`; returns a flat `cls`."""
    import tyro

    check_argv_choices(cls, argv)
    top, parts = grouped_type(cls)
    default = top(**{attr: group(**{n: getattr(defaults, n) for n in names})
                     for attr, (group, names) in parts.items()})
    nested = tyro.cli(top, args=argv, default=default)
    flat = {n: getattr(getattr(nested, attr), n) for attr, (_, names) in parts.items() for n in names}
    init = {n: v for n, v in flat.items() if cls.__dataclass_fields__[n].init}
    args = cls(**init)
    for n, v in flat.items():
        if not cls.__dataclass_fields__[n].init:
            setattr(args, n, v)
    return args
