"""Evaluation outside and inside runs: the benchmark presets (common/tasks/presets.py) read from local files in the
Hub datasets' schemas (nothing is downloaded), eval.py end to end with the tiny model, and --eval-samples in a run."""

import json

import pytest

from common.tasks import build_tasksets, evaluation_tasks
from rewards import score

# One row of each preset in its Hub dataset's columns (openai/gsm8k main, HuggingFaceH4/MATH-500,
# HuggingFaceH4/aime_2024, opencompass/AIME2025), with a right and a wrong final answer.
PRESET_ROWS = {
    "gsm8k": ({"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
                           "May. How many clips did Natalia sell altogether in April and May?",
               "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                         "altogether in April and May.\n#### 1,072"}, "\\boxed{1072}", "\\boxed{72}"),
    "math500": ({"problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
                 "solution": "...", "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus",
                 "level": 2, "unique_id": "test/precalculus/807.json"},
                "so the answer is \\boxed{(3, \\frac{\\pi}{2})}", "\\boxed{(3, \\pi)}"),
    "aime2024": ({"id": 60, "problem": "Every morning Aya goes for a 9-kilometer-long walk ...", "solution": "...",
                  "answer": "204", "url": "https://artofproblemsolving.com", "year": "2024"},
                 "Answer: 204", "Answer: 240"),
    "aime2025": ({"question": "Find the sum of all integer bases $b>9$ for which $17_b$ is a divisor of $97_b$.",
                  "answer": "70"}, "The sum is \\boxed{70}.", "The sum is \\boxed{16}."),
}


@pytest.mark.parametrize("name", sorted(PRESET_ROWS))
def test_preset_reads_a_local_file_and_scores_right_1_and_wrong_0(name, tmp_path):
    row, right, wrong = PRESET_ROWS[name]
    path = tmp_path / f"{name}.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    tasks = evaluation_tasks(f"{name}:{path}", 0, seed=0)
    assert len(tasks) == 2 and tasks[0]["id"] == f"{name}-0" and tasks[1]["id"] == f"{name}-1"
    assert "\\boxed{}" in tasks[0]["prompt"] and row.get("question", row.get("problem")) in tasks[0]["prompt"]
    assert score(right, tasks[0]).score == 1.0
    assert score(wrong, tasks[0]).score == 0.0
    assert score("I do not know.", tasks[0]).score == 0.0


def test_arith_preset_is_a_runs_held_out_split():
    tasks = evaluation_tasks("arith", 0, seed=3)
    assert tasks == build_tasksets("arith", None, 1, 48, 3)[1]  # what a run with --seed 3 holds out
    assert score(f"{tasks[0]['answer']}. Answer: {tasks[0]['answer']}", tasks[0]).score == 1.0
    assert score(f"Answer: {int(tasks[0]['answer']) + 1}", tasks[0]).score == 0.0
    assert len(evaluation_tasks("arith", 5, seed=3)) == 5


def test_preset_errors_are_one_line(tmp_path, monkeypatch):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps({"question": "q", "solution": "#### 4"}) + "\n")
    with pytest.raises(SystemExit, match=r"row 0: missing column 'answer'"):
        evaluation_tasks(f"gsm8k:{path}", 0, seed=0)
    path.write_text(json.dumps({"question": "q", "answer": "4"}) + "\n")
    with pytest.raises(SystemExit, match=r"does not match"):
        evaluation_tasks(f"gsm8k:{path}", 0, seed=0)
    path.write_text("[1, 2]\n")
    with pytest.raises(SystemExit, match=r"gsm8k.jsonl: row 0: a row must be an object"):
        evaluation_tasks(f"gsm8k:{path}", 0, seed=0)
    with pytest.raises(SystemExit, match="never trained on"):
        build_tasksets("math500", None, 1, 4, 0)
    # offline and not cached: the local copy under $TANDEM_CACHE/datasets, else an error naming both ways
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(SystemExit, match=r"no local copy at .*aime2025.jsonl"):
        evaluation_tasks("aime2025", 0, seed=0)
    (tmp_path / "cache" / "datasets").mkdir(parents=True)
    (tmp_path / "cache" / "datasets" / "aime2025.jsonl").write_text(json.dumps(PRESET_ROWS["aime2025"][0]) + "\n")
    tasks = evaluation_tasks("aime2025", 0, seed=0)
    assert len(tasks) == 1 and score("\\boxed{70}", tasks[0]).score == 1.0


def fake_run(folder, **config) -> str:
    """A finished run's folder as the trainer leaves it: config.json (with its schedule) and final/, here the tiny
    model's weights saved as a servable folder (the same weights as --model tiny)."""
    from common.model import save_servable_tiny

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"schedule": "sync", **config}))
    save_servable_tiny(str(folder / "final"))
    return str(folder)


