"""Every command of the README's "Running" block, run as written in a fresh copy of the repository.

The copy holds what a clone holds (git's tracked and unignored files: no runs/, no caches); its `.venv` is the
environment running this test, and each command runs through bash after the block's own activation line. To keep
it quick every training command gets the tiny model and 1 step (2 when it resumes), plus small batch flags,
`--no-plots` and `--engine hf` where it does not set them itself; everything else stays as the README writes it.
`--engine vllm` commands are skipped (and said so) where vLLM cannot be imported. The flag lines of the block after
it are parsed and validated with every entry script. An `eval.py` command gets the tiny model in place of `default`,
2 tasks per taskset, 8 new tokens and `--engine hf`, and runs after the command that makes the run it evaluates.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORCED = {"--model": "tiny"}  # always replaced (appended last: the last occurrence of a flag wins)
VISION_MODELS = ("default-vlm", "tiny-vlm")  # ... by tiny-vlm, the tiny model's vision-language twin
# Added when the command does not set them. `--engine hf` too: starting vLLM costs ~25 s a run on 2 cores, so only
# the commands that name `--engine vllm` start it (test_vllm_runs.py runs every schedule with vLLM). No PNGs: the
# outputs are checked where they are tested (tests/test_train_sync.py).
SMALL = {"--tasks-per-step": "2", "--samples-per-task": "2", "--max-new-tokens": "20", "--eval-size": "2",
         "--eval-every": "0", "--lr": "1e-3", "--timeout-s": "300", "--engine": "hf",
         "--num-threads": "1", "--no-plots": None}  # None: a flag without a value
ENTRY = ("python", "torchrun")
EVAL_SMALL = {"--size": "2", "--max-new-tokens": "8", "--engine": "hf"}  # eval.py's own small flags


def running_blocks(readme: str) -> list[list[str]]:
    """The logical lines (continuations joined, blank and comment lines left out) of each ```bash block under
    '## Running': the commands first, then the flag lines to add to any command."""
    section = readme.split("\n## Running\n", 1)[1].split("\n## ", 1)[0]
    return [[line for line in block.replace("\\\n", " ").splitlines() if shlex.split(line, comments=True)]
            for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def running_block(readme: str) -> list[str]:
    return running_blocks(readme)[0]


def flag_lines(readme: str) -> list[list[str]]:
    return [shlex.split(line, comments=True) for line in running_blocks(readme)[1]]


def readme_commands() -> tuple[list[str], list[list[str]]]:
    """(activation line's words, each command's words) of the Running block."""
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = [shlex.split(line, comments=True) for line in running_block(f.read())]
    activate = [words for words in lines if words[0] == "source"]
    commands = [words for words in lines if words[0] != "source"]
    assert len(activate) == 1, "the Running block starts by activating the venv"
    unknown = [shlex.join(c) for c in commands if c[0] not in ENTRY]
    assert not unknown, f"Running block commands this test does not know how to run: {unknown}"
    return activate[0], commands


def flag_value(words: list[str], flag: str) -> str | None:
    return words[words.index(flag) + 1] if flag in words else None


def is_eval(words: list[str]) -> bool:
    return words[:2] == ["python", "eval.py"]


def needs_run(words: list[str], index: int) -> str | None:
    """The out_dir of the run a command needs made first: the one it resumes, or the run an eval.py command
    evaluates (a runs/NAME path among its words)."""
    if "--resume" in words:
        return small_run(words, index)[1]
    if is_eval(words):
        return next(("/".join(w.split("/")[:2]) for w in words if w.startswith("runs/")), None)
    return None


def small_run(words: list[str], index: int) -> tuple[list[str], str | None, int]:
    """(the command with the test's flags, its out_dir, its steps: 0 for eval.py); --help runs as written."""
    if "--help" in words:
        return words, None, 0
    if is_eval(words):
        extra = [w for flag, value in EVAL_SMALL.items() if flag not in words for w in (flag, value)]
        out_dir = flag_value(words, "--out-dir") or f"runs/readme-{index}"
        extra += [] if "--out-dir" in words else ["--out-dir", out_dir]
        return ["tiny" if w == "default" else w for w in words] + extra, out_dir, 0
    steps = 2 if "--resume" in words else 1
    extra = [w for flag, value in SMALL.items() if flag not in words
             for w in ((flag,) if value is None else (flag, value))]
    out_dir = flag_value(words, "--out-dir")
    if out_dir is None:  # parallel runs of one schedule would pick the same runs/<schedule>-<second>/
        out_dir = f"runs/readme-{index}"
        extra += ["--out-dir", out_dir]
    forced = [w for flag, value in FORCED.items() for w in (flag, value)] + ["--steps", str(steps)]
    if flag_value(words, "--model") in VISION_MODELS:
        forced[forced.index("--model") + 1] = "tiny-vlm"
    return words + extra + forced, out_dir, steps


def same_run_key(words: list[str]) -> tuple[str, ...]:
    """What a command runs once the test's flags are in: its words less --out-dir and the flags FORCED replaces
    (e.g. `python train_sync.py` and `python train_sync.py --model tiny --steps 3 --out-dir runs/x` would be one run)."""
    line, _, _ = small_run(words, 0)
    drop = {"--out-dir", "--steps", *FORCED}
    out, skip = [], False
    for w in line:
        if skip:
            skip = False
        elif w in drop:
            skip = True
        else:
            out.append(w)
    return tuple(out)


def fresh_copy(dest: str) -> None:
    """What `git clone` would give (tracked and unignored files of this tree), with .venv -> this environment."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True, timeout=60).stdout.decode().split("\0")
    for rel in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, rel)):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), os.path.join(dest, rel))
    if sys.prefix != sys.base_prefix:  # running inside a venv: the clone's .venv is that one
        os.symlink(sys.prefix, os.path.join(dest, ".venv"))
    else:  # no venv: an activate script that puts this interpreter's bin folder first
        os.makedirs(os.path.join(dest, ".venv", "bin"))
        with open(os.path.join(dest, ".venv", "bin", "activate"), "w") as f:
            f.write(f'export PATH="{os.path.dirname(sys.executable)}:$PATH"\n')


def vllm_importable() -> bool:
    from common.explorer.engine_vllm import vllm_available

    return vllm_available()[0]


def test_running_block_parses_and_every_command_is_known():
    activate, commands = readme_commands()
    assert activate == ["source", ".venv/bin/activate"]
    assert len(commands) >= 10 and any(c[0] == "torchrun" for c in commands)
    resumed = [flag_value(c, "--out-dir") for c in commands if "--resume" in c]
    made = [flag_value(c, "--out-dir") for c in commands if "--resume" not in c]
    assert all(d in made for d in resumed), "a --resume command continues a run the block made before it"


@pytest.mark.parametrize("script", ["train_sync", "train_offpolicy", "train_async"])
def test_every_flag_line_is_valid_for_every_schedule(script, tmp_path, monkeypatch):
    """The flags block: each line parses and passes validation (common/knobs.py ranges, combinations) on top of the
    tiny model's defaults, with each entry script's Args, and changes the configuration; a renamed or removed flag
    fails here."""
    import importlib

    from common.cli import parse_args

    with open(os.path.join(ROOT, "README.md")) as f:
        lines = flag_lines(f.read())
    assert len(lines) >= 6 and all(line[0].startswith("--") for line in lines), lines
    monkeypatch.chdir(ROOT)  # paths in the lines are relative to the repository, as for the commands
    cls = importlib.import_module(script).Args
    tiny = ["--model", "tiny", "--out-dir", str(tmp_path / "run")]
    base = parse_args(cls, tiny)
    for line in lines:
        args = parse_args(cls, [*tiny, *line])
        assert args != base, f"{shlex.join(line)} changes nothing"


@pytest.mark.timeout(1200)
def test_every_running_command_works_in_a_fresh_clone(tmp_path):
    activate, commands = readme_commands()
    clone = str(tmp_path / "clone")
    fresh_copy(clone)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    skipped = [shlex.join(c) for c in commands if flag_value(c, "--engine") == "vllm" and not vllm_importable()]

    def run(index: int, words: list[str]) -> tuple[str, subprocess.CompletedProcess, float]:
        line, out_dir, steps = small_run(words, index)
        script = f"{shlex.join(activate)} && {shlex.join(line)}"
        start = time.time()
        proc = subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True,
                              timeout=600)
        return script, proc, time.time() - start

    jobs, same = [], {}
    for i, c in enumerate(commands):
        if shlex.join(c) in skipped:
            continue
        twin = next((j for j, d in enumerate(commands) if j != i and same_run_key(d) == same_run_key(c)
                     and ("--out-dir" in d, -j) > ("--out-dir" in c, -i)), None)
        if twin is not None:  # the same run as another command of the block: that one runs it
            same[shlex.join(c)] = shlex.join(commands[twin])
            continue
        jobs.append((i, c))
    # A --resume or eval.py command runs right after the run it needs, in the same thread; those chains start first.
    # Three at a time: a tiny run keeps about half a core busy (its processes wait for each other).
    then = [(i, c) for i, c in jobs if needs_run(c, i)]
    chains = [[(i, c), *[(k, e) for k, e in then if needs_run(e, k) == small_run(c, i)[1]]]
              for i, c in jobs if not needs_run(c, i)]
    chains += [[job] for job in then if not any(job in chain for chain in chains)]
    chains.sort(key=len, reverse=True)
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        for chain, chain_results in zip(chains, pool.map(lambda chain: [run(*job) for job in chain], chains)):
            results.update({i: result for (i, _), result in zip(chain, chain_results)})
    failures, checked = [], set()
    for i, words in reversed(jobs):  # a run continued by --resume is checked once, after its last command
        script, proc, seconds = results[i]
        print(f"{seconds:5.1f}s  {shlex.join(words)}")
        _, out_dir, steps = small_run(words, i)
        if out_dir in checked and proc.returncode == 0:
            continue
        checked.add(out_dir)
        if proc.returncode != 0:
            failures.append(f"{script}\n  exit {proc.returncode}: {proc.stderr.strip()[-1500:]}")
        elif out_dir is None:
            if "usage" not in proc.stdout.lower():
                failures.append(f"{script}\n  printed no usage")
        elif is_eval(words):
            scores = json.load(open(os.path.join(clone, out_dir, "eval.json")))["results"]
            if not scores or not all("lo" in metric for by_model in scores.values() for model, metrics in
                                     by_model.items() if model != "tasks" for metric in metrics.values()):
                failures.append(f"{script}\n  eval.json holds no scores with intervals: {scores}")
        else:
            summary = json.load(open(os.path.join(clone, out_dir, "summary.json")))
            with open(os.path.join(clone, out_dir, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            if summary["steps"] != steps or [r["step"] for r in rows] != list(range(1, steps + 1)):
                failures.append(f"{script}\n  summary steps {summary['steps']}, metrics steps "
                                f"{[r['step'] for r in rows]}, expected {steps}")
    for line in skipped:
        print(f"skipped (vLLM cannot be imported here): {line}")
    for line, twin in same.items():
        print(f"same run as `{twin}`: {line}")
    assert not failures, "README Running commands that fail:\n" + "\n".join(failures)
