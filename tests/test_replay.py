"""Kimi k1.5 pieces: partial rollouts over several steps (real HF engine, tiny model), the trainer's replay buffer,
and both entry-script families running with them."""

import pytest
import torch

from common.explorer.engine import Generation, HFEngine, SamplingConfig
from common.experience import Experience, collate
from common.runtime.metrics import read_metrics
from common.model import build_tiny_tokenizer, chat_prompt_ids, load_model
from common.trainer.forward import sequence_logprobs
from common.explorer.groups import Response
from common.explorer.rollouts import Rollouts
from common.explorer.workflow import Context
from common.trainer.filters import trained_version
from common.trainer.replay import ReplayBuffer
from tests.conftest import TINY, assert_trained, run_in_process


def test_response_split_over_three_steps_reassembles_exactly():
    """Three rounds with three different weight versions: tokens, log-probs and versions line up exactly, each
    segment's log-probs are the ones its own weights give, and the loss mask follows --partial-loss."""
    tokenizer = build_tiny_tokenizer()
    model = load_model("tiny", seed=3)
    # The tiny random model almost never emits its stop token; no stop id at all makes three full rounds certain.
    engine = HFEngine(model, tokenizer, stop_token_ids=[-1])
    prompt = chat_prompt_ids(tokenizer, {"prompt": "How many apples?"})
    rollouts = Rollouts(Context(tokenizer, max_new_tokens=12, token_budget=4))  # single_turn, segments of 4
    rollouts.start({"id": "t0", "prompt": "How many apples?"}, group_id=7, n=3)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=12, n=3)
    segments, states = [], []
    torch.manual_seed(0)
    for version in range(3):
        if version:  # new weights arrive between rollout steps (in place, as a weight sync writes them)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
        states.append({k: v.clone() for k, v in model.state_dict().items()})
        before = [(list(r.response_ids), list(r.logprobs)) for r in rollouts.groups[0].responses]
        stats = rollouts.generate(engine, sampling, version)
        assert stats["continued"] == (3 if version else 0) and stats["tokens"] == 12
        segments.append([(r.response_ids[len(ids):], r.logprobs[len(lps):])
                         for r, (ids, lps) in zip(rollouts.groups[0].responses, before)])
        finished = rollouts.pop_finished()
        assert (len(finished) == 1) == (version == 2)  # the group leaves only when its responses have all ended
    (group,) = finished
    assert group.group_id == 7 and rollouts.groups == [] and rollouts.unfinished() == []
    for i, r in enumerate(group.responses):
        assert r.finish_reason == "length" and r.segments == 3 and r.prompt_ids == prompt
        assert r.response_ids == segments[0][i][0] + segments[1][i][0] + segments[2][i][0]
        assert r.logprobs == segments[0][i][1] + segments[1][i][1] + segments[2][i][1]
        assert r.versions == [0] * 4 + [1] * 4 + [2] * 4
        assert r.loss_mask("last_segment") == [0] * 8 + [1] * 4 and r.loss_mask("all") == [1] * 12
        # How old the experience is for --max-staleness: its oldest trained token.
        assert [trained_version(Experience(r.prompt_ids, r.response_ids, r.logprobs, r.loss_mask(p), 0.0, 7, "t0", 2,
                                           segment_versions=r.versions)) for p in ("last_segment", "all")] == [2, 0]
    # Each segment's behaviour log-probs are what the trainer computes under that segment's weights.
    exps = [Experience(r.prompt_ids, r.response_ids, r.logprobs, r.loss_mask("all"), 0.0, 7, "t0", 0)
            for r in group.responses]
    batch = collate(exps, tokenizer.pad_token_id)
    start = len(prompt) - 1
    for version, state in enumerate(states):
        model.load_state_dict(state)
        with torch.no_grad():
            recomputed = sequence_logprobs(model, batch.input_ids, batch.attention_mask, 1.0)
        cols = slice(start + 4 * version, start + 4 * version + 4)
        diff = (recomputed[:, cols] - batch.old_logprobs[:, cols]).abs().max().item()
        assert diff < 1e-4, f"segment {version}: max |diff| {diff}"
    # --partial-loss last_segment: only the newest segment's positions are trained.
    masked = collate([Experience(r.prompt_ids, r.response_ids, r.logprobs, r.loss_mask("last_segment"), 0.0, 7,
                                 "t0", 2) for r in group.responses], tokenizer.pad_token_id)
    assert masked.response_mask[:, start: start + 8].sum() == 0 and masked.response_mask[:, start + 8:].sum() == 12


def _gen(ids, finish):
    return Generation(prompt_ids=[1], response_ids=ids, logprobs=[-1.0] * len(ids), finish_reason=finish)


def test_segment_end_rules():
    """A stop token inside what is left ends with "stop"; tokens beyond --max-new-tokens are cut ("length")."""
    r = Response([1])
    r.extend(_gen([5, 6, 7], "length"), version=0, max_new_tokens=5)
    assert r.finish_reason is None and r.versions == [0, 0, 0]
    r.extend(_gen([8, 9, 2], "stop"), version=1, max_new_tokens=5)  # the stop token would be token 6 of 5: cut
    assert r.response_ids == [5, 6, 7, 8, 9] and r.finish_reason == "length" and r.versions == [0, 0, 0, 1, 1]
    s = Response([1])
    s.extend(_gen([5, 6], "length"), version=0, max_new_tokens=5)
    s.extend(_gen([7, 2], "stop"), version=4, max_new_tokens=5)
    assert s.finish_reason == "stop" and s.loss_mask("last_segment") == [0, 0, 1, 1]
    # Segments made by the same weights count as one: nothing is masked.
    t = Response([1])
    t.extend(_gen([5, 6], "length"), version=3, max_new_tokens=5)
    t.extend(_gen([7, 2], "stop"), version=3, max_new_tokens=5)
    assert t.loss_mask("last_segment") == [1, 1, 1, 1]


