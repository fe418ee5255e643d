"""The command line behind `config.parse_args`: tyro over the flat `Args` dataclass (every field's docstring is its
--help text, every `Literal` field lists its choices), with one-line errors for wrong choices instead of tyro's box."""

from __future__ import annotations

import typing
from typing import Literal

from common.knobs import ConfigError


def choices(cls) -> dict[str, tuple]:
    """The Literal fields of `cls` and their allowed values."""
    hints = typing.get_type_hints(cls)
    return {name: typing.get_args(t) for name, t in hints.items()
            if name in cls.__dataclass_fields__ and typing.get_origin(t) is Literal}


def check_choice(name: str, value, allowed: tuple, where: str = "") -> None:
    """A one-line ConfigError naming the flag, the value and the choices when `value` is not one of them."""
    if value not in allowed:
        flag = f"--{name.replace('_', '-')}"
        raise ConfigError(f"{where}{flag} {value!r}: not one of {', '.join(map(str, allowed))}")


def check_argv_choices(cls, argv: list[str]) -> None:
    """A wrong choice on the command line is a one-line error naming the flag and the choices."""
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
    """tyro over `cls`, starting from `defaults` (the field defaults, a resumed run's config, --config)."""
    import tyro

    check_argv_choices(cls, argv)
    return tyro.cli(cls, args=argv, default=defaults)
