"""The streaming explorer of train_async.py: a slow group does not hold back the groups behind it, a resumed
explorer uses every task position once (groups in flight at the checkpoint are started again, trained ones never),
groups that outlive --max-staleness are dropped and counted, and a held-out evaluation runs beside the groups on
the weights it started with."""

import copy
import json
import threading
import time

import pytest

from common.cli import parse_args
from common.envs import ENVS, Env, StepResult, env_class
from common.explorer.streaming import Stream
from common.experience import RolloutBatch
from common.tasks.stream import StreamPositions, TrainedPositions, mark_trained


class Sleepy(Env):
    """One turn; the first two episodes of task `slow_id` (the group of stream position 0: the fixture names it)
    wait in their reset and their step until the test releases them (a slow environment). By task, not by the order
    of the resets: they run in the environment pool's threads, where a later group's may come first."""
    slow_id = None
    started = 0  # episodes of slow_id reset so far
    release = threading.Event()
    lock = threading.Lock()

    def reset(self, task):
        with type(self).lock:
            mine = task["id"] == type(self).slow_id
            type(self).started += mine
            self.slow = mine and type(self).started <= 2
        if self.slow:  # a slow start too: the streaming explorer does not wait for it
            assert type(self).release.wait(timeout=120), "the test never released the slow reset"
        return [{"role": "user", "content": "Say a word."}]

    def step(self, action):
        if self.slow:
            assert type(self).release.wait(timeout=120), "the test never released the slow step"
        return StepResult([], 1.0, True, {})


@pytest.fixture
def explorer(tmp_path):
    """A streaming explorer (HF, tiny model) over 12 tasks, the first one started slow; one group per batch."""
    from common.explorer.explorer import Explorer
    from common.runtime.metrics import Timeline
    from train_async import Args

    ENVS["sleepy"] = "tests.test_streaming:Sleepy"
    sleepy = env_class("sleepy")  # the class the registry imports (pytest may import this file twice)
    sleepy.started, sleepy.slow_id = 0, None
    sleepy.release = threading.Event()
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"id": f"t{i}", "env": "sleepy"}) + "\n" for i in range(12)))
    args = parse_args(Args, ["--model", "tiny", "--engine", "hf", "--taskset", str(data), "--eval-size", "1",
                             "--tasks-per-step", "1", "--inflight-groups", "3", "--max-staleness", "100",
                             "--samples-per-task", "2",
                             "--max-new-tokens", "4", "--max-turns", "1", "--minibatch-size", "2",
                             "--micro-batch-size", "2", "--num-threads", "1", "--out-dir", str(tmp_path)])
    built = []

    def make():
        built.append(Explorer(args, "cpu", Timeline(str(tmp_path), "explorer0")))
        built[-1].engine.stop_ids = list(range(259))  # every token stops: each turn reaches its environment step
        if sleepy.slow_id is None:  # the task at stream position 0, read from a copy of the stream
            sleepy.slow_id = copy.deepcopy(built[-1].parts.train_tasks).next_batch(1)[0]["id"]
        return built[-1]

    yield make
    sleepy.release.set()
    for e in built:
        e.close()
    del ENVS["sleepy"]


def stream(s, batches: int, timeout_s: float = 120) -> list[RolloutBatch]:
    """The loop of train_async.py's explorer over the Stream `s`, without weights: `batches` batches."""
    out, start = [], time.time()
    while len(out) < batches:
        assert time.time() - start < timeout_s, f"{len(out)} batches in {timeout_s}s"
        s.start_groups()
        s.step()
        batch = s.take_batch()
        if batch is not None:
            out.append(batch)
    return out


def in_flight(s) -> list[int]:
    return sorted(p for p, _ in s.position_of.values())


@pytest.mark.timeout(300)
def test_a_slow_group_does_not_hold_back_the_groups_behind_it(explorer):
    s = Stream(explorer().parts)
    batches = stream(s, 4)  # while the slow group's tool is busy
    positions = [b.positions for b in batches]
    assert [0] not in positions, positions  # the groups started after it reached the buffer first
    assert [b.step for b in batches] == [1, 2, 3, 4]
    assert all(len(b.experiences) == 2 and b.metrics["rollout/groups_in_flight"] >= 1 for b in batches)
    assert all(0 <= b.metrics["rollout/engine_busy_frac"] <= 1 for b in batches)
    env_class("sleepy").release.set()
    later = [b.positions for b in stream(s, 3)]
    assert [0] in later, later  # ... and it follows once its tool has answered