def _group(group_id, version, rewards=(0.0, 1.0)):
    return [Experience([1], [2, 3], [-1.0, -1.0], [1, 1], r, group_id, f"task{group_id}", version) for r in rewards]


def test_replay_reuse_count_and_priority_order():
    buf = ReplayBuffer(max_reuse=3, groups_per_step=1, capacity=10)
    batch, m = buf.mix(_group(0, version=0), version=0)
    assert m == {"replay/reused": 0, "replay/size": 2} and len(batch) == 2
    batch, m = buf.mix(_group(0, version=1), version=1)  # the same group id from a later step: a different group
    assert m["replay/reused"] == 2 and len({e.group_id for e in batch}) == 2  # renumbered, never merged
    assert [e.policy_version for e in batch] == [1, 1, 0, 0]  # fresh first, then the replayed group
    # Stored: v0 used twice (priority -2), v1 used once (priority 0): the newer, less used group goes first.
    batch, m = buf.mix(_group(5, version=2), version=2)
    assert [e.policy_version for e in batch[2:]] == [1, 1]
    # Priorities now v0 -2, v1 -1, v2 1: v2 goes twice (1, then 0: still above -1), then v1, then v0; each leaves
    # after its third use.
    order = []
    for version in range(3, 7):
        batch, m = buf.mix([], version=version)
        order.append(sorted({e.policy_version for e in batch}))
    assert order == [[2], [2], [1], [0]]
    assert buf.size == 0 and buf.mix([], version=6)[0] == []  # every group was trained exactly 3 times


def test_replay_skips_uniform_groups_stale_groups_and_bounds_size():
    buf = ReplayBuffer(max_reuse=2, capacity=2, max_staleness=1)
    buf.mix(_group(0, 0, rewards=(1.0, 1.0)) + _group(1, 0), version=0)
    assert buf.size == 2  # the all-equal group carries no signal and is not stored
    _, m = buf.mix(_group(2, 1) + _group(3, 1) + _group(4, 1), version=2)
    assert m["replay/reused"] == 0  # group 1 (v0) is 2 versions old: too stale to replay
    assert buf.size == 4 and {g.version for g in buf.stored} == {1}  # capacity 2 groups
    # The fresh samples are judged by the same rule: a group arriving already too stale is never stored.
    buf.mix(_group(5, 0), version=2)
    assert buf.stored and all(g.experiences[0].task_id != "task5" for g in buf.stored)
    assert ReplayBuffer(max_reuse=1).mix(_group(0, 0), version=0)[1]["replay/size"] == 0  # --max-reuse 1: off


BUDGET = ["--rollout-token-budget", "4", "--max-new-tokens", "12"]


def test_sync_partial_rollouts_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = run_in_process("train_sync.py", *TINY, *BUDGET, "--steps", "3", "--out-dir", str(out), "--curriculum",
                          "--difficulty", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(str(out))
    assert_trained(out, steps=3, skipped=[r["step"] for r in rows if "reward/mean" not in r])
    assert rows[0]["rollout/partial_saved"] > 0 and rows[0]["rollout/partial_continued"] == 0
    assert rows[1]["rollout/partial_continued"] > 0
    # By step 3 every group started in step 1 has 12 tokens or stopped: it is trained, made by 3 versions.
    assert rows[2]["rollout/groups_finished"] >= 4 and rows[2]["rollout/partial_finished"] > 0
    assert "reward/mean" in rows[2]
    for r in rows:  # a step whose rollout finished no group trains nothing (and still counts as a step)
        assert ("reward/mean" in r) == (r["rollout/groups_finished"] > 0)
    assert [r["tasks/max_difficulty"] for r in rows] == [1, 2, 3]  # one level opens per third of the run


def test_async_partial_rollouts_with_replay_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = run_in_process("train_async.py", *TINY, *BUDGET, "--steps", "3", "--out-dir", str(out), "--max-reuse", "2",
                          "--partial-loss", "all", "--max-staleness", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = assert_trained(out, steps=3)
    assert all(r["rollout/partial_finished"] > 0 and r["rollout/partial_continued"] > 0 for r in rows)
    assert rows[0]["replay/reused"] == 0 and rows[1]["replay/reused"] > 0  # step 1's groups trained again
    assert rows[1]["replay/reused"] <= rows[0]["replay/size"]  # what step 2 reused, step 1 had stored


@pytest.mark.parametrize("flags,fragment", [
    (["--rollout-token-budget", "12", "--max-new-tokens", "12"], "--rollout-token-budget"),
    (["--partial-loss", "first"], "--partial-loss"),
    (["--max-reuse", "0"], "--max-reuse"),
    (["--task-sampling", "prioritized"], "--task-sampling"),
    (["--curriculum"], "--curriculum"),
])
def test_kimi_config_errors_name_the_field(flags, fragment):
    from common.cli import parse_args
    from common.knobs import ConfigError
    from train_sync import Args

    with pytest.raises(ConfigError, match=fragment):
        parse_args(Args, ["--model", "tiny", *flags])
