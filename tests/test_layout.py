"""The seams, checked: imports point one way, the trainer does not know algorithms by name, each algorithm's loss
is one function, the entry scripts stay short, and the docs stay inside the repository."""

import os
import re
import subprocess
import sys

from common.trainer.losses import ALGOS
from tests.conftest import ROOT

TRAINER_SIDE = ("common.trainer.trainer", "common.trainer.critic", "common.trainer.losses", "common.trainer.parallel", "common.trainer.filters")


def test_explorer_side_never_imports_the_trainer_side():
    code = ("import sys, common.explorer.explorer, common.tasks, rewards, rewards.pool; "
            f"print([m for m in {TRAINER_SIDE!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_trainer_knows_no_algorithm_by_name():
    source = open(os.path.join(ROOT, "common", "trainer", "trainer.py")).read()
    for name in ALGOS:
        assert not re.search(rf"""["']{name}["']""", source), f"common/trainer/trainer.py compares with {name!r}"


def test_each_algorithm_is_one_registered_function():
    source = open(os.path.join(ROOT, "common", "trainer", "losses.py")).read()
    for name, algo in ALGOS.items():
        assert len(re.findall(rf"^def {algo.loss.__name__}\(", source, re.M)) == 1, name


def test_entry_scripts_stay_short():
    for script in ("train_sync.py", "train_offpolicy.py", "train_async.py"):
        assert sum(1 for _ in open(os.path.join(ROOT, script))) <= 200, script


def test_docs_link_only_inside_the_repository():
    for doc in ("README.md", os.path.join("docs", "DESIGN.md")):
        text = open(os.path.join(ROOT, doc)).read()
        for link in re.findall(r"\]\(([^)#]+)", text):
            if link.startswith("http"):
                continue
            target = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), link))
            assert target.startswith(ROOT + os.sep) and os.path.exists(target), f"{doc}: broken link {link}"
