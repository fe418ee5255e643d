"""The house, checked: no import circle, imports that point one way by folder (the explorer and the trainer never
import each other), the layout map of docs/DESIGN.md true to the tree and to each module's docstring, a README a
newcomer reads in minutes, the trainer knowing no algorithm by name, short entry scripts, and docs and docstrings
that name only paths that exist."""

import ast
import os
import re
import subprocess
import sys

from common.trainer.losses import ALGOS
from tests.conftest import ROOT

# Folders (module prefixes), lowest first: a module may import its own layer and the ones below it.
LAYERS = [
    ("common.knobs", "common.runtime", "common.compat"),
    ("common.experience", "common.model", "common.vlm", "common.weight_sync", "common.buckets", "common.lora",
     "common.arithmetic"),
    ("rewards",),
    ("common.envs",),
    ("common.tasks",),
    ("common.explorer", "common.trainer"),
    ("common.checks", "common.cli", "common.config", "common.memory", "common.placement", "common.preflight",
     "common.run"),
    ("train_sync", "train_offpolicy", "train_async", "eval"),
]
UPWARD_ALLOWED: set[tuple[str, str]] = set()  # none runs back up
SIDES = ("common.explorer", "common.trainer")  # one layer, and never import each other


def project_modules() -> dict[str, str]:
    out = {}
    for top in ("common", "rewards"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel.removesuffix(".__init__")] = os.path.join(folder, f)
    for script in ("train_sync", "train_offpolicy", "train_async", "eval"):
        out[script] = os.path.join(ROOT, script + ".py")
    return out


