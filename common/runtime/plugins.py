"""User code by reference: `module:function` or `path/to/file.py:function`, for flags such as --loss-fn,
--reward-fn and --processors. A reference is a string, so it crosses process boundaries as is and every worker
(trainer, explorer, reward worker) imports it itself."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys


def load_object(spec: str, flag: str):
    """The object `spec` names, or a one-line error naming `flag` and what is wrong."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise SystemExit(f"error: {flag} {spec}: expected module:function or path/to/file.py:function")
    if where.endswith(".py"):
        path = os.path.abspath(os.path.expanduser(where))
        if not os.path.exists(path):
            raise SystemExit(f"error: {flag} {spec}: no such file {where}")
        module_name = f"_tandem_plugin_{abs(hash(path))}"
        module = sys.modules.get(module_name)
        if module is None:
            file_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[module_name] = module
            file_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise SystemExit(f"error: {flag} {spec}: cannot import {where} ({e})") from None
    obj = getattr(module, name, None)
    if obj is None or not callable(obj):
        raise SystemExit(f"error: {flag} {spec}: {where} has no function {name!r}")
    return obj
