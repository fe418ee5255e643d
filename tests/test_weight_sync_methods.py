"""Every weight-sync method of common/weight_sync/ hands weights from a trainer process to an explorer process (a
real world: gloo, the store, /dev/shm): the explorer holds exactly the versions sent, bit for bit, and generates
with them."""

import json
import os
import time

import pytest
import torch

from common.explorer.engine import RolloutEngine
from common.runtime.launcher import run_function
from common.weight_sync import METHODS
from tests.conftest import TINY

VERSIONS = 3
PROMPT = [[5, 17, 42, 99, 7]]


def _args(out_dir, method):
    from common.cli import parse_args
    from train_sync import Args

    return parse_args(Args, [*TINY, "--out-dir", out_dir, "--sync-method", method, "--verify-sync"])


def _greedy(engine):
    from common.explorer.engine import SamplingConfig

    return engine.generate(PROMPT, SamplingConfig(temperature=0, max_new_tokens=12))[0][0].response_ids


def ranks(ctx, out_dir, method):
    """Trainer: versions 0..2, each with weights moved far from the last; records hash and greedy output. Explorer
    (other initial weights): pulls each version, records the version, its engine's hash and its greedy output."""
    from common.explorer.engine import HFEngine
    from common.model import build_tiny_tokenizer, load_model
    from common.runtime.metrics import Timeline
    from common.weight_sync import check_weight_sync, make_weight_sync, weights_hash

    args = _args(out_dir, method)
    check_weight_sync(ctx, args)
    timeline = Timeline(out_dir, ctx.name)
    engine = HFEngine(load_model("tiny", seed=7 if ctx.role == "explorer" else 0), build_tiny_tokenizer())
    seen = []
    if ctx.role == "explorer":
        weights = make_weight_sync(args, ctx, timeline, engine)
        for step in range(VERSIONS):
            version = weights.pull(step)
            seen.append((version, engine.weights_checksum(), _greedy(engine)))
            ctx.store.set(f"took/{version}", "1")
    else:
        weights = make_weight_sync(args, ctx, timeline)
        named = engine.weight_buffers()
        for version in range(VERSIONS):
            with torch.no_grad():
                for _, p in named:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(version)) * 0.5 * version)
            seen.append((version, weights_hash(named), _greedy(engine)))
            weights.push(named, version, version)
            ctx.store.wait([f"took/{version}"])  # the explorer has it: the next version may overwrite
    with open(os.path.join(out_dir, f"seen-{ctx.name}.json"), "w") as f:
        json.dump({"method": args.sync_method, "seen": seen}, f)


# colocated through auto, the default, which picks it for ranks on one CPU (one world fewer to start)
@pytest.mark.parametrize("method", sorted(set(METHODS) - {"colocated"}) + ["auto"])
def test_each_method_hands_over_exact_versions_that_generate(tmp_path, method):
    run_function("test_weight_sync_methods:ranks", 1, 1, str(tmp_path), method)
    sent, got = (json.load(open(tmp_path / f"seen-{n}.json")) for n in ("trainer0", "explorer0"))
    assert sent["method"] == got["method"] == {"auto": "colocated"}.get(method, method)
    assert [v for v, _, _ in got["seen"]] == list(range(VERSIONS))  # every version, in order, none twice
    assert got["seen"] == sent["seen"]  # bit-identical weights, and the explorer generates what they generate
    assert len({h for _, h, _ in sent["seen"]}) == VERSIONS and len({str(o) for _, _, o in sent["seen"]}) > 1


class _Buffers(RolloutEngine):
    """The engine side a weight-sync method needs: buffers to write into, and a load (here: checked at once)."""

    def generate(self, prompts, sampling):
        raise NotImplementedError("weights only")

    def __init__(self):
        self.buffers = [("w", torch.zeros(4, 1 << 20)), ("b", torch.zeros(1 << 20))]
        self.torn = []

    def weight_buffers(self):
        return self.buffers

    def load_weights(self, source, version):
        values = {float(t.min()) for _, t in self.buffers} | {float(t.max()) for _, t in self.buffers}
        if values != {float(version)}:
            self.torn.append((version, sorted(values)))


class Watched:
    """A store flag whose reads are counted where they find it set."""

    def __init__(self, flag):
        self.flag, self.seen_set = flag, 0

    @property
    def value(self):
        v = self.flag.value
        self.seen_set += bool(v)
        return v


def race(ctx, out_dir):
    """The trainer writes versions back to back while the explorer takes whatever is published (as between decode
    steps, a few milliseconds apart): every version taken must be whole (each tensor filled with its version
    number), never half-written; and takes that found a version being written were refused (counted). The trainer
    writes from the explorer's first take until the explorer has taken 10 versions and met a write (or 30 s)."""
    from datetime import timedelta

    from common.runtime.metrics import Timeline
    from common.weight_sync import make_weight_sync

    args = _args(out_dir, "colocated")
    args.verify_sync = False  # the load itself checks
    engine = _Buffers()
    weights = make_weight_sync(args, ctx, Timeline(out_dir, ctx.name), engine if ctx.role == "explorer" else None)
    if ctx.role == "trainer":
        named = [(n, torch.empty_like(t)) for n, t in engine.buffers]
        version, deadline = 0, time.time() + 60
        while (version < 2 or not ctx.store.check(["race-done"])) and time.time() < deadline:
            for _, t in named:
                t.fill_(version)
            weights.push(named, version, version)
            if version == 0:  # the explorer takes it, then the race starts
                ctx.store.wait(["race-ready"], timedelta(seconds=60))
            version += 1
        return
    weights.writing = Watched(weights.writing)  # the explorer reads the flag only inside a take, to refuse it
    taken = [weights.pull(0)]
    ctx.store.set("race-ready", "1")
    deadline = time.time() + 30
    while (len(taken) < 10 or not weights.writing.seen_set) and time.time() < deadline:
        if weights.poll(0):
            taken.append(weights.version)
            time.sleep(0.005)  # a decode step: the trainer publishes meanwhile, and may be writing when it ends
    ctx.store.set("race-done", "1")
    with open(os.path.join(out_dir, "race.json"), "w") as f:
        json.dump({"taken": taken, "torn": engine.torn, "refused": weights.writing.seen_set}, f)


def test_colocated_never_hands_over_a_half_written_version(tmp_path):
    run_function("test_weight_sync_methods:race", 1, 1, str(tmp_path))
    got = json.load(open(tmp_path / "race.json"))
    assert got["torn"] == [] and got["taken"] == sorted(set(got["taken"])) and len(got["taken"]) > 2, got
    assert got["refused"] > 0, got  # the race happened: a take met a version being written, and waited


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU (run by make gpu-check)")
def test_colocated_cuda_slot_opens_in_another_process():
    """The CUDA sibling of the shared file: a GPU tensor's IPC handle opened in a second process is the same memory."""
    import torch.multiprocessing as mp

    from common.weight_sync.colocated import _share

    slot = torch.arange(1 << 20, dtype=torch.uint8, device="cuda")
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    proc = ctx.Process(target=_cuda_reader, args=(_share(slot, None), str(slot.device), result))
    proc.start()
    assert result.get(timeout=120) == int(slot.sum())
    proc.join(timeout=60)
    assert proc.exitcode == 0


def _cuda_reader(shared, device, result):
    from common.weight_sync.colocated import open_slot

    torch.cuda.set_device(torch.device(device))
    result.put(int(open_slot(shared, torch.device(device)).sum()))
