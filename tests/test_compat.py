"""Private names of other libraries live behind one door each (common/compat/, one module per library): a scan of
the repository's code finds every one used, and fails on one outside those modules; each module's `check()` says
in one line which of its names the installed version lacks (a new version that moved one fails here first)."""

import ast
import os

import pytest

from tests.conftest import ROOT

DOORS = {"common/compat/python.py", "common/compat/torch.py", "common/compat/transformers.py", "common/compat/vllm.py"}
OWN = ("common", "rewards", "bench", "tests", "train_sync", "train_offpolicy", "train_async")
PUBLIC = {"_exit", "_getframe", "_replace", "_asdict", "_fields", "_make"}  # documented, underscore all the same


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name not in PUBLIC


def _sources() -> dict[str, ast.Module]:
    paths = [f for f in os.listdir(ROOT) if f.endswith(".py")]
    for top in ("common", "rewards", "bench"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            paths += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".py")]
    return {p: ast.parse(open(os.path.join(ROOT, p)).read()) for p in sorted(paths)}


def _own_names(trees) -> set[str]:
    """Names the project defines or binds itself: a private name among them may be the project's own attribute."""
    names = {os.path.basename(p)[:-3] for p in trees}
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
            elif isinstance(n, ast.arg):
                names.add(n.arg)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and \
                    isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                names.add(n.attr)
    return names


def _root(node) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(trees) -> dict[str, set[str]]:
    """Private name of another library -> the places (path:line) that use it: an attribute of an imported foreign
    module (however deep), a private attribute the project never defines (of an object a library made), one
    reached through super(), a private module imported or a private name imported from a foreign module."""
    own, found = _own_names(trees), {}
    for path, tree in trees.items():
        foreign = set()  # names this file binds to foreign modules
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                foreign |= {(a.asname or a.name).split(".")[0] for a in n.names if not a.name.startswith(OWN)}
            elif isinstance(n, ast.ImportFrom) and n.module and not n.level and not n.module.startswith(OWN):
                foreign |= {a.asname or a.name for a in n.names}
        for n in ast.walk(tree):
            names = []
            if isinstance(n, ast.Attribute) and _private(n.attr):
                through_super = isinstance(n.value, ast.Call) and getattr(n.value.func, "id", "") == "super"
                if through_super or _root(n.value) in foreign or n.attr not in own:
                    names.append(n.attr)
            elif isinstance(n, ast.Call) and getattr(n.func, "id", "") in ("getattr", "setattr", "hasattr") and \
                    len(n.args) > 1 and isinstance(n.args[1], ast.Constant) and _private(str(n.args[1].value)) and \
                    n.args[1].value not in own:
                names.append(n.args[1].value)
            elif isinstance(n, (ast.Import, ast.ImportFrom)) and not getattr(n, "level", 0):
                modules = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
                names += [m for m in modules if not m.startswith(OWN) and m.split(".")[0] not in own
                          and any(map(_private, m.split(".")))]
                if isinstance(n, ast.ImportFrom) and not (n.module or "").startswith(OWN):
                    names += [a.name for a in n.names if _private(a.name)]
            for name in names:
                found.setdefault(name, set()).add(f"{path}:{n.lineno}")
    return found


def test_private_names_of_other_libraries_are_used_in_their_door_only():
    uses = private_uses(_sources())
    outside = {name: sorted(p for p in places if p.split(":")[0] not in DOORS) for name, places in uses.items()}
    outside = {name: places for name, places in outside.items() if places}
    assert not outside, f"private names of other libraries outside common/compat/ (put each behind its door): {outside}"
    # the scan sees them where they are: every door uses some, and the forkserver's client state is found
    assert {p.split(":")[0] for places in uses.values() for p in places} == DOORS
    assert {"_forkserver_pid", "_stop", "_run_exitfuncs", "_registry", "_attn_implementation", "_C",
            "_init_executor"} <= set(uses)


def test_a_private_name_used_elsewhere_is_found():
    sample = ast.parse("import atexit\nfrom multiprocessing import forkserver\natexit._clear()\n"
                       "forkserver._forkserver._stop()\nconfig._attn_implementation = 'x'\n"
                       "class E(Base):\n    def go(self):\n        super()._init_executor()\n"
                       "from torch._C import _set\n")
    assert set(private_uses({"sample.py": sample})) == {"_clear", "_forkserver", "_stop", "_attn_implementation",
                                                           "_init_executor", "torch._C", "_set"}


@pytest.mark.parametrize("door", ["python", "torch", "transformers", "vllm"])
def test_each_door_finds_its_names_in_the_installed_version(door):
    import importlib

    if door == "vllm":
        from common.explorer.engine import vllm_available

        if not vllm_available()[0]:
            pytest.skip("vllm does not import here")
    module = importlib.import_module(f"common.compat.{door}")
    assert module.check() == [], f"common/compat/{door}.py: the installed version moved {module.check()}"
