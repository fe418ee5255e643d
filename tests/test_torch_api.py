"""No torch keyword or API newer than the oldest supported torch (common/run.py TORCH_MIN): every torch function,
class or module the project names (read from the source: imports and `torch.a.b(...)` calls, aliases resolved) must
exist in that release, with every keyword the call passes. The oldest release's API is checked in as
tests/torch_api.json, written by this file where that torch is installed (the GPU images ship it; on a CPU machine
PyPI's CUDA build imports too: `python3 -m venv /tmp/t && /tmp/t/bin/pip install torch==2.11.0`):

    python tests/test_torch_api.py --write tests/torch_api.json

Blind spot: methods called on a value (`x.argsort(stable=True)`) are not resolved to a torch type.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(ROOT, "tests", "torch_api.json")
SKIP_DIRS = {".venv", ".git", "runs", "shared", ".whl", "node_modules", "__pycache__"}


def sources(root: str = ROOT):
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.join(folder, f)


def _dotted(node, aliases: dict) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(parts)])
    return None


def torch_references(root: str = ROOT) -> list[tuple[str, str, list[str] | None]]:
    """(where, dotted torch name, keywords passed or None for a reference that is no call), over the project."""
    out = []
    for path in sources(root):
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        where = os.path.relpath(path, root)
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "torch" or a.name.startswith("torch."):
                        aliases[a.asname or "torch"] = a.name if a.asname else "torch"
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and (node.module == "torch" or node.module.startswith("torch.")):
                for a in node.names:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    out.append((f"{where}:{node.lineno}", f"{node.module}.{a.name}", None))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = _dotted(node.func, aliases)
                if name:
                    out.append((f"{where}:{node.lineno}", name, [k.arg for k in node.keywords if k.arg]))
            elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
                name = _dotted(node, aliases)
                if name:
                    out.append((f"{where}:{node.lineno}", name, None))
    return out


# ----------------------------------------------------------------------------- writing the table (on the old torch)
def _parameters(obj) -> str:
    """'a,b,c' (the names a call may pass by keyword), '**' (any keyword) or '?' (not known)."""
    names: set[str] = set()
    try:
        sig = inspect.signature(obj)
        if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            return "**"
        return ",".join(p.name for p in sig.parameters.values() if p.kind is not p.VAR_POSITIONAL)
    except (TypeError, ValueError):
        pass
    import torch

    name, doc = getattr(obj, "__name__", ""), getattr(obj, "__doc__", None)
    name, doc = name if isinstance(name, str) else "", doc if isinstance(doc, str) else ""
    try:  # builtins: the aten schemas' argument names, every overload
        for schema in torch._C._jit_get_schemas_for_operator(f"aten::{name}"):
            names.update(a.name for a in schema.arguments)
    except RuntimeError:
        pass
    for line in doc.splitlines()[:8]:  # "argsort(input, dim=-1, stable=False)"
        m = re.match(rf"\s*{re.escape(name)}\((.*)\)", line)
        if m:
            names.update(re.findall(r"(?:^|,)\s*(\w+)", m.group(1)))
    names.discard("self")
    return ",".join(sorted(names)) if names else "?"


def _members(obj) -> dict[str, str]:
    out = {}
    for attr in dir(obj):
        if attr.startswith("__") and attr != "__init__":
            continue
        try:
            value = getattr(obj, attr)
        except Exception:  # noqa: BLE001 -- a lazy attribute that fails to build on this machine: still present
            out[attr] = "?"
            continue
        out[attr] = _parameters(value) if callable(value) and not inspect.ismodule(value) else ""
    return out


def write_table(path: str) -> None:
    """Every module the project names, all its public members, and the members of every class it names."""
    import importlib

    import torch

    table: dict[str, dict] = {"torch_version": torch.__version__, "modules": {}, "classes": {}}
    for _, name, _ in torch_references():
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            module = ".".join(parts[:i])
            try:
                mod = importlib.import_module(module)
            except ImportError:
                continue
            if module not in table["modules"]:
                table["modules"][module] = _members(mod)
            obj = mod
            for j, attr in enumerate(parts[i:]):
                obj = getattr(obj, attr, None)
                owner = ".".join(parts[:i + j + 1])
                if isinstance(obj, type) and owner not in table["classes"]:
                    table["classes"][owner] = _members(obj)
            break
    with open(path, "w") as f:
        json.dump(table, f, indent=0, sort_keys=True)
    print(f"wrote {path}: torch {torch.__version__}, {len(table['modules'])} modules, {len(table['classes'])} classes")


# ----------------------------------------------------------------------------- the check
def problems(references, table) -> list[str]:
    """One line per reference the table's torch lacks (a name or a keyword)."""
    version = table["torch_version"]
    out = []
    for where, name, keywords in references:
        owner, _, attr = name.rpartition(".")
        if any(part.startswith("__") for part in name.split(".")):  # the language's (__version__, __init__, ...)
            continue
        scope = table["modules"].get(owner, table["classes"].get(owner))
        if scope is None:
            parent = owner.rpartition(".")[0]
            if owner.rpartition(".")[2] in table["modules"].get(parent, table["classes"].get(parent, {})) \
                    or name in table["modules"] or name in table["classes"] or not owner:
                continue  # an attribute of a value (torch.float32.itemsize), or a module itself
            out.append(f"{where}: {name}: not in {os.path.relpath(TABLE, ROOT)} (regenerate it on torch {version})")
            continue
        if attr not in scope:
            out.append(f"{where}: {name} does not exist in torch {version}")
            continue
        accepted = scope[attr]
        if keywords and accepted not in ("**", "?"):
            missing = [k for k in keywords if k not in accepted.split(",")]
            if missing:
                out.append(f"{where}: {name}({', '.join(k + '=' for k in missing)}): no such keyword in torch {version}")
    return out


def load_table() -> dict:
    import pytest

    if not os.path.exists(TABLE):
        pytest.skip(f"{os.path.relpath(TABLE, ROOT)} not written yet: python tests/test_torch_api.py --write "
                    "tests/torch_api.json on torch 2.11")
    with open(TABLE) as f:
        return json.load(f)


def test_no_torch_api_newer_than_the_oldest_supported():
    from common.run import TORCH_MIN

    table = load_table()
    assert tuple(int(x) for x in table["torch_version"].split(".")[:2]) == TORCH_MIN, \
        f"{TABLE} is torch {table['torch_version']}'s API; the oldest supported is {TORCH_MIN}: regenerate it"
    found = problems(torch_references(), table)
    assert not found, "\n".join(found)


def test_the_check_sees_a_missing_keyword_and_a_missing_name():
    """The check itself: a keyword and a function that the table's torch lacks are reported (the table is real)."""
    table = load_table()
    refs = [("x.py:1", "torch.argsort", ["stable"]), ("x.py:2", "torch.argsort", ["no_such_keyword"]),
            ("x.py:3", "torch.no_such_function", [])]
    assert [p.split(": ", 1)[0] for p in problems(refs, table)] == ["x.py:2", "x.py:3"]


if __name__ == "__main__":
    if sys.argv[1:2] != ["--write"] or len(sys.argv) != 3:
        raise SystemExit("usage: python tests/test_torch_api.py --write tests/torch_api.json")
    sys.path.insert(0, ROOT)
    write_table(sys.argv[2])