def test_eval_py_compares_two_models_on_the_same_tasks_and_seeds(tmp_path):
    """`--compare A B`: the tiny model against a run whose final/ holds the same weights. With one new token a
    response is one byte, whose code point has the parity asked for about half the time: mixed outcomes. The same
    tasks and sampling seed for both give identical samples, so B - A is exactly 0 with a zero-width interval, and
    the run's sampling (its temperature) is what both were sampled at."""
    from tests.conftest import run_in_process

    run = fake_run(tmp_path / "run", temperature=0.9, top_p=1.0, max_new_tokens=1)
    out = tmp_path / "eval"
    proc = run_in_process("eval.py", "--compare", "tiny", run, "--taskset", "parity", "--size", "6", "--samples", "4",
                          "--engine", "hf", "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "eval.json").read_text())
    assert report["sampling"] == {"temperature": 0.9, "top_p": 1.0, "max_new_tokens": 1}
    assert report["models"] == {"A": "tiny", "B": run}
    a, b = (report["results"]["parity"][m] for m in ("A", "B"))
    assert set(a) == {"mean@4", "pass@2", "pass@4", "maj@2", "maj@4"}
    assert 0 < a["mean@4"]["value"] < 1 and a["mean@4"]["lo"] < a["mean@4"]["value"] < a["mean@4"]["hi"]
    assert a["pass@4"]["value"] >= a["pass@2"]["value"] >= a["mean@4"]["value"]
    assert a == b and report["per_task"]["A"] == report["per_task"]["B"]
    assert report["difference"]["parity"]["mean@4"] == {"value": 0.0, "lo": 0.0, "hi": 0.0}
    assert "| parity | 6 | mean@4 |" in proc.stdout and "| A: tiny [95% interval] |" in proc.stdout
    assert (out / "eval.md").read_text().strip() in proc.stdout


def test_eval_py_bad_input_is_one_line_before_any_model_loads(tmp_path):
    from tests.conftest import run_in_process

    for flags, message in ((["--compare", "tiny"], "--compare takes two models"),
                           (["--samples", "0"], "--samples must be >= 1"),
                           (["--taskset", "nope.jsonl"], "no such file"),
                           (["--model", str(tmp_path)], "no config.json")):
        proc = run_in_process("eval.py", *flags, "--out-dir", str(tmp_path / "eval"))
        assert proc.returncode == 1 and message in proc.stderr, (flags, proc.stderr[-1000:])
        assert "Traceback" not in proc.stderr


def test_a_run_with_eval_samples_reports_intervals(tmp_path):
    """--eval-samples 4: every evaluation of the run reports mean@4 (eval/accuracy), pass@4 and maj@4 with
    intervals, in metrics.jsonl and summary.json, and the run's last line shows the interval."""
    from tests.conftest import TINY, run_in_process

    out = tmp_path / "run"
    proc = run_in_process("train_sync.py", *TINY, "--steps", "1", "--eval-every", "1", "--eval-samples", "4",
                          "--max-new-tokens", "1", "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    for name in ("accuracy", "pass@4", "maj@4"):
        assert row[f"eval/{name}_lo"] <= row[f"eval/{name}"] <= row[f"eval/{name}_hi"]
    assert row["eval/samples"] == 4 and 0 < row["eval/accuracy"] < 1
    summary = json.loads((out / "summary.json").read_text())
    lo, hi = summary["eval_after_interval"]
    assert lo <= summary["eval_after"] <= hi and summary["eval_before_interval"] is not None
    assert f"held-out mean@4 {summary['eval_before']:.3f} [" in proc.stdout
