"""experiments/bucket_timeline.py: reading a step's collectives against its backward pass
from profiler events (made-up events, no TensorFlow), and its bad input."""

import ctypes
import os
import sys
import threading

import pytest

from experiments import bucket_timeline as timeline

SGD = "StatefulPartitionedCall/sgd/CollectiveReduceV2{}:CollectiveReduceV2"
LOGS = "StatefulPartitionedCall/CollectiveReduceV2:CollectiveReduceV2"


def _grad(layer: str) -> str:
    return f"StatefulPartitionedCall/gradient_tape/seq/{layer}/Conv2DBackpropFilter:_Mkl"


def _step(t: float, early: bool) -> list:
    """One step at t seconds: backward ops 0-10 ms, 2 optimizer collectives (one at 4 ms
    when `early`, else both after the backward pass), then the logs' collective."""
    first = t + (0.004 if early else 0.011)
    return [(_grad("conv2d_2"), t, 0.005), (SGD.format(""), first, 0.001),
            (_grad("conv2d_1"), t + 0.005, 0.005), (SGD.format("_1"), t + 0.012, 0.001),
            (LOGS, t + 0.014, 0.001)]


def test_step_summaries_count_the_collectives_started_during_the_backward_pass():
    events = sorted(_step(0.0, True) + _step(0.1, False), key=lambda e: e[1])
    steps = timeline.step_summaries(events, 2)
    assert [s["started_during_backward"] for s in steps] == [1, 0]
    assert steps[0]["backward_ms"] == pytest.approx(10.0)
    assert steps[0]["collective_starts_ms"] == pytest.approx([4.0, 12.0])
    assert steps[1]["collective_starts_ms"] == pytest.approx([11.0, 12.0])
    # Ends, and the collectives' busy time (their union) before the backward pass ends.
    assert steps[0]["collective_ends_ms"] == pytest.approx([5.0, 13.0])
    assert steps[0]["exchange_ms"] == pytest.approx(2.0)
    assert steps[0]["exchange_during_backward_ms"] == pytest.approx(1.0)
    assert steps[1]["exchange_during_backward_ms"] == pytest.approx(0.0)
    # The logs' collective is not one of the optimizer's; 4 do not make 3 equal steps.
    with pytest.raises(ValueError, match="4 optimizer collectives do not divide into 3 steps"):
        timeline.step_summaries(events, 3)


def test_union_counts_overlapping_intervals_once_and_cuts_at_the_limit():
    spans = [(0.0, 4.0), (2.0, 6.0), (10.0, 12.0)]
    assert timeline._union_ms(spans) == pytest.approx(8.0)
    assert timeline._union_ms(spans, until=3.0) == pytest.approx(3.0)
    assert timeline._union_ms(spans, until=11.0) == pytest.approx(7.0)


def test_hidden_share_is_bench_clusters_and_absent_on_loopback():
    shaped = {"step_ms": 150.0, "compute_ms": 100.0, "exchange_alone_ms": 100.0}
    assert timeline._hidden(shaped) == pytest.approx(0.5)
    assert timeline._hidden(dict(shaped, step_ms=250.0)) == 0.0
    assert timeline._hidden({"steps": []}) is None


def test_bad_arguments_name_what_was_received():
    assert timeline.check_arguments(16384, ["1", "2"], 3) == [1, 2]
    assert timeline.check_arguments(0, ["4"], 3, rate=0.3) == [4]
    with pytest.raises(ValueError, match=r"--bucket_bytes must be >= 0 .*Received: -1"):
        timeline.check_arguments(-1, ["1"], 3)
    with pytest.raises(ValueError, match=r"--rate must be > 0 .*Received: 0.0"):
        timeline.check_arguments(1, ["1"], 3, rate=0.0)
    with pytest.raises(ValueError, match=r"--timed_steps must be >= 2. Received: 1"):
        timeline.check_arguments(1, ["1"], 3, timed_steps=1)
    with pytest.raises(ValueError, match=r"--nice_compute must be in 0..19. Received: 20"):
        timeline.check_arguments(1, ["1"], 3, nice_compute=20)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and thread names")
def test_renice_threads_lowers_only_the_named_threads():
    named, release, tid = threading.Event(), threading.Event(), []

    def body():
        libc = ctypes.CDLL(None)
        libc.prctl(15, b"tl_test_pool")  # PR_SET_NAME
        tid.append(threading.get_native_id())
        named.set()
        release.wait(10)

    thread = threading.Thread(target=body)
    thread.start()
    try:
        named.wait(10)
        assert timeline.renice_threads("tl_test_pool", 7) == 1
        assert os.getpriority(os.PRIO_PROCESS, tid[0]) == 7
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != 7
        assert timeline.renice_threads("no_such_thread", 7) == 0
    finally:
        release.set()
        thread.join()
    with pytest.raises(ValueError, match=r"--steps must be >= 1. Received: 0"):
        timeline.check_arguments(1, ["1"], 0)
    with pytest.raises(ValueError, match=r"--inter_op must be integers >= 1, e.g. 1,2. "
                                         r"Received: '1,x'"):
        timeline.check_arguments(1, ["1", "x"], 3)