@pytest.mark.timeout(300)
def test_resume_uses_every_task_position_once(explorer):
    first = Stream(explorer().parts)
    trained = [p for b in stream(first, 3) for p in b.positions]  # three steps trained; more groups still in flight
    assert 0 not in trained and first.position_of  # the slow group was in flight when the "checkpoint" was taken
    ledger = mark_trained(None, trained)
    first.stop()
    e = explorer()
    resumed = Stream(e.parts, positions=StreamPositions(e.args, ledger, step=3))
    again = [p for b in stream(resumed, 5) for p in b.positions]
    assert not set(again) & set(trained), (trained, again)  # nothing trained twice
    lost = set(range(max(trained))) - set(trained) - set(again) - set(in_flight(resumed))
    assert not lost, (trained, again, in_flight)  # the groups in flight at the checkpoint were started again

@pytest.mark.timeout(300)
def test_a_group_starts_only_within_max_staleness_of_the_weights(explorer):
    """AReaL's admission rule: a group starts only while its stream position is below (version + --max-staleness
    + 1) x --tasks-per-step, however many --inflight-groups are free; each new version admits one batch more."""
    e = explorer()
    e.args.max_staleness = 1  # at version 0: positions 0 and 1 (--inflight-groups 3 would start a third)
    s = Stream(e.parts)
    s.start_groups()
    assert in_flight(s) == [0, 1]
    s.start_groups()
    assert len(s.position_of) == 2  # no new version, no new group
    s.version = 1
    s.start_groups()
    assert in_flight(s) == [0, 1, 2]


@pytest.mark.timeout(300)
def test_no_group_starts_past_the_runs_last_batch_until_the_trainer_drops_one(explorer):
    """--steps 2 x 1 task: positions 0 and 1 start, however many --inflight-groups and versions are free; a batch
    the trainer drops whole (owed again, through the run's store) admits one batch more; a resumed explorer counts
    the positions it trained, as the trainer published them."""
    import torch

    store = torch.distributed.HashStore()
    trainer = TrainedPositions({}, store, main=True)  # the trainer's side, published before the first weights
    e = explorer()
    e.args.steps = 2
    s = Stream(e.parts, None, StreamPositions.published(e.args, store, 0, step=0), store)
    s.version = 5
    s.start_groups()
    assert in_flight(s) == [0, 1]
    s.start_groups()
    assert in_flight(s) == [0, 1]  # past the run's last batch
    trainer.record(RolloutBatch(1, [], {}, 0, [0]))  # dropped whole as too stale: owed again
    s.start_groups()
    assert in_flight(s) == [0, 1, 2]
    s.stop()
    # 2 steps trained and a position a processor dropped (0-2 used): one batch left, at position 3
    trainer.record(RolloutBatch(2, ["trained"], {}, 0, [1, 2]))
    e.args.steps = 3
    resumed = explorer()
    fresh = torch.distributed.HashStore()  # a resumed run's store: its trainer publishes the checkpoint's ledger
    TrainedPositions(trainer.ledgers, fresh, main=True)
    s = Stream(resumed.parts, None, StreamPositions.published(resumed.args, fresh, 0, step=2), fresh)
    s.version = 5
    s.start_groups()
    assert in_flight(s) == [3]


@pytest.mark.timeout(300)
def test_an_evaluation_runs_beside_the_groups_on_the_weights_it_started_with(explorer):
    """train_async.py's held-out evaluation joins the stream: while its episode waits in its environment the groups
    go on making batches, and weights that arrive meanwhile are taken only once it is over (it measures the version
    it started with)."""
    from types import SimpleNamespace

    import torch

    from common.weight_sync.checkpoint import CheckpointSync, write_sync_checkpoint

    e = explorer()
    sleepy = env_class("sleepy")
    sleepy.slow_id = e.parts.eval_tasks[0]["id"]  # the held-out episode waits in its environment until released
    ctx = SimpleNamespace(store=torch.distributed.HashStore(), name="explorer0", index=0)
    e.connect(CheckpointSync(ctx, e.args, e.timeline, e.engine))
    named = [(n, p.detach().clone()) for n, p in e.engine.model.named_parameters()]
    write_sync_checkpoint(e.weights.sync_dir, named, 0)
    e.pull(step=0)
    s = Stream(e.parts, e.weights)
    s.start_evaluation(0)
    assert len(stream(s, 3)) == 3  # made while the evaluation's episode waits
    assert s.take_evaluation() is None and sleepy.started == 1
    write_sync_checkpoint(e.weights.sync_dir, [(n, t + 0.01) for n, t in named], 1)
    s.poll()
    assert s.version == 0  # not while the evaluation runs
    sleepy.release.set()
    metrics = s.take_evaluation(wait=True)
    assert metrics["eval/version"] == 0 and metrics["eval/turns_mean"] == 1.0
    s.poll()
    assert s.version == 1  # and once it is over


def test_ledger_of_trained_positions():
    assert mark_trained(None, [0, 2, 5]) == [1, [2, 5]]
    assert mark_trained([1, [2, 5]], [1, 3]) == [4, [5]]
    assert mark_trained([4, [5]], [4]) == [6, []]
