"""Rewards wired into the explorer: the --rewards config fields, shaping per sample group, a rollout scoring every
reward kind, and a train_sync.py run on a taskset mixing every reward kind."""

import base64
import io
import json

import pytest

from common.cli import parse_args
from common.config import CommonArgs
from rewards import Reward
from rewards.shaping import shape_batch
from tests.reward_helpers import build_tiny_rm
from tests.conftest import TINY, assert_trained, run_in_process


def _png_b64() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (0, 128, 0)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def mixed_tasks() -> list[dict]:
    """Two tasks of each kind; the code ones run every response in the sandbox."""
    he_like = {"prompt": "def f(x):\n", "entry_point": "f", "test": "def check(c):\n    assert c(1) == 2\n"}
    tasks = []
    for k in range(2):
        tasks += [
            {"id": f"math-{k}", "reward": "math", "prompt": f"{k} + 2 = ?", "answer": str(k + 2)},
            {"id": f"k12-{k}", "reward": "k12", "prompt": "Capital of France?", "answer": "B",
             "choices": ["Rome", "Paris"]},
            {"id": f"code-{k}", "reward": "code", "prompt": "Echo the input.",
             "tests": [{"input": "7", "output": "7"}]},
            {"id": f"he-{k}", "reward": "code", **he_like},
            {"id": f"vision-{k}", "reward": "vision", "prompt": "How many squares?", "image": _png_b64(),
             "answer": "1", "type": "count"},
            {"id": f"rm-{k}", "reward": "rm", "prompt": "Say hello."},
        ]
    return tasks


def _write_jsonl(path, tasks):
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return str(path)


# ---------------------------------------------------------------- shaping switch
def test_shape_batch_is_per_group_and_keeps_the_parts():
    rewards = [Reward(1.0, {"format_ok": True}), Reward(1.0, {"format_ok": True}), Reward(0.0, {"format_ok": False}),
               Reward(0.0, {"format_ok": True}), Reward(1.0, {}), Reward(0.5, {"failed": True})]
    lengths = [10, 20, 30, 100, 100, 300]  # group 2's lengths are not compared with group 1's
    off = shape_batch(rewards, lengths, group_size=3)
    # A failed sample never out-scores its group's worst legitimate one (rewards/THREATS.md "Errors never pay").
    assert off == [(r.score, {"raw": r.score}) for r in rewards[:5]] + [(0.0, {"raw": 0.5, "failed_floor": -0.5})]
    both = shape_batch(rewards, lengths, group_size=3, length_penalty_weight=0.5, format_weight=0.2)
    lp = [0.25, 0.0, -0.25, 0.0, 0.25, -0.25]  # 0.5 * Kimi lambda within each group; wrong ones min(0, lambda)
    fmt = [0.2, 0.2, 0.0, 0.2, 0.0, 0.0]  # no format_ok (an RM, a failed verifier) earns nothing
    floor = [0.0] * 5 + [0.2 - 0.25]  # the failed one: capped at its group's lowest legitimate 0.0 + 0 + 0.2
    for (shaped, parts), r, want_lp, want_fmt, cap in zip(both, rewards, lp, fmt, floor):
        want = {"raw": r.score, "length_penalty": want_lp, "format": want_fmt, **({"failed_floor": cap} if cap else {})}
        assert parts == pytest.approx(want)
        assert shaped == pytest.approx(r.score + want_lp + want_fmt + cap)
    only_format = shape_batch(rewards, lengths, group_size=3, format_weight=1.0)
    assert [set(p) for _, p in only_format] == [{"raw", "format"}] * 6
    with pytest.raises(ValueError, match="whole groups of 4"):
        shape_batch(rewards, lengths, group_size=4)


@pytest.mark.parametrize("flags,field", [
    (["--reward-workers", "0"], "--reward-workers"), (["--reward-timeout-s", "0"], "--reward-timeout-s"),
    (["--reward-memory-mb", "100"], "--reward-memory-mb"),
    (["--length-penalty", "-1"], "--length-penalty"), (["--format-reward", "-0.1"], "--format-reward"),
    (["--rm-model", "/nonexistent/rm"], "--rm-model"), (["--judge-model", "./no/judge"], "--judge-model"),
])
def test_reward_fields_are_validated(flags, field):
    with pytest.raises(SystemExit) as e:
        parse_args(CommonArgs, flags)
    assert str(e.value).startswith(f"error: {field}")


