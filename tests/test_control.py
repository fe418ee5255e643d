"""The control channel (common/control.py): evaluations and the end of the run travel apart from experiences."""

import multiprocessing as mp

import pytest

from common.control import ControlChannel


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
