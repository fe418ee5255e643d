"""A loss, a reward and an experience processor written here, outside common/ and rewards/, plugged in by reference
(--loss-fn, --reward-fn, --processors) and trained with for 2 tiny steps: no file of the packages is touched."""

import json

from tests.conftest import TINY, assert_trained, run_in_process


# ---------------------------------------------------------------- the user's code
def reinforce_loss(mb, args):
    """Vanilla policy gradient: -A * log pi, token mean over the minibatch (same signature as common/trainer/losses.py)."""
    advantages = mb.advantages[:, None] if mb.advantages.dim() == 1 else mb.advantages
    loss = -(advantages * mb.logprobs * mb.mask).sum() / mb.minibatch_tokens
    return loss, {"plugin/reinforce_calls": 1.0}


def ascii_share(response: str, task: dict) -> float:
    """Share of the response's characters that are ASCII: the random tiny model scores about one half."""
    return sum(ord(c) < 128 for c in response) / len(response) if response else 0.0


def count_samples(experiences, args):
    return experiences, {"plugin/samples_seen": len(experiences)}


# ---------------------------------------------------------------- the test
def test_loss_reward_and_processor_from_outside_the_packages_train(tmp_path):
    # Tasks that name the math verifier but have no answer: without --reward-fn they would not even load.
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say something ({i})."}) + "\n" for i in range(12)))
    out = tmp_path / "run"
    proc = run_in_process("train_sync.py", *TINY, "--steps", "2", "--out-dir", str(out), "--taskset", str(data),
                          "--loss-fn", "tests/test_plugins.py:reinforce_loss",    # a file path ...
                          "--reward-fn", "tests.test_plugins:ascii_share",        # ... or a module
                          "--processors", "tests.test_plugins:count_samples")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = assert_trained(out, steps=2)
    for r in rows:
        assert r["plugin/reinforce_calls"] == 1.0  # the trainer ran the plugged-in loss ...
        assert r["plugin/samples_seen"] > 0  # ... and the processor
        assert 0 < r["reward/mean"] < 1  # ... on rewards from ascii_share (math would give 0: no answers)


def test_a_bad_reference_is_a_one_line_error(tmp_path):
    proc = run_in_process("train_sync.py", *TINY, "--out-dir", str(tmp_path / "r"),
                          "--loss-fn", "tests.test_plugins:no_such_fn")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == ("error: --loss-fn tests.test_plugins:no_such_fn: "
                                                    "tests.test_plugins has no function 'no_such_fn'")
    assert not (tmp_path / "r").exists()  # nothing started
