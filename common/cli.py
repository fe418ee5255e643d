"""Loading the configuration: `parse_args(cls)` takes a run's saved config.json (`--resume`), a `--config X.yaml`
and the command line (tyro over the flat `Args` dataclass: every field's docstring is its --help text, every `Literal`
field lists its choices), each value type-checked and each error one line (a wrong choice too, instead of tyro's
box), then runs the config's `validate()`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import typing
from typing import Literal

from common.knobs import ConfigError, coerce_value, field_types, read_utf8_lines
from common.runtime.worker import under_elastic


LAUNCHED_ARGS = "TANDEM_ARGS"
"""Set by the launcher of `python train_X.py` (common/run.py `launch`) for its ranks: the configuration it parsed,
validated and prepared, as JSON."""


def parse_args(cls, argv: list[str] | None = None):
    """tyro over `cls` (choices checked), then its `validate()`. Defaults, lowest first: the fields' own, the run's
    saved config.json (with `--resume`: only flags given again change it), `--config file.yaml`, the command line.
    A rank of `python train_X.py` takes what its launcher parsed instead (parsing argv again costs every rank
    tyro's import and parse, ~0.5 CPU-s, for the same values)."""
    if LAUNCHED_ARGS in os.environ and under_elastic():
        return cls(**json.loads(os.environ[LAUNCHED_ARGS]))
    import tyro

    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = cls()
    saved = load_saved_config(cls, argv) if "--resume" in argv else {}
    if saved:
        defaults = dataclasses.replace(defaults, **saved)
    config_path = _flag_value(argv, "--config")
    if config_path:
        defaults = load_yaml_defaults(cls, config_path, base=defaults)
    check_argv_choices(cls, argv)
    args = tyro.cli(cls, args=argv, default=defaults)
    if saved:
        check_frozen_on_resume(saved, args)
    args.given_fields = given_fields(cls, argv, args)
    args.validate()
    return args


def given_fields(cls, argv: list[str], args) -> frozenset:
    """Fields the user set: named on the command line (--x, --no-x), or set by --config or a resumed run to a value
    other than the field's default. The memory check (common/memory.py) chooses only the others."""
    names = {f.name for f in dataclasses.fields(cls)}
    flags = {a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--")}
    flags |= {f[3:] for f in flags if f.startswith("no_")}
    default = cls()
    return frozenset(n for n in names if n in flags or getattr(args, n) != getattr(default, n))


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value of `--flag X` / `--flag=X` (dashes or underscores) in argv, the last one winning."""
    names = {flag, flag.replace("-", "_").replace("__", "--", 1)}
    value = None
    for i, a in enumerate(argv):
        if a in names and i + 1 < len(argv):
            value = argv[i + 1]
        elif "=" in a and a.split("=", 1)[0] in names:
            value = a.split("=", 1)[1]
    return value


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


def choices(cls) -> dict[str, tuple]:
    """The Literal fields of `cls` and their allowed values."""
    return {name: typing.get_args(t) for name, t in field_types(cls).items() if typing.get_origin(t) is Literal}


def check_choice(name: str, value, allowed: tuple, where: str = "") -> None:
    """A one-line ConfigError naming the flag, the value and the choices when `value` is not one of them."""
    if value not in allowed:
        flag = f"--{name.replace('_', '-')}"
        raise ConfigError(f"{where}{flag} {value!r}: not one of {', '.join(map(str, allowed))}")


# Fields a run cannot change when it is resumed: the checkpoint's weights, optimizer and critic depend on them.
FROZEN_ON_RESUME = ("model", "critic_model", "algo", "dtype")
NOT_RESUMED = ("schedule", "config", "resume", "overwrite", "out_dir")


def load_saved_config(cls, argv: list[str]) -> dict:
    """--resume: the fields of out_dir/config.json (written when the run started), type-checked."""
    out_dir = _flag_value(argv, "--out-dir")
    if not out_dir:
        raise ConfigError("--resume needs --out-dir (the run to continue)")
    path = os.path.join(out_dir, "config.json")
    if not os.path.isdir(out_dir):
        raise ConfigError(f"--resume: --out-dir {out_dir}: no such folder")
    if not os.path.exists(path):
        raise ConfigError(f"--resume: {path}: no such file: --out-dir holds no tandem run, so no checkpoint to resume")
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"--resume: {path}: not a readable config ({e})") from None
    types_ = field_types(cls)
    unknown = sorted(k for k in values if k not in types_ and k not in NOT_RESUMED)
    if unknown:
        raise ConfigError(f"--resume: {path} was written by another schedule ({values.get('schedule')}; fields "
                          f"{', '.join(unknown[:3])}): continue it with the script that started it")
    return {k: coerce_value(v, types_[k], f"{path}: {k}") for k, v in values.items()
            if k in types_ and k not in NOT_RESUMED}


def check_frozen_on_resume(saved: dict, args) -> None:
    for name in FROZEN_ON_RESUME:
        if name in saved and getattr(args, name) != saved[name]:
            raise ConfigError(f"--{name.replace('_', '-')} cannot change when resuming (the run in {args.out_dir} "
                              f"uses {saved[name]!r}); start a new run in another --out-dir instead")


def load_yaml_defaults(cls, path: str, base):
    """`base` updated with the YAML file's values, each checked against its field's
    type; unknown keys, invalid YAML and non-UTF-8 bytes are one-line errors naming the file."""
    import yaml

    if not os.path.exists(path):
        raise ConfigError(f"--config {path}: no such file")
    text = "".join(read_utf8_lines(path))
    try:
        values = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path}: expected a mapping of field: value")
    types_, allowed = field_types(cls), choices(cls)
    clean = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name not in types_:
            raise ConfigError(f"--config {path}: unknown key {key!r} (not a field of {cls.__name__})")
        if name in allowed:
            check_choice(name, value, allowed[name], where=f"--config {path}: ")
        clean[name] = coerce_value(value, types_[name], f"--config {path}: {key}")
    try:
        return dataclasses.replace(base, **clean)
    except TypeError as e:
        raise ConfigError(f"--config {path}: {e}") from None
