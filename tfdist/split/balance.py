"""Automatic and rule-based plans for a Keras model.

`plan_balanced` cuts the model's layers (in execution order, nested models
flattened) into K contiguous stages minimising the most loaded stage, where
a layer's load is its parameter bytes, its forward FLOPs (counted from the
traced graph: tfdist.planning.flops), or its measured forward time, divided
by the stage device's relative speed (`device_weights`, for unequal
devices). The layer costs are `tfdist.planning.pipeline.layer_costs`, the cut
`tfdist.planning.pipeline.balance_contiguous`, the one partitioner the
planner uses too. Like torchtitan's default pipeline split, a balanced plan
is a good start, not necessarily the fastest: activations crossing the cuts
and per-op overheads are not in the cost.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from tfdist.planning.pipeline import (  # noqa: F401 (layer_costs: tfdist.split's public name)
    BALANCE_BY,
    BalanceBy,
    balance_contiguous,
    layer_costs,
    layer_graph,
)
from tfdist.devices import canonical_device
from tfdist.split import plan as plan_lib


def _default_devices(num_stages: int) -> list[str]:
    from tfdist import devices as devices_lib

    return list(devices_lib.resolve_devices(None, num_stages))


def plan_balanced(model, num_stages: int, *, by: BalanceBy = "params",
                  device_weights: Sequence[float] | None = None,
                  devices: Sequence[str] | None = None,
                  input_shapes=None) -> plan_lib.SplitPlan:
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
      A SplitPlan.

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
    graph = layer_graph(model)
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
    devices = [canonical_device(d) for d in devices]
    if len(devices) != num_stages:
        raise ValueError(f"Need one device per stage ({num_stages}). Received: devices={devices}")
    costs = layer_costs(graph, by, input_shapes=input_shapes)
    if sum(costs) <= 0:
        costs = [1.0] * len(costs)  # e.g. no parameters at all: balance layer counts
    stage_of = balance_contiguous(costs, device_weights)
    return plan_lib.SplitPlan(assignments=tuple((n, devices[s]) for n, s in zip(names, stage_of)))


def plan_from_rules(model, rules: Mapping[str, str]) -> plan_lib.SplitPlan:
    """A plan from {regex: device} rules; each layer must match exactly one rule.

    Like keras.distribution.LayoutMap, a layer matching several rules is an
    error rather than a guess; so is a layer matching none, and a rule that
    matches no layer (usually a typo). Layers of nested models are named
    "<nested model>/<layer>".

    Example:
      >>> plan = tfdist.split.plan_from_rules(model, {"^enc": "/cpu:0", "^dec|^head": "/cpu:1"})
    """
    return plan_lib.SplitPlan(assignments=plan_lib.rules_to_assignments(
        layer_graph(model).layer_names, rules))
