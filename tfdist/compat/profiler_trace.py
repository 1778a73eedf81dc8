"""Reading a TensorFlow profiler trace (`tf.profiler.experimental.start/stop`) in Python.

The profiler writes an `XSpace` protobuf (`plugins/profile/<run>/<host>.xplane.pb`);
its message class lives in TensorFlow's private `tensorflow.tsl.profiler.protobuf`.
Used by experiments/bench_allreduce.py to name where an all-reduce's time goes.
"""

from __future__ import annotations

import glob
import os


def host_events(trace_dir: str, *, top: int = 16) -> list[tuple[str, float, int]]:
    """(event name, total seconds, count) of the trace's events, longest total first.

    Raises:
      FileNotFoundError: no `.xplane.pb` under `trace_dir`.
    """
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no profiler trace (*.xplane.pb) under {trace_dir}")
    totals: dict[str, list[float]] = {}
    for path in paths:
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            names = {key: meta.name for key, meta in plane.event_metadata.items()}
            for line in plane.lines:
                for event in line.events:
                    totals.setdefault(names.get(event.metadata_id, "?"), []).append(
                        event.duration_ps / 1e12)
    ranked = sorted(totals.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [(name, sum(seconds), len(seconds)) for name, seconds in ranked]


def timed_events(trace_dir: str, *, contains: str) -> list[tuple[str, float, float]]:
    """(event name, start seconds, duration seconds) of every event whose name contains
    `contains`, in the order they started (times relative to the first such event).

    One event per op run: a profile of K training steps holding N events named
    `...CollectiveReduceV2...` ran N / K collectives per step, in this order.

    Raises:
      FileNotFoundError: no `.xplane.pb` under `trace_dir`.
    """
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no profiler trace (*.xplane.pb) under {trace_dir}")
    found = []
    for path in paths:
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            names = {key: meta.name for key, meta in plane.event_metadata.items()}
            for line in plane.lines:
                for event in line.events:
                    name = names.get(event.metadata_id, "?")
                    if contains in name:
                        start = line.timestamp_ns * 1e-9 + event.offset_ps * 1e-12
                        found.append((name, start, event.duration_ps * 1e-12))
    found.sort(key=lambda e: e[1])
    first = found[0][1] if found else 0.0
    return [(name, start - first, duration) for name, start, duration in found]
