"""The experience buffer and the control channel between ranks (common/runtime/channel.py), in a real world of
three ranks under torch elastic (gloo + the agent's store): bounded with backpressure, ordered per explorer,
control messages past a full buffer, and every wait with a timeout and a message naming whom it waits for."""

import json
import os
import time

import pytest

from common.runtime.launcher import run_function

CAPACITY, BATCHES = 2, 5


class Reported(Exception):
    """Ends a wait from its stall report."""


def ranks(ctx, out_dir):
    from common.experience import ExperienceQueue, RolloutBatch
    from common.runtime.channel import Mailbox
    from common.runtime.control import ControlChannel

    mailbox = Mailbox(ctx, capacity=CAPACITY)
    queue, control = ExperienceQueue(mailbox), ControlChannel(mailbox)
    seen = {}
    if ctx.role == "trainer":
        # explorer0 sends its control message once a put has blocked on the full buffer: wait for that state
        control_messages, deadline = [], time.monotonic() + 60
        while not control_messages and time.monotonic() < deadline:
            control_messages = [m.metrics for m in control.poll()]
            time.sleep(0.05)
        seen["held_while_full"] = mailbox.batches.qsize()
        seen["control_past_full_buffer"] = control_messages
        seen["order"] = [(b.explorer, b.step) for b in (queue.get(30) for _ in range(2 * BATCHES))]
        stalls = []

        def report(waited):  # the third report ends the wait: bound by the reports, not by a clock
            stalls.append(waited)
            if len(stalls) == 3:
                raise Reported

        with pytest.raises(Reported):
            queue.get(60, on_stall=report, stall_every=0.3)
        with pytest.raises(TimeoutError) as e:
            queue.get(1.0)
        seen["empty_wait"], seen["stalls"] = str(e.value), stalls
        seen["final"] = control.wait_final(30)[0]
        with pytest.raises(TimeoutError) as e:
            control.wait_final(0.2)
        seen["no_final"] = str(e.value)
    else:
        blocked = []
        for step in range(1, BATCHES + 1):
            while True:
                try:
                    queue.put(RolloutBatch(step, [], {}, ctx.index), timeout=0.5, who=ctx.name)
                    break
                except TimeoutError as e:
                    if not blocked and ctx.index == 0:
                        control.send("eval", {"eval/accuracy": 0.5}, ctx.index)
                    blocked.append(str(e))
        if ctx.index == 0:
            control.send("final", {"eval/accuracy": 0.75}, ctx.index)
        seen["blocked"] = blocked[:1]
    mailbox.close(30)
    with open(os.path.join(out_dir, f"{ctx.name}.json"), "w") as f:
        json.dump(seen, f)


def test_buffer_and_control_between_ranks(tmp_path):
    run_function("test_channel:ranks", 1, 2, str(tmp_path))
    trainer = json.loads((tmp_path / "trainer0.json").read_text())
    assert trainer["held_while_full"] == CAPACITY  # full, and bounded: the rest waited at the explorers
    for e in (0, 1):
        assert [s for x, s in trainer["order"] if x == e] == list(range(1, BATCHES + 1))  # in order, each once
        blocked = json.loads((tmp_path / f"explorer{e}.json").read_text())["blocked"]
        assert blocked and blocked[0] == (f"explorer{e}: the experience buffer at trainer0 stayed full for 0s "
                                          "(trainer stalled?)")
    assert trainer["control_past_full_buffer"] == [{"eval/accuracy": 0.5}]
    assert trainer["empty_wait"] == "trainer: no experiences arrived for 1s (explorer stalled?)"
    stalls = trainer["stalls"]  # every 0.3 s of waiting, each at or after its due time
    assert len(stalls) == 3 and all(s >= 0.3 * (i + 1) for i, s in enumerate(stalls)) and stalls == sorted(stalls)
    assert trainer["final"] == {"eval/accuracy": 0.75}
    assert trainer["no_final"] == "trainer: no final evaluation from explorer0 for 0s (explorer stalled?)"
