"""Every schedule trains a taskset that mixes single-turn (arith) and multi-turn (guess_number, calculator tools)
tasks with the HF engine (with vLLM: tests/test_vllm_runs.py): the steps train through the policy gradient
(assert_trained) and the metrics count the episodes' turns and end reasons."""

import json

import pytest

from common.runtime.metrics import read_metrics
from tests.conftest import TINY, assert_trained, run_in_process

# A reward signal the random tiny model gets (no entropy bonus: it would make every step "train" on no signal):
# parity scores every response by a share of its characters, and --format-reward scores each guess_number turn
# that holds a number; groups whose rewards are all equal (calculator's, mostly) are left out of the update.
# It seldom stops within --max-new-tokens either: its cut turns go on (--truncated-turns continue), so episodes
# have several turns.
SIGNAL = ["--format-reward", "1", "--truncated-turns", "continue"]
MIXED = ["--taskset", "parity+guess_number+calculator", "--max-turns", "3", "--episode-token-budget", "900", *SIGNAL]


def check_episodes(out, steps=2):
    rows = assert_trained(out, steps=steps)
    # Some step has episodes of several turns (a streamed batch may hold only the groups that finished first: the
    # calculator's one-turn answers).
    assert max(r["rollout/turns_mean"] for r in rows) > 1.0
    for r in rows:
        assert r["rollout/episodes"] > 0
        assert sum(v for k, v in r.items() if k.startswith("rollout/end/")) == r["rollout/episodes"]


@pytest.mark.timeout(600)  # three processes on a shared 2-core machine
# train_async.py: test_mixed_taskset_streams_with_ppo_data_parallel below (and PPO's async run of test_algos.py).
@pytest.mark.parametrize("script", ["train_sync.py", "train_offpolicy.py"])
def test_mixed_single_and_multi_turn_trains_with_hf(tmp_path, script):
    out = tmp_path / "run"
    proc = run_in_process(script, *TINY, *MIXED, "--steps", "2", "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_episodes(out)


@pytest.mark.timeout(600)
def test_jsonl_rows_pick_their_env(tmp_path):
    rows = [{"prompt": f"Write {i + 3} characters, each with an even code point.", "reward": "parity", "parity": "even"}
            for i in range(6)]
    rows += [{"env": "guess_number", "secret": i % 8 + 1, "high": 8} for i in range(6)]
    rows += [{"env": "retry", "prompt": f"{i} * 2 = ?", "answer": str(2 * i)} for i in range(6)]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "run"
    proc = run_in_process("train_sync.py", *TINY, *SIGNAL, "--taskset", str(path), "--max-turns", "3", "--steps", "2",
                          "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_episodes(out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"env": "chess"}) + "\n")
    proc = run_in_process("train_sync.py", *TINY, "--taskset", str(bad), "--out-dir", str(tmp_path / "r2"))
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith(
        f"error: {bad}:1: unknown env 'chess' (one of ")


@pytest.mark.timeout(600)
def test_mixed_taskset_streams_with_ppo_data_parallel(tmp_path):
    """PPO (GAE over the sampled tokens only) in the asynchronous schedule, two data-parallel trainers and the
    streaming explorer with episodes; the critic is in each step checkpoint, not in final/."""
    out = tmp_path / "run"
    proc = run_in_process("train_async.py", *TINY, *MIXED, "--algo", "ppo", "--trainer-devices", "cpu,cpu",
                          "--checkpoint-every", "1", "--steps", "2", "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_episodes(out)
    assert all("value_loss" in r and "value/explained_var" in r for r in read_metrics(str(out)))
    assert (out / "checkpoints" / "step_2" / "critic" / "model.safetensors").exists()
    assert not (out / "final" / "critic").exists()  # final/: the policy and tokenizer only
