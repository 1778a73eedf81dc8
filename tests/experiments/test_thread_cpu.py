"""experiments/thread_cpu.py: CPU per step by thread name, from /proc."""

import os
import time

import pytest

from experiments import thread_cpu


def _fake_tasks(root, threads):
    """A /proc/<pid>/task look-alike: {tid: (name, utime, stime, preempted)}."""
    for tid, (name, utime, stime, preempted) in threads.items():
        os.makedirs(root / str(tid), exist_ok=True)
        # Fields after the name: state ppid pgrp session tty tpgid flags minflt cminflt
        # majflt cmajflt utime stime ...
        rest = ["S", "1", "1", "1", "0", "-1", "0", "0", "0", "0", "0", str(utime), str(stime),
                "0", "0", "20", "0"]
        (root / str(tid) / "stat").write_text(f"{tid} ({name}) " + " ".join(rest) + "\n")
        (root / str(tid) / "status").write_text(
            f"Name:\t{name}\nvoluntary_ctxt_switches:\t9\n"
            f"nonvoluntary_ctxt_switches:\t{preempted}\n")


def test_per_step_ms_sums_threads_of_one_name(tmp_path):
    before_dir, after_dir = tmp_path / "before", tmp_path / "after"
    # Two pool threads share a name; a name with a space and parentheses; a thread that
    # starts in between counts from 0, one that ended in between not at all.
    _fake_tasks(before_dir, {10: ("tf_Compute", 100, 0, 3), 11: ("tf_Compute", 50, 10, 0),
                             12: ("my (odd) name", 5, 5, 1), 13: ("gone", 7, 0, 2)})
    _fake_tasks(after_dir, {10: ("tf_Compute", 140, 0, 11), 11: ("tf_Compute", 60, 20, 0),
                            12: ("my (odd) name", 5, 5, 1), 14: ("event_engine", 3, 1, 4)})
    before, after = thread_cpu.snapshot(str(before_dir)), thread_cpu.snapshot(str(after_dir))
    assert before["12"] == ("my (odd) name", 10, 1)
    by_name = thread_cpu.per_step_ms(before, after, steps=4, ticks_per_second=100)
    # tf_Compute: 40 + 20 ticks = 600 ms over 4 steps; event_engine 4 ticks = 40 ms.
    assert by_name == {"tf_Compute": 150.0, "event_engine": 10.0}
    assert list(by_name) == ["tf_Compute", "event_engine"]  # largest first
    # Preempted: tf_Compute 8 times, event_engine 4 (from 0) over 4 steps.
    assert thread_cpu.per_step_preempted(before, after, steps=4) == {
        "tf_Compute": 2.0, "event_engine": 1.0}
    with pytest.raises(ValueError, match="steps must be at least 1. Received: 0"):
        thread_cpu.per_step_ms(before, after, steps=0)
    assert thread_cpu.snapshot(str(tmp_path / "missing")) == {}


def test_mean_and_describe():
    mean = thread_cpu.mean_by_name([{"a": 10.0, "b": 2.0}, {"a": 20.0, "c": 8.0}])
    assert mean == {"a": 15.0, "c": 4.0, "b": 1.0}
    assert list(mean) == ["a", "c", "b"]
    assert thread_cpu.mean_by_name([]) == {}
    assert thread_cpu.describe(mean, top=2) == "a 15.0 ms, c 4.0 ms, other threads 1.0 ms"
    assert thread_cpu.describe({}) == "none measured"
    assert thread_cpu.describe({"a": 2.0}, unit="") == "a 2.0"


def test_a_busy_thread_is_charged_and_a_sleeping_one_is_not():
    """The live /proc: 300 ms of busy work on this (main) thread shows under its name;
    300 ms of sleep does not (the negative control)."""
    me = thread_cpu.snapshot()[str(os.getpid())][0]  # the main thread's tid is the pid

    def charged(work):
        before = thread_cpu.snapshot()
        work()
        return thread_cpu.per_step_ms(before, thread_cpu.snapshot(), steps=1).get(me, 0.0)

    def busy():
        end = time.process_time() + 0.3
        while time.process_time() < end:
            pass

    assert charged(busy) >= 200.0  # clock ticks are 10 ms; the burn is 300 ms of CPU
    assert charged(lambda: time.sleep(0.3)) <= 30.0


def test_a_thread_that_shares_its_core_is_preempted():
    """Pinned to one core with a busy process beside it, a busy thread is switched out
    while it could run, over and over (the scheduler shares the core in slices)."""
    import subprocess
    import sys

    me = thread_cpu.snapshot()[str(os.getpid())].name
    mask = os.sched_getaffinity(0)
    core = min(mask)
    rival = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(rival.pid, {core})
        os.sched_setaffinity(0, {core})
        before = thread_cpu.snapshot()
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            pass
        preempted = thread_cpu.per_step_preempted(before, thread_cpu.snapshot(), steps=1)
    finally:
        os.sched_setaffinity(0, mask)
        rival.kill()
        rival.wait()
    assert preempted.get(me, 0) >= 3, preempted