def imports(modules: dict[str, str]) -> set[tuple[str, str]]:
    """(importer, imported) pairs among the project's modules, function-local imports included."""
    edges = set()
    for name, path in modules.items():
        for node in ast.walk(ast.parse(open(path).read())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # relative ones too: `from . import x` counts like any other
                package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
                module = ".".join(filter(None, (base, node.module)))
                targets = [module] + [f"{module}.{a.name}" for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add((name, target))
    return edges


def folder(module: str) -> tuple[int, str]:
    """(layer index, folder prefix) of a module."""
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if module == prefix or module.startswith(prefix + "."):
                return i, prefix
    raise AssertionError(f"{module} is in no layer of tests/test_layout.py: put it in the folder of its side")


def test_no_import_circle():
    modules = project_modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for a, b in imports(modules):
        # A package's __init__ importing its own submodules (a registry) is not a circle.
        if not (b.startswith(a + ".") or a.startswith(b + ".") and b.count(".") == a.count(".") - 1):
            graph[a].add(b)
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for n in graph[m]:
            assert state.get(n) != 1, "import circle: " + " -> ".join(path + [m, n])
            if n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_imports_point_one_way_by_folder():
    upward, sideways = set(), set()
    for a, b in imports(project_modules()):
        (la, fa), (lb, fb) = folder(a), folder(b)
        if lb > la:
            upward.add((fa, fb))
        elif fa != fb and {fa, fb} == set(SIDES):
            sideways.add((a, b))
    assert not sideways, f"the explorer and the trainer import each other: {sorted(sideways)}"
    assert upward <= UPWARD_ALLOWED, f"imports that run back up: {sorted(upward - UPWARD_ALLOWED)}"


def test_explorer_side_never_loads_the_trainer_side():
    code = ("import sys, common.explorer.explorer, common.tasks, rewards, rewards.pool; "
            "print(sorted(m for m in sys.modules if m.startswith('common.trainer')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_lowest_layer_names_no_field_of_a_config():
    """common/knobs.py checks every config's fields without naming one: ranges live with the fields (each config
    class's RANGES), so a schedule's own flag is range-checked without editing the layer below it."""
    from common.knobs import field_types
    import train_async, train_offpolicy, train_sync

    source = open(os.path.join(ROOT, "common", "knobs.py")).read()
    fields = set().union(*(field_types(m.Args) for m in (train_sync, train_offpolicy, train_async)))
    named = sorted(f for f in fields if re.search(rf"""["']{f}["']""", source))
    assert not named, f"common/knobs.py names config fields: {named}"
    assert {"num_explorers", "sync_interval"} <= set(train_async.Args.RANGES)  # the schedule's own, in its Args


def layout_map() -> dict[str, str]:
    """docs/DESIGN.md's layout map: module path -> its description."""
    text = open(os.path.join(ROOT, "docs", "DESIGN.md")).read()
    block = re.search(r"## Layout\n.*?```\n(.*?)```", text, re.S).group(1)
    listed, stack = {}, []
    for line in block.splitlines():
        if not line.strip() or line.startswith("train_"):
            continue
        indent = (len(line) - len(line.lstrip())) // 2
        head, *description = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        stack = stack[:indent]
        if head.endswith("/"):
            stack.append(head)
            continue
        for name in head.split(", "):
            listed["".join(stack) + name] = " ".join(description)
    return listed


def test_design_layout_map_matches_the_tree():
    listed = set(layout_map())
    tree = {os.path.relpath(p, ROOT) for m, p in project_modules().items()
            if not m.startswith("train_") and os.path.getsize(p) > 0}  # empty __init__.py: package markers
    assert not listed - tree, f"docs/DESIGN.md lists modules that do not exist: {sorted(listed - tree)}"
    assert not tree - listed, f"docs/DESIGN.md's layout misses: {sorted(tree - listed)}"


def _normal(text: str) -> str:
    return " ".join(text.replace("`", "").lower().split()).rstrip(".")


def test_design_layout_map_says_what_each_module_says_of_itself():
    """Each description in the map is a phrase of the module's own docstring (its first paragraph): a module that
    changes what it is changes its docstring, and this points at the map line that no longer says so."""
    wrong = []
    for path, description in layout_map().items():
        doc = ast.get_docstring(ast.parse(open(os.path.join(ROOT, path)).read())) or ""
        if not description or _normal(description) not in _normal(doc.split("\n\n")[0]):
            wrong.append(f"{path}: map says {description!r}; its docstring begins {doc.splitlines()[:1]}")
    assert not wrong, "docs/DESIGN.md's layout map: use a phrase of each module's first docstring paragraph:\n" + \
        "\n".join(wrong)


# A path the repository's text names that may be absent: written by the code that names it, or a user's own file.
WRITTEN = ("bench/out/",                 # benchmark outputs
           "tests/torch_api.json",       # written by tests/test_torch_api.py --write where that torch is installed
           "rewards/__pycache__",        # the sandbox launcher's compiled form
           "common/envs/countdown.py",   # docs/USAGE.md's example of a new environment (tests/test_envs.py writes it)
           "configs/X.yaml")             # a placeholder
PATH = re.compile(r"(?<![\w/.<{-])((?:common|rewards|tests|bench|docs|configs|examples)/[\w./-]*[\w/])")
DOTTED = re.compile(r"(?<![\w./])(common\.[a-z_][\w.]*\w)")  # rewards.<x> is as often a variable


def _texts():
    """Every doc, source and config file of the repository: (relative path, text)."""
    paths = ["README.md", "Makefile", *(f for f in os.listdir(ROOT) if f.endswith(".py"))]
    for top in ("common", "rewards", "bench", "tests", "docs", "configs", "examples"):
        for folder_, _, files in os.walk(os.path.join(ROOT, top)):
            paths += [os.path.relpath(os.path.join(folder_, f), ROOT) for f in files
                      if f.endswith((".py", ".md", ".yaml", ".sh"))]
    return [(p, open(os.path.join(ROOT, p), encoding="utf-8").read()) for p in sorted(set(paths))
            if os.path.exists(os.path.join(ROOT, p))]


def _exists(path: str) -> bool:
    """path, path.py, or path with its trailing `.attribute`s taken off (common/trainer/losses.ALGOS)."""
    while True:
        if any(os.path.exists(os.path.join(ROOT, p)) for p in (path, path + ".py")):
            return True
        if "." not in os.path.basename(path):
            return False
        path = path.rsplit(".", 1)[0]


def _module_exists(dotted: str) -> bool:
    """A dotted module name (an attribute may follow): its longest module prefix exists, and at most one attribute
    follows it."""
    parts = dotted.split(".")
    k = len(parts)
    while k and not (os.path.exists(os.path.join(ROOT, *parts[:k]) + ".py") or
                     os.path.isdir(os.path.join(ROOT, *parts[:k]))):
        k -= 1
    return k >= 2 and len(parts) - k <= 1


def test_docs_and_docstrings_name_only_paths_that_exist():
    missing = []
    for path, text in _texts():
        for n, line in enumerate(text.splitlines(), 1):
            missing += [f"{path}:{n}: {m}" for m in PATH.findall(line) if not m.startswith(WRITTEN) and not _exists(m)]
            missing += [f"{path}:{n}: {m}" for m in DOTTED.findall(line) if not _module_exists(m)]
    assert not missing, "names of files or modules that do not exist:\n" + "\n".join(missing)


def test_readme_reads_in_minutes():
    assert sum(1 for _ in open(os.path.join(ROOT, "README.md"))) <= 200


def test_no_module_knows_an_algorithm_by_name():
    """What an algorithm needs (a critic, groups) comes from its ALGOS line, never from comparing --algo's name."""
    for path in ("common/trainer/trainer.py", "common/trainer/filters.py", "common/trainer/critic.py"):
        source = open(os.path.join(ROOT, path)).read()
        for name in ALGOS:
            assert not re.search(rf"""["']{name}["']""", source), f"{path} names {name!r}"
    for path in ("common/config.py", "common/checks.py"):
        source = open(os.path.join(ROOT, path)).read()
        assert not re.search(r"""(==|!=|\bin)\s*\(?["'](""" + "|".join(ALGOS) + ")", source), f"{path} compares --algo"


def test_each_algorithm_is_one_registered_function():
    source = open(os.path.join(ROOT, "common", "trainer", "losses.py")).read()
    for name, algo in ALGOS.items():
        assert len(re.findall(rf"^def {algo.loss.__name__}\(", source, re.M)) == 1, name


def test_entry_scripts_stay_short():
    for script, most in (("train_sync.py", 200), ("train_offpolicy.py", 200), ("train_async.py", 150),
                         ("eval.py", 200)):
        assert sum(1 for _ in open(os.path.join(ROOT, script))) <= most, script


def test_entry_scripts_say_who_waits_for_whom_and_leave_the_machinery_to_the_hand_overs():
    """The cores' lending belongs to the objects that hand over (TrainerRun.get, Explorer.hand_over, Stream)."""
    named = {(a, b) for a, b in imports(project_modules()) if a.startswith("train_") and b == "common.runtime.cores"}
    assert not named, f"entry scripts that import common.runtime.cores: {sorted(named)}"


def test_the_stream_and_evaluations_are_given_the_explorers_parts_never_the_explorer():
    """No pointer back to the Explorer: Stream and Evaluation are built from its `Parts` (common/explorer/parts.py),
    so neither can read or write the fields of the explorer that made them."""
    for name in ("streaming", "evaluation", "parts"):
        tree = ast.parse(open(os.path.join(ROOT, "common", "explorer", f"{name}.py")).read())
        held = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.arg) and n.arg == "explorer"
                or isinstance(n, ast.Name) and n.id in ("explorer", "Explorer")
                or isinstance(n, ast.Attribute) and n.attr == "explorer" and getattr(n.value, "id", "") == "self"]
        assert not held, f"common/explorer/{name}.py holds the explorer at lines {held}"


def test_docs_link_only_inside_the_repository():
    for doc in ("README.md", "rewards/THREATS.md", *(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")))):
        if not doc.endswith(".md"):
            continue
        text = open(os.path.join(ROOT, doc)).read()
        for link in re.findall(r"\]\(([^)#]+)", text):
            if link.startswith("http"):
                continue
            target = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), link))
            assert target.startswith(ROOT + os.sep) and os.path.exists(target), f"{doc}: broken link {link}"
