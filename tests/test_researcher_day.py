"""The researcher's day: coupled flags, --eval-every 0, the LR schedule (its resume: test_train_sync.py), logged
completions (samples.jsonl, W&B table), reward.png on a step axis, timeline.trace.json, Hub datasets offline."""

import glob
import json
import os

import pytest

from common.runtime.metrics import plot_reward_curve, read_metrics, read_timeline, reward_curve_points
from common.runtime.trace import chrome_trace
from tests.conftest import TINY, assert_trained, run_in_process, run_script
from tests.test_train_sync import _one_line_error


# ----------------------------------------------------------------------------------------------- coupled flags
def test_coupled_flags_resolve_themselves():
    from common.cli import parse_args
    from train_sync import Args

    args = parse_args(Args, ["--tasks-per-step", "4"])  # was: an error about --minibatch-size
    assert (args.minibatch_size, args.micro_batch_size) == (16, 8)
    args = parse_args(Args, ["--tasks-per-step", "1", "--samples-per-task", "3"])
    assert (args.minibatch_size, args.micro_batch_size) == (3, 3)
    args = parse_args(Args, ["--minibatch-size", "4"])
    assert (args.minibatch_size, args.micro_batch_size) == (4, 4)


@pytest.mark.parametrize("argv, fix", [
    (["--tasks-per-step", "2", "--minibatch-size", "16"], "pass --minibatch-size 8 or less"),
    (["--minibatch-size", "4", "--micro-batch-size", "8"], "pass --micro-batch-size 4 or less"),
    (["--warmup-steps", "-1"], "--warmup-steps"),
    (["--lr-scheduler", "step"], "--lr-scheduler"),
    (["--answer-regex", "####"], "needs a group"),
])
def test_remaining_errors_name_the_fix(argv, fix):
    from common.cli import parse_args
    from common.knobs import ConfigError
    from train_sync import Args

    with pytest.raises(ConfigError, match=fix):
        parse_args(Args, argv)


