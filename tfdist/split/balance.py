"""Automatic and rule-based plans for a Keras model.

`plan_balanced` cuts the model's layers (in execution order, nested models
flattened) into K contiguous stages minimising the most loaded stage, where
a layer's load is its parameter bytes, its forward FLOPs (counted from the
traced graph: tfdist.flops), or its measured forward time, divided by the
stage device's relative speed (`device_weights`, for unequal devices). The
cut itself is `tfdist.split.plan.balance_contiguous`, the one partitioner
the planner uses too. Like torchtitan's default pipeline split, a balanced
plan is a good start, not necessarily the fastest: activations crossing the
cuts and per-op overheads are not in the cost.
"""

from __future__ import annotations

import time
from typing import Literal, Mapping, Sequence

import numpy as np

from tfdist.split import plan as plan_lib

BalanceBy = Literal["params", "flops", "time"]
BALANCE_BY: tuple[str, ...] = ("params", "flops", "time")


def _graph(model_or_graph, input_shape=None):
    from tfdist.split import graph

    if isinstance(model_or_graph, graph.LayerGraph):
        return model_or_graph
    return graph.flatten(model_or_graph, input_shape=input_shape)


def param_bytes(graph) -> list[int]:
    """Bytes of each layer's variables; a variable shared by two layers counts once."""
    seen: set[int] = set()
    out = []
    for layer in graph.layers.values():
        total = 0
        for w in layer.weights:
            if id(w) in seen:
                continue
            seen.add(id(w))
            total += int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize
        out.append(total)
    return out


def _per_layer(graph, per_node: dict[int, float]) -> list[float]:
    """Sums per-call numbers into the plan's layers; a keras op (x + y) or a
    shared layer's later call counts for the layer whose call came before it."""
    totals = {name: 0.0 for name in graph.layers}
    current = next(iter(graph.layers), None)
    for node in graph.nodes:
        if node.layer is not None and node.first_call:
            current = node.layer
        if current is not None:
            totals[current] += per_node.get(node.index, 0.0)
    return [totals[name] for name in graph.layers]


def forward_flops(graph, input_shapes=None) -> list[float]:
    """Per-example forward FLOPs of each layer, from the traced graph (tfdist.flops)."""
    from tfdist import flops

    costs = flops.trace_costs(graph, input_shapes)
    return _per_layer(graph, {c.node: c.flops for c in costs})


def measured_seconds(graph, *, batch_size: int = 32, repeats: int = 5,
                     input_shapes=None) -> list[float]:
    """Median wall time of each layer's calls on random inputs (eager, one device)."""
    from tfdist import flops
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    specs = flops.input_specs(graph, input_shapes, batch_size=batch_size)
    rng = np.random.default_rng(0)
    inputs = [np.zeros(s.shape, s.dtype.as_numpy_dtype) if s.dtype.is_integer or s.dtype.is_bool
              else rng.standard_normal(s.shape).astype(s.dtype.as_numpy_dtype) for s in specs]
    samples: dict[int, list[float]] = {}

    def timed(node, run):
        start = time.perf_counter()
        run()
        samples.setdefault(node.index, []).append(time.perf_counter() - start)

    flat = [tf.constant(x) for x in inputs]
    graph.run(flat, training=False)  # warm-up: builds and traces kernels
    for _ in range(repeats):
        graph.run(flat, training=False, on_node=timed)
    return _per_layer(graph, {i: float(np.median(t)) for i, t in samples.items()})


def layer_costs(model, by: BalanceBy, *, input_shapes=None) -> list[float]:
    """One cost per layer of the plan (execution order, nested models flattened)."""
    if by not in BALANCE_BY:
        raise ValueError(f"by must be one of {BALANCE_BY}. Received: by={by!r}")
    graph = _graph(model)
    if by == "params":
        return [float(b) for b in param_bytes(graph)]
    if by == "flops":
        return forward_flops(graph, input_shapes)
    return measured_seconds(graph, input_shapes=input_shapes)


def _default_devices(num_stages: int) -> list[str]:
    from tfdist import devices as devices_lib

    return list(devices_lib.resolve_devices(None, num_stages))


def plan_balanced(model, num_stages: int, *, by: BalanceBy = "params",
                  device_weights: Sequence[float] | None = None,
                  devices: Sequence[str] | None = None,
                  input_shapes=None) -> plan_lib.Plan:
    """Cuts the model's layers into `num_stages` contiguous, balanced stages.

    Args:
      model: a built Keras model (or its tfdist.split.graph.LayerGraph).
      num_stages: K >= 1; at most the number of layers.
      by: "params" (parameter bytes), "flops" (forward FLOPs from the traced
        graph) or "time" (measured forward time of each layer, batch 32).
      device_weights: relative speed of each stage's device (default all 1):
        a device with weight 2 gets about twice the load.
      devices: one device per stage (default: the first K logical devices).
      input_shapes: for by="flops"/"time" on models whose inputs have unknown
        dimensions (text: the sequence length), e.g. {"token_ids": (128,)}.

    Returns:
      A Plan.

    Raises:
      ValueError: K < 1, fewer layers than stages, bad weights or devices.

    Example:
      >>> plan = tfdist.split.plan_balanced(model, 2, by="flops")
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an integer >= 1. Received: num_stages={num_stages!r}")
    if by not in BALANCE_BY:
        raise ValueError(f"balance_by must be one of {', '.join(BALANCE_BY)}. "
                         f"Received: balance_by={by!r}")
    graph = _graph(model)
    names = graph.layer_names
    if len(names) < num_stages:
        raise ValueError(
            f"Model {graph.model.name!r} has {len(names)} layer(s) but num_stages={num_stages}: "
            f"every stage needs at least one layer. Use num_stages <= {len(names)}.")
    if device_weights is None:
        device_weights = [1.0] * num_stages
    try:
        device_weights = [float(w) for w in device_weights]
    except (TypeError, ValueError):
        device_weights = [float("nan")]
    if len(device_weights) != num_stages or any(not 0 < w < float("inf") for w in device_weights):
        raise ValueError(
            f"device_weights must be {num_stages} positive numbers (one per stage). "
            f"Received: device_weights={device_weights!r}")
    if devices is None:
        devices = _default_devices(num_stages)
    devices = [plan_lib.canonical_device(d) for d in devices]
    if len(devices) != num_stages:
        raise ValueError(f"Need one device per stage ({num_stages}). Received: devices={devices}")
    costs = layer_costs(graph, by, input_shapes=input_shapes)
    if sum(costs) <= 0:
        costs = [1.0] * len(costs)  # e.g. no parameters at all: balance layer counts
    stage_of = plan_lib.balance_contiguous(costs, device_weights)
    return plan_lib.Plan(assignments=tuple((n, devices[s]) for n, s in zip(names, stage_of)))


def plan_from_rules(model, rules: Mapping[str, str]) -> plan_lib.Plan:
    """A plan from {regex: device} rules; each layer must match exactly one rule.

    Like keras.distribution.LayoutMap, a layer matching several rules is an
    error rather than a guess; so is a layer matching none, and a rule that
    matches no layer (usually a typo). Layers of nested models are named
    "<nested model>/<layer>".

    Example:
      >>> plan = tfdist.split.plan_from_rules(model, {"^enc": "/cpu:0", "^dec|^head": "/cpu:1"})
    """
    return plan_lib.Plan(assignments=plan_lib.rules_to_assignments(
        _graph(model).layer_names, rules))
