"""CPU time of a process's threads, by thread name, from /proc (Linux).

A benchmark takes a `snapshot()` before and after the steps it times; `per_step_ms` gives
each thread name's CPU per step between the two, so a worker's extra CPU can be placed:
TensorFlow's compute threads (`tf_Compute`, `tf_numa_*_Eigen`), its collective threads
(`collective_ops`), gRPC's (`event_engine`, `grpc_*`) or the Python thread that runs the
loop (named as the process is). Threads of one name are summed (a pool's threads share
it); a thread that started or ended in between counts from 0 or not at all.
"""

from __future__ import annotations

import os

TASKS = "/proc/self/task"


def snapshot(tasks: str = TASKS) -> dict[str, tuple[str, int]]:
    """{thread id: (name, user + system clock ticks)} of every thread now; {} where /proc
    is not there."""
    threads = {}
    try:
        tids = os.listdir(tasks)
    except OSError:
        return threads
    for tid in tids:
        try:
            with open(os.path.join(tasks, tid, "stat")) as f:
                stat = f.read()
        except OSError:  # the thread ended in between
            continue
        # "tid (name) state ppid ...": the name may hold spaces and parentheses.
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        threads[tid] = (name, int(fields[11]) + int(fields[12]))  # utime, stime
    return threads


def per_step_ms(before: dict, after: dict, steps: int,
                ticks_per_second: int | None = None) -> dict[str, float]:
    """{thread name: CPU ms per step} between two snapshots, largest first, names that
    used none left out."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1. Received: {steps}")
    hz = ticks_per_second or os.sysconf("SC_CLK_TCK")
    by_name: dict[str, int] = {}
    for tid, (name, ticks) in after.items():
        used = ticks - before.get(tid, (name, 0))[1]
        by_name[name] = by_name.get(name, 0) + used
    return {name: ticks * 1e3 / hz / steps
            for name, ticks in sorted(by_name.items(), key=lambda kv: -kv[1]) if ticks > 0}


def mean_by_name(per_process: list[dict[str, float]]) -> dict[str, float]:
    """The mean over processes of per_step_ms results (a name a process lacks counts 0),
    largest first."""
    if not per_process:
        return {}
    total: dict[str, float] = {}
    for one in per_process:
        for name, ms in one.items():
            total[name] = total.get(name, 0.0) + ms
    return {name: ms / len(per_process)
            for name, ms in sorted(total.items(), key=lambda kv: -kv[1])}


def describe(by_name: dict[str, float], top: int = 4) -> str:
    """'tf_Compute 170.4 ms, python 6.9 ms, ...' (the `top` largest, the rest summed)."""
    items = list(by_name.items())
    text = [f"{name} {ms:.1f} ms" for name, ms in items[:top]]
    rest = sum(ms for _, ms in items[top:])
    if rest:
        text.append(f"other threads {rest:.1f} ms")
    return ", ".join(text) or "none measured"
