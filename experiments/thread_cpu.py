"""CPU time and preemptions of a process's threads, by thread name, from /proc (Linux).

A benchmark takes a `snapshot()` before and after the steps it times; `per_step_ms` gives
each thread name's CPU per step between the two, so a worker's extra CPU can be placed:
TensorFlow's compute threads (`tf_Compute`, `tf_numa_*_Eigen`), its collective threads
(`collective_ops`), gRPC's (`event_engine`, `grpc_*`) or the Python thread that runs the
loop (named as the process is). `per_step_preempted` gives how often each was switched out
while it could still run (the kernel's nonvoluntary context switches): on a core shared with
other threads, each costs the thread its caches. Threads of one name are summed (a pool's
threads share it); a thread that started in between counts from 0, one that ended not at all.
"""

from __future__ import annotations

import os
from typing import NamedTuple

TASKS = "/proc/self/task"


class Thread(NamedTuple):
    name: str
    ticks: int  # user + system CPU, in clock ticks
    preempted: int  # nonvoluntary context switches


def snapshot(tasks: str = TASKS) -> dict[str, Thread]:
    """{thread id: Thread} of every thread now; {} where /proc is not there."""
    threads = {}
    try:
        tids = os.listdir(tasks)
    except OSError:
        return threads
    for tid in tids:
        try:
            with open(os.path.join(tasks, tid, "stat")) as f:
                stat = f.read()
            with open(os.path.join(tasks, tid, "status")) as f:
                status = f.read()
        except OSError:  # the thread ended in between
            continue
        # "tid (name) state ppid ...": the name may hold spaces and parentheses.
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        preempted = next((int(line.split()[1]) for line in status.splitlines()
                          if line.startswith("nonvoluntary_ctxt_switches:")), 0)
        threads[tid] = Thread(name, int(fields[11]) + int(fields[12]), preempted)
    return threads


def _per_name(before: dict, after: dict, field: str, steps: int, scale: float):
    if steps < 1:
        raise ValueError(f"steps must be at least 1. Received: {steps}")
    by_name: dict[str, int] = {}
    for tid, now in after.items():
        then = before.get(tid)
        used = getattr(now, field) - (getattr(then, field) if then else 0)
        by_name[now.name] = by_name.get(now.name, 0) + used
    return {name: used * scale / steps
            for name, used in sorted(by_name.items(), key=lambda kv: -kv[1]) if used > 0}


def per_step_ms(before: dict, after: dict, steps: int,
                ticks_per_second: int | None = None) -> dict[str, float]:
    """{thread name: CPU ms per step} between two snapshots, largest first, names that
    used none left out."""
    hz = ticks_per_second or os.sysconf("SC_CLK_TCK")
    return _per_name(before, after, "ticks", steps, 1e3 / hz)


def per_step_preempted(before: dict, after: dict, steps: int) -> dict[str, float]:
    """{thread name: times switched out while runnable, per step} between two snapshots,
    largest first, names never preempted left out."""
    return _per_name(before, after, "preempted", steps, 1.0)


def since(before: dict, steps: int) -> dict[str, dict[str, float]]:
    """{"cpu_ms_by_thread": per_step_ms, "preempted_by_thread": per_step_preempted} from
    `before` to now."""
    after = snapshot()
    return {"cpu_ms_by_thread": per_step_ms(before, after, steps),
            "preempted_by_thread": per_step_preempted(before, after, steps)}


def mean_by_name(per_process: list[dict[str, float]]) -> dict[str, float]:
    """The mean over processes of per_step_* results (a name a process lacks counts 0),
    largest first."""
    if not per_process:
        return {}
    total: dict[str, float] = {}
    for one in per_process:
        for name, value in one.items():
            total[name] = total.get(name, 0.0) + value
    return {name: value / len(per_process)
            for name, value in sorted(total.items(), key=lambda kv: -kv[1])}


def describe(by_name: dict[str, float], top: int = 4, unit: str = " ms") -> str:
    """'tf_Compute 170.4 ms, python 6.9 ms, ...' (the `top` largest, the rest summed)."""
    items = list(by_name.items())
    text = [f"{name} {value:.1f}{unit}" for name, value in items[:top]]
    rest = sum(value for _, value in items[top:])
    if rest:
        text.append(f"other threads {rest:.1f}{unit}")
    return ", ".join(text) or "none measured"
