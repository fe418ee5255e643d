"""RewardPool: asynchronous submit, failure containment, use from a spawned (non-daemon) child; shaping functions."""

import os
import time

import pytest

from rewards import Reward, RewardPool, score
from rewards.shaping import format_reward, length_penalty, shape_group

TASK = {"id": "arith-1", "answer": "4", "reward": "math"}


def slow_score(response: str, task: dict) -> Reward:
    """A verifier that takes a while, to show submit() does not wait for it."""
    time.sleep(0.5)
    return score(response, task)


def segfault_score(response: str, task: dict) -> Reward:
    if response == "segv":
        import ctypes
        ctypes.string_at(0)  # a real segmentation fault in the worker
    return score(response, task)


@pytest.mark.timeout(60)
def test_submit_returns_at_once_and_keeps_order():
    with RewardPool(num_workers=2, timeout_s=10, score_fn=slow_score) as pool:
        responses = [f"Answer: {i}" for i in range(6)]
        start = time.time()
        future = pool.submit(responses, [TASK] * 6)
        assert time.time() - start < 0.1 and not future.done()  # generation can go on meanwhile
        with pytest.raises(TimeoutError):
            future.result(timeout=0.01)
        got = future.result(timeout=30)
        assert [r.score for r in got] == [0, 0, 0, 0, 1, 0]
        assert [r.info["pred"] for r in got] == [str(i) for i in range(6)]


@pytest.mark.timeout(60)
def test_segfault_is_contained_and_counted():
    with RewardPool(num_workers=1, timeout_s=10, score_fn=segfault_score) as pool:
        got = pool.score_batch(["Answer: 4", "segv", "Answer: 4"], [TASK] * 3)
        assert [r.score for r in got] == [1.0, 0.0, 1.0]
        assert got[1].info["failed"] and "exit code -11" in got[1].info["reason"]
        assert pool.stats["crashes"] == 1


def test_unknown_kind_fails_at_submit_naming_the_task():
    with RewardPool(num_workers=1) as pool:
        with pytest.raises(ValueError, match=r"task poem-3: unknown reward 'poetry'"):
            pool.submit(["x"], [{"id": "poem-3", "reward": "poetry"}])
        assert pool.score_batch([], []) == []


@pytest.mark.timeout(60)
def test_close_leaves_no_process_and_fails_pending():
    pool = RewardPool(num_workers=2, timeout_s=30, score_fn=slow_score)
    future = pool.submit(["Answer: 4"] * 8, [TASK] * 8)
    time.sleep(0.2)
    pids = [p.pid for p in pool._procs]
    assert len(pids) == 2
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        future.result(timeout=5)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid)
    with pytest.raises(RuntimeError):
        pool.submit(["x"], [TASK])


def _is_zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1].startswith("Z")


def _child_uses_pool(result_queue):
    """Runs in a torch.multiprocessing spawn child (non-daemon, like the explorer) and uses a pool there."""
    with RewardPool(num_workers=2, timeout_s=3, score_fn=hang_or_echo) as pool:
        got = pool.score_batch(["Answer: 4", "hang", "\\boxed{4}"], [TASK] * 3)
        result_queue.put(([r.score for r in got], got[1].info["reason"], pool.stats["timeouts"]))


def hang_or_echo(response: str, task: dict) -> Reward:
    if response == "hang":
        time.sleep(600)
    return score(response, task)


@pytest.mark.timeout(90)
def test_pool_inside_a_spawned_child_process():
    import torch.multiprocessing as tmp  # here, not at the top: pool workers import this module, keep them light

    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_child_uses_pool, args=(q,), daemon=False)
    proc.start()
    try:
        scores, reason, timeouts = q.get(timeout=60)
    finally:
        proc.join(timeout=30)
    assert proc.exitcode == 0
    assert scores == [1.0, 0.0, 1.0] and "timeout" in reason and timeouts == 1


# ---------------------------------------------------------------- shaping
def test_length_penalty_matches_kimi_formula():
    lengths, correct = [10, 20, 30], [True, True, False]
    assert length_penalty(lengths, correct) == [0.5, 0.0, -0.5]
    assert length_penalty([10, 20, 30], [False, False, True]) == [0.0, 0.0, -0.5]  # wrong: min(0, λ)
    assert length_penalty([5, 5, 5], [True, False, True]) == [0.0, 0.0, 0.0]
    assert length_penalty([], []) == []
    with pytest.raises(ValueError):
        length_penalty([1, 2], [True])


def test_shape_group_weights_switch_terms():
    rewards, lengths = [1.0, 0.0, 1.0, 0.0], [10, 10, 30, 30]
    assert shape_group(rewards, lengths) == rewards
    assert shape_group(rewards, lengths, length_penalty_weight=0.2) == pytest.approx([1.1, 0.0, 0.9, -0.1])
    fmt = [True, False, True, True]
    assert shape_group(rewards, lengths, format_weight=0.5, format_ok=fmt) == [1.5, 0.0, 1.5, 0.5]
    assert format_reward(True) == 1.0 and format_reward(False) == 0.0
    with pytest.raises(ValueError, match="format_ok"):
        shape_group(rewards, lengths, format_weight=0.5)


@pytest.mark.timeout(60)
def test_hang_and_crash_inside_a_chunk_fail_only_that_item():
    """Workers get items in chunks; a hang or crash fails the item it happened on, the rest of the chunk is
    re-queued and scored normally."""
    responses = [f"Answer: {i % 7}" for i in range(40)]
    responses[5], responses[21] = "hang", "crash"
    with RewardPool(num_workers=2, timeout_s=2, score_fn=hostile) as pool:
        got = pool.score_batch(responses, [TASK] * 40)
    for i, r in enumerate(got):
        if i == 5:
            assert "timeout" in r.info["reason"]
        elif i == 21:
            assert r.info["reason"].startswith("verifier crashed")
        else:
            assert r.score == float(i % 7 == 4) and not r.info.get("failed"), (i, r)
    assert pool.stats["timeouts"] == 1 and pool.stats["crashes"] == 1 and pool.stats["failed"] == 2


def hostile(response: str, task: dict) -> Reward:
    if response == "hang":
        time.sleep(600)
    if response == "crash":
        os._exit(7)
    return score(response, task)