# ---------------------------------------------------------------- explorer: every kind scored in one rollout
@pytest.mark.timeout(120)
def test_rollout_scores_every_kind_on_its_own_task(tmp_path):
    from common.explorer.explorer import Explorer
    from common.runtime.metrics import Timeline

    tasks = [t for t in mixed_tasks() if t["reward"] != "rm"]
    data = _write_jsonl(tmp_path / "tasks.jsonl", tasks)
    args = parse_args(CommonArgs, ["--model", "tiny-vlm", "--engine", "hf", "--taskset", data, "--eval-taskset", data,
                                   "--eval-size", "2",
                                   "--tasks-per-step", "10", "--samples-per-task", "2", "--max-new-tokens", "24",
                                   "--minibatch-size", "4", "--micro-batch-size", "4",
                                   "--length-penalty", "1", "--format-reward", "0.5"])
    explorer = Explorer(args, "cpu", Timeline(str(tmp_path), "explorer0"))
    try:
        experiences, metrics = explorer.rollout(step=1)
    finally:
        explorer.close()
    assert len(experiences) == 20
    kinds = {t["id"]: t["reward"] for t in tasks}
    for e in experiences:  # each score landed on its own task
        info = e.reward_info
        assert not info.get("failed"), info
        assert ("pass_frac" in info) == (kinds[e.task_id] == "code"), (e.task_id, info)
        assert ("image" in info) == (kinds[e.task_id] == "vision"), (e.task_id, info)
        assert e.reward == pytest.approx(info["raw"] + info["length_penalty"] + info["format"])
    groups = {}
    for e in experiences:
        groups.setdefault(e.group_id, []).append(e)
    assert len(groups) == 10 and all(len(g) == 2 and len({e.task_id for e in g}) == 1 for g in groups.values())
    for key in ("reward/raw_mean", "reward/length_penalty_mean", "reward/format_mean", "reward/failed"):
        assert key in metrics, key
    assert metrics["reward/failed"] == 0
    from rewards.sandbox import run
    assert metrics["reward/sandbox_mode"] == run("pass").mode  # the code sandbox's isolation, named in metrics


# ---------------------------------------------------------------- end to end
@pytest.mark.timeout(240)
def test_train_sync_on_a_taskset_mixing_every_reward_kind(tmp_path):
    data = _write_jsonl(tmp_path / "mixed.jsonl", mixed_tasks())
    rm = build_tiny_rm(str(tmp_path / "tiny-rm"))
    out = tmp_path / "run"
    proc = run_in_process("train_sync.py", *TINY, "--model", "tiny-vlm", "--steps", "3", "--out-dir", str(out),
                          "--taskset", data, "--eval-taskset", data, "--tasks-per-step", "6", "--rm-model", rm,
                          "--length-penalty", "1", "--format-reward", "0.1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = assert_trained(out, steps=3, model="tiny-vlm")  # a VLM policy: the image tasks are seen
    for r in rows:
        assert r["reward/failed"] == 0, r
        for key in ("reward/raw_mean", "reward/length_penalty_mean", "reward/format_mean", "time/reward"):
            assert key in r, key
        # What the trainer trained on (reward/mean) is the raw score plus the shaping terms.
        assert r["reward/mean"] == pytest.approx(
            r["reward/raw_mean"] + r["reward/length_penalty_mean"] + r["reward/format_mean"], abs=1e-5)
    assert max(r["reward/raw_mean"] for r in rows) > 0  # the tiny RM scores every response in (0, 1)


def test_rm_tasks_without_a_reward_model_are_a_one_line_error(tmp_path):
    data = _write_jsonl(tmp_path / "rm.jsonl", [t for t in mixed_tasks() if t["reward"] in ("rm", "math")])
    proc = run_in_process("train_sync.py", *TINY, "--steps", "1", "--out-dir", str(tmp_path / "r"), "--taskset", data,
                          "--eval-taskset", data)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr and "--rm-model" in lines[-1], proc.stderr[-2000:]