# ----------------------------------------------------------------------------------------------- LR schedule
def test_lr_schedules_warm_up_then_decay():
    import torch

    from common.trainer.lr_schedule import build_lr_scheduler

    def lr_at(name: str, base_lr: float, warmup_steps: int, total_steps: int, step: int) -> float:
        """The learning rate trainer step `step + 1` uses (after `step` steps)."""
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
        scheduler = build_lr_scheduler(optimizer, name, warmup_steps, total_steps)
        for _ in range(step):
            optimizer.step()
            scheduler.step()
        return optimizer.param_groups[0]["lr"]

    assert [lr_at("constant", 1.0, 2, 10, s) for s in (0, 1, 2, 9)] == [0.0, 0.5, 1.0, 1.0]
    assert [lr_at("linear", 1.0, 0, 4, s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    cosine = [lr_at("cosine", 1.0, 1, 5, s) for s in range(6)]
    assert cosine[0] == 0.0 and cosine[1] == 1.0 and cosine[3] == pytest.approx(0.5) and cosine[5] == pytest.approx(0)
    assert all(a >= b for a, b in zip(cosine[1:], cosine[2:]))


# ----------------------------------------------------------------------------------------------- trace
def _assert_valid_trace(trace: dict):
    """The Trace Event Format's JSON object form, as Perfetto and chrome://tracing read it."""
    assert set(trace) >= {"traceEvents"} and isinstance(trace["traceEvents"], list)
    json.dumps(trace)  # plain JSON
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert complete and all(e["ph"] in ("X", "M") for e in trace["traceEvents"])
    for e in complete:
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0 and e["dur"] >= 0 and isinstance(e["args"], dict)
    names = {(e["pid"]) for e in meta if e["name"] == "process_name"}
    assert {e["pid"] for e in complete} <= names
    threads = {(e["pid"], e["tid"]) for e in meta if e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in complete} <= threads
    by_thread = {}
    for e in complete:
        by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    for evs in by_thread.values():  # no two events of one thread overlap
        evs.sort(key=lambda e: e["ts"])
        for a, b in zip(evs, evs[1:]):
            assert a["ts"] + a["dur"] <= b["ts"], (a, b)
    return complete, meta


def test_chrome_trace_lanes_and_overlaps():
    events = [
        {"process": "trainer0", "phase": "train", "start": 10.0, "end": 12.0, "step": 1},
        {"process": "trainer0", "phase": "sync-in-flight", "start": 11.5, "end": 13.0},
        {"process": "trainer0", "phase": "train", "start": 12.0, "end": 14.0, "step": 2},
        {"process": "explorer0", "phase": "rollout", "start": 9.0, "end": 11.0, "step": 1},
        {"process": "buffer", "phase": "buffer", "start": 11.0, "end": 12.5, "batch": "0-1"},
        {"process": "buffer", "phase": "buffer", "start": 11.2, "end": 13.5, "batch": "0-2"},  # overlaps: 2nd thread
    ]
    complete, meta = _assert_valid_trace(chrome_trace(events))
    lanes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert list(lanes.values()) == ["Explorer 0", "Buffer", "Trainer 0"]
    rollout = next(e for e in complete if e["name"] == "rollout")
    assert rollout["ts"] == 0 and rollout["dur"] == 2_000_000 and rollout["args"] == {"step": 1}
    assert len({e["tid"] for e in complete if e["name"] == "buffer"}) == 2
    trains = [e for e in complete if e["name"] == "train"]
    assert trains[0]["tid"] == trains[1]["tid"] != next(e["tid"] for e in complete if e["name"] == "sync-in-flight")


# ----------------------------------------------------------------------------------------------- one tiny run
def test_samples_wandb_table_plot_trace_and_no_eval(tmp_path):
    """--eval-every 0 (TINY) runs no evaluation at all; completions land in samples.jsonl and a W&B table (offline
    --track with a run name and tags); reward.png, timeline.trace.json are written."""
    out = tmp_path / "run"
    proc = run_in_process("train_sync.py", *TINY, "--steps", "3", "--out-dir", str(out), "--log-samples-every", "2",
                          "--log-samples", "2", "--track", "--run-name", "day-one", "--wandb-tags", "tiny", "test",
                          "--plots", env={"WANDB_MODE": "offline", "WANDB_API_KEY": "", "WANDB_SILENT": "true"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(str(out))
    assert any(r["loss"] != 0 for r in rows) and any(r["grad_norm"] > 0 for r in rows)  # it trained
    # No evaluation at all: none before, none after, none in the timeline; the summary says so.
    assert not [e for e in read_timeline(str(out)) if e["phase"] == "eval"]
    assert not any("eval/accuracy" in r for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_before"] is None and summary["eval_after"] is None
    assert summary["evaluation"] == "off (--eval-every 0)"
    assert "no evaluation" in proc.stdout
    # Completions: steps 1 and 3, two rows each, readable text next to reward and version.
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 3, 3]
    for s in samples:
        assert set(s) >= {"prompt", "response", "reward", "version", "task_id"}
        assert "characters" in s["prompt"] and isinstance(s["response"], str) and s["version"] == s["step"] - 1
    # W&B (offline): the table, the run's name and tags.
    run_dirs = glob.glob(str(out / "wandb" / "offline-run-*"))
    assert len(run_dirs) == 1
    tables = glob.glob(os.path.join(run_dirs[0], "files", "media", "table", "samples_*.table.json"))
    assert tables, os.listdir(os.path.join(run_dirs[0], "files"))
    last = max((json.load(open(t)) for t in tables), key=lambda t: len(t["data"]))
    assert "response" in last["columns"] and len(last["data"]) == 4
    record = open(glob.glob(os.path.join(run_dirs[0], "*.wandb"))[0], "rb").read()
    assert b"day-one" in record and b"tiny" in record
    # Plots and trace.
    assert (out / "reward.png").stat().st_size > 10_000
    train, evals = reward_curve_points(str(out))
    assert [x for x, _ in train] == [1, 2, 3] and evals == []
    complete, _ = _assert_valid_trace(json.loads((out / "timeline.trace.json").read_text()))
    assert {"rollout", "train", "sync", "buffer"} <= {e["name"] for e in complete}


def test_reward_curve_plots_a_judged_tasksets_held_out_reward(tmp_path):
    """A judged taskset's accuracy (reward 1) stays 0; its held-out reward mean is what moves, and reward.png has it."""
    rows = [{"step": 1, "reward/mean": 0.3, "eval/version": 0, "eval/accuracy": 0.0, "eval/reward_mean": 0.23},
            {"step": 2, "reward/mean": 0.4, "eval/version": 2, "eval/accuracy": 0.0, "eval/reward_mean": 0.29}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert reward_curve_points(str(tmp_path))[1] == [(0, 0.0), (2, 0.0)]
    assert reward_curve_points(str(tmp_path), "eval/reward_mean")[1] == [(0, 0.23), (2, 0.29)]
    plot_reward_curve(str(tmp_path))
    assert (tmp_path / "reward.png").stat().st_size > 10_000


def test_reward_curve_puts_evaluations_at_their_step(tmp_path):
    out = tmp_path / "run"
    proc = run_in_process("train_sync.py", *TINY, "--steps", "2", "--eval-every", "1", "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_trained(out, steps=2)
    train, evals = reward_curve_points(str(out))
    assert [x for x, _ in train] == [1, 2]
    assert [x for x, _ in evals] == [0, 1, 2]  # before training, after step 1, the final one
    # Every evaluation is kept, also when two reach the trainer between the same two rows (timing-dependent).
    summary = json.loads((out / "summary.json").read_text())
    assert [e["eval/version"] for e in summary["evals"]] == [0, 1, 2]  # the final evaluation too
    assert summary["eval_before"] == summary["evals"][0]["eval/accuracy"]
    assert summary["eval_after"] == summary["evals"][-1]["eval/accuracy"]


def test_two_evaluations_between_rows_are_both_kept():
    """The race behind a lost 'before training' point: the evaluations of versions 0 and 1 reach the trainer
    between the same two rows. Both are kept in summary["evals"], eval_before is version 0's, the row shows the
    newest."""
    from common.runtime.control import Control
    from common.trainer.trainer import TrainerRun

    run = TrainerRun.__new__(TrainerRun)  # only the evaluation bookkeeping, no model
    run.is_main, run.control, run.summary = True, object(), {"eval_before": None, "evals": []}
    row = run._evaluations([Control("eval", 0, {"eval/accuracy": 0.25, "eval/version": 0}),
                            Control("eval", 0, {"eval/accuracy": 0.5, "eval/version": 1})])
    assert row == {"eval/accuracy": 0.5, "eval/version": 1}
    assert run.summary["eval_before"] == 0.25 and [e["eval/version"] for e in run.summary["evals"]] == [0, 1]


# ----------------------------------------------------------------------------------------------- Hub datasets
def save_hub_cache(cache_dir: str, repo_id: str, config: str, splits: dict[str, list[dict]], tmp) -> None:
    """Put a dataset into an HF datasets cache exactly where `load_dataset(repo_id, config)` left it after a
    download, so that offline (HF_DATASETS_OFFLINE=1) the Hub id resolves to it."""
    import datasets
    from datasets.packaged_modules.json.json import Json

    files = {}
    for split, rows in splits.items():
        files[split] = str(tmp / f"{split}.jsonl")
        datasets.Dataset.from_list(rows).to_json(files[split])
    owner, name = repo_id.split("/")
    Json(cache_dir=cache_dir, dataset_name=name, config_name=config, data_files=files,
         hash="0" * 16).download_and_prepare()
    built = glob.glob(os.path.join(cache_dir, name, f"{config}-*"))[0]  # the config folder carries a files hash
    os.makedirs(os.path.join(cache_dir, f"{owner}___{name}"))
    os.rename(built, os.path.join(cache_dir, f"{owner}___{name}", config))


GSM_LIKE = {
    "train": [{"question": f"Tom has {i} pens and buys {i + 3} more. How many pens now?",
               "answer": f"{i} + {i + 3} = {2 * i + 3}\n#### {2 * i + 3}"} for i in range(12)],
    "test": [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(4)],
}


def test_trains_from_a_hub_id_offline_with_a_column_map(tmp_path):
    cache = tmp_path / "hf-datasets"
    save_hub_cache(str(cache), "someone/gsm-like", "main", GSM_LIKE, tmp_path)
    out = tmp_path / "run"
    env = {"HF_DATASETS_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = run_script("train_sync.py", *TINY, "--steps", "2", "--out-dir", str(out), "--eval-every", "2",
                      "--taskset", "someone/gsm-like", "--dataset-config", "main", "--prompt-column", "question",
                      "--answer-regex", r"####\s*(.+)", "--prompt-template", "{prompt} Put the answer in \\boxed{}.",
                      "--eval-taskset", "someone/gsm-like", "--log-samples-every", "1",
                      # the random tiny model scores 0 on math: an entropy bonus on every group makes a gradient
                      "--entropy-coef", "0.01", "--no-drop-zero-signal-groups", env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == [1, 2] and any(r["grad_norm"] > 0 for r in rows)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all("pens now? Put the answer in \\boxed{}." in s["prompt"] for s in samples)
    assert all(s["task_id"].startswith("gsm-like:train:") for s in samples)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_before"] is not None and summary["eval_after"] is not None  # the test split, 4 tasks


def test_dataset_rows_map_to_tasks_and_bad_rows_name_the_row():
    from common.tasks.hub import DatasetOptions

    options = DatasetOptions(prompt_column="question", answer_regex=r"####\s*(.+)")
    task = options.to_task({"question": "1+1?", "answer": "1 + 1 = 2\n#### 2"}, "x: train row 0")
    assert (task["prompt"], task["answer"], task["reward"]) == ("1+1?", "2", "math")
    with pytest.raises(SystemExit, match="x: train row 3: --answer-regex"):
        options.to_task({"question": "1+1?", "answer": "2"}, "x: train row 3")
    with pytest.raises(SystemExit, match="row 4: missing column 'question'"):
        options.to_task({"prompt": "1+1?", "answer": "#### 2"}, "x: train row 4")


def test_unknown_hub_dataset_offline_is_one_line_error(tmp_path):
    env = {"HF_DATASETS_CACHE": str(tmp_path / "empty"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = run_script("train_sync.py", "--model", "tiny", "--taskset", "nobody/nothing", "--out-dir",
                      str(tmp_path / "r"), env=env)
    _one_line_error(proc, "--taskset nobody/nothing")
