"""RewardPool: asynchronous submit, failure containment, use from a spawned (non-daemon) child; shaping functions."""

import os
import signal
import time

import pytest

from rewards import Reward, RewardPool, score
from rewards.shaping import format_reward, length_penalty, overlong_penalty, shaping_terms

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
        # waiting for the scores would take >= 1.5 s (6 x 0.5 s on 2 workers); 1 s leaves room for a loaded machine
        assert time.time() - start < 1.0 and not future.done()  # generation can go on meanwhile
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


@pytest.mark.timeout(60)
def test_unpicklable_task_fails_alone():
    tasks = [TASK] * 12
    tasks[4] = {**TASK, "id": "bad-4", "extra": lambda: None}  # a lambda cannot cross a process boundary
    with RewardPool(num_workers=1) as pool:
        got = pool.score_batch(["Answer: 4"] * 12, tasks)
    assert [r.score for r in got] == [1.0] * 4 + [0.0] + [1.0] * 7
    assert "cannot be sent" in got[4].info["reason"] and got[4].info["failed"]


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
def test_overlong_penalty_matches_dapo_formula():
    """DAPO eq. 13 with L_max 20, L_cache 4: 0 up to 16 tokens, ((20 - 4) - |y|) / 4 after, -1 at the limit."""
    assert [overlong_penalty(n, 20, 4) for n in (3, 16, 17, 18, 20)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(25, 20, 4) == -1.0  # past the limit (a longer episode): the floor
    assert shaping_terms([1.0, 0.0], [16, 19], overlong_buffer=4, max_len=20) == {"overlong": [0.0, -0.75]}


def test_length_penalty_matches_kimi_formula():
    lengths, correct = [10, 20, 30], [True, True, False]
    assert length_penalty(lengths, correct) == [0.5, 0.0, -0.5]
    assert length_penalty([10, 20, 30], [False, False, True]) == [0.0, 0.0, -0.5]  # wrong: min(0, λ)
    assert length_penalty([5, 5, 5], [True, False, True]) == [0.0, 0.0, 0.0]
    assert length_penalty([], []) == []
    with pytest.raises(ValueError):
        length_penalty([1, 2], [True])


def shape_group(rewards, lengths, **weights):
    """Shaped rewards of one group: reward + every switched-on term (what shape_batch adds up per group)."""
    terms = shaping_terms(rewards, lengths, **weights)
    return [float(r) + sum(t[i] for t in terms.values()) for i, r in enumerate(rewards)]


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


OWNER = """
import sys, time
sys.path.insert(0, {root!r})
from rewards import RewardPool
if __name__ == "__main__":
    pool = RewardPool(num_workers=2, timeout_s=60)
    loop = {{"id": "loop", "reward": "code", "tests": [{{"input": "", "output": ""}}], "timeout_s": 50, "budget_s": 50}}
    pool.submit(["while True: pass"] * 2, [loop] * 2)
    print("submitted", flush=True)
    time.sleep(120)
"""


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(") ", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(90)
def test_killing_the_owner_leaves_no_process_behind(tmp_path):
    """SIGKILL the process that owns a pool while sandboxed programs run: workers, launchers and the programs
    all die with it (PR_SET_PDEATHSIG down the chain; PID namespaces take the programs' children)."""
    import subprocess
    import sys

    script = tmp_path / "owner.py"
    script.write_text(OWNER.format(root=os.getcwd()))
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    tree: set[int] = set()
    try:
        assert owner.stdout.readline().strip() == "submitted"
        deadline = time.time() + 30
        while time.time() < deadline:  # wait until both workers run a sandboxed program
            sandbox = {p for p in _descendants(owner.pid) if b"_sandbox_launch" in _cmdline(p)}
            programs = {c for p in sandbox for c in _descendants(p)}  # PID 1 of each sandbox (a forked launcher)
            launchers = sandbox - programs
            if len(launchers) == 2 and len(programs) == 2:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the sandboxed programs never started")
        tree = _descendants(owner.pid)
        assert sandbox <= tree and len(tree) >= 6  # + 2 workers (+ multiprocessing's resource tracker)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        deadline = time.time() + 10
        while time.time() < deadline and any(_running(p) for p in tree):
            time.sleep(0.1)
        assert [p for p in tree if _running(p)] == []
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=10)
        for pid in tree:  # if the test failed, do not leave busy loops behind
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
