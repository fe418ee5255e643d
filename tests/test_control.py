"""The control channel (common/runtime/control.py): evaluations and the end of the run travel apart from experiences."""

import multiprocessing as mp
import time

import pytest

from common.runtime.control import ControlChannel


def test_final_evaluation_and_the_messages_before_it():
    channel = ControlChannel(mp.get_context("spawn"))
    channel.send("eval", {"eval/accuracy": 0.5})
    channel.send("final", {"eval/accuracy": 0.75}, explorer=0)
    final, others = channel.wait_final(timeout=10)
    assert final == {"eval/accuracy": 0.75}
    assert [(m.kind, m.metrics) for m in others] == [("eval", {"eval/accuracy": 0.5})]
    assert channel.poll() == []


def test_waiting_for_a_final_evaluation_that_never_comes_fails_with_a_message():
    channel = ControlChannel(mp.get_context("spawn"))
    with pytest.raises(TimeoutError, match="trainer: no final evaluation from the explorer for 0s"):
        channel.wait_final(timeout=0.2)


def test_a_final_evaluation_that_arrives_while_polling_is_kept():
    """A fast final evaluation (vLLM: milliseconds) can arrive before the trainer's last poll for evaluations."""
    channel = ControlChannel(mp.get_context("spawn"))
    channel.send("eval", {"eval/accuracy": 0.5})
    channel.send("final", {"eval/accuracy": 0.75})
    deadline = time.time() + 10
    polled = []
    while channel._final is None and time.time() < deadline:
        polled += channel.poll()
    assert [m.metrics for m in polled] == [{"eval/accuracy": 0.5}]
    assert channel.wait_final(timeout=0.1)[0] == {"eval/accuracy": 0.75}
