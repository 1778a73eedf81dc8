"""Automatic and rule-based plans for a Keras model.

`plan_balanced` cuts the model's layers (in order) into K contiguous stages
minimising the most loaded stage, where a layer's load is its parameter
bytes, its estimated forward FLOPs, or its measured forward time, divided
by the stage device's relative speed (`device_weights`, for unequal
devices). Like torchtitan's default pipeline split, a balanced plan is a
good start, not necessarily the fastest: activations crossing the cuts and
per-op overheads are not in the cost.
"""

from __future__ import annotations

import time
from typing import Literal, Mapping, Sequence

import numpy as np

from tfdist.split import plan as plan_lib

BalanceBy = Literal["params", "flops", "time"]
BALANCE_BY: tuple[str, ...] = ("params", "flops", "time")


def _layers(model):
    from tfdist.split import graph

    return graph.source_layers(model)


def param_bytes(layer) -> int:
    return int(sum(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize for w in layer.weights))


def _output_shape(layer):
    try:
        out = layer.output
    except (AttributeError, ValueError):
        return None
    import keras

    flat = keras.tree.flatten(out)
    return tuple(flat[0].shape) if flat else None


def forward_flops(layer) -> float:
    """Per-sample forward FLOPs: 2 x kernel size x output positions (+ one per output).

    Exact for Dense and convolutions; an elementwise estimate for layers
    without a kernel. Falls back to 2 x parameters when shapes are unknown.
    """
    shape = _output_shape(layer)
    kernel = sum(int(np.prod(w.shape)) for w in layer.trainable_weights if len(w.shape) >= 2)
    if shape is None:
        return 2.0 * sum(int(np.prod(w.shape)) for w in layer.weights)
    dims = [d for d in shape[1:] if d is not None]
    out_elems = float(np.prod(dims)) if dims else 1.0
    positions = float(np.prod(dims[:-1])) if len(dims) > 1 else 1.0
    return 2.0 * kernel * positions + out_elems


def measured_seconds(layer, *, batch_size: int = 32, repeats: int = 5) -> float:
    """Median wall time of one forward call of `layer` on random inputs."""
    import keras

    try:
        inputs = layer.input
    except (AttributeError, ValueError):
        raise ValueError(
            f"Cannot time layer {layer.name!r}: its input shape is unknown (subclassed "
            "model never called symbolically?). Use by='params' or by='flops'."
        ) from None
    rng = np.random.default_rng(0)

    def sample(kt):
        shape = [batch_size] + [d if d is not None else 1 for d in kt.shape[1:]]
        if "int" in str(kt.dtype):
            return np.zeros(shape, dtype=str(kt.dtype))
        return rng.standard_normal(shape).astype(str(kt.dtype))

    args = keras.tree.map_structure(sample, inputs)
    layer(args)  # warm-up (builds kernels / traces)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = layer(args)
        for t in keras.tree.flatten(out):
            np.asarray(t)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def layer_costs(model, by: BalanceBy) -> list[float]:
    """One cost per layer of the plan (model.layers order, no InputLayers)."""
    if by not in BALANCE_BY:
        raise ValueError(f"by must be one of {BALANCE_BY}. Received: by={by!r}")
    layers = _layers(model)
    if by == "params":
        return [float(param_bytes(l)) for l in layers]
    if by == "flops":
        return [forward_flops(l) for l in layers]
    return [measured_seconds(l) for l in layers]


def _default_devices(num_stages: int) -> list[str]:
    from tfdist import devices as devices_lib

    return list(devices_lib.resolve_devices(None, num_stages))


def plan_balanced(model, num_stages: int, *, by: BalanceBy = "params",
                  device_weights: Sequence[float] | None = None,
                  devices: Sequence[str] | None = None) -> plan_lib.Plan:
    """Cuts the model's layers into `num_stages` contiguous, balanced stages.

    Args:
      model: a built Keras model.
      num_stages: K >= 1; at most the number of layers.
      by: "params" (parameter bytes), "flops" (estimated forward FLOPs) or
        "time" (measured forward time of each layer, batch 32).
      device_weights: relative speed of each stage's device (default all 1):
        a device with weight 2 gets about twice the load.
      devices: one device per stage (default: the first K logical devices).

    Returns:
      A Plan.

    Raises:
      ValueError: K < 1, fewer layers than stages, bad weights or devices.

    Example:
      >>> plan = tfdist.split.plan_balanced(model, 2, by="flops")
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an integer >= 1. Received: num_stages={num_stages!r}")
    names = [l.name for l in _layers(model)]
    if len(names) < num_stages:
        raise ValueError(
            f"Model {model.name!r} has {len(names)} layer(s) but num_stages={num_stages}: every "
            f"stage needs at least one layer. Use num_stages <= {len(names)}.")
    if device_weights is None:
        device_weights = [1.0] * num_stages
    device_weights = [float(w) for w in device_weights]
    if len(device_weights) != num_stages or any(not w > 0 for w in device_weights):
        raise ValueError(
            f"device_weights must be {num_stages} positive numbers (one per stage). "
            f"Received: device_weights={device_weights!r}")
    if devices is None:
        devices = _default_devices(num_stages)
    devices = [plan_lib.canonical_device(d) for d in devices]
    if len(devices) != num_stages:
        raise ValueError(f"Need one device per stage ({num_stages}). Received: devices={devices}")
    costs = layer_costs(model, by)
    if sum(costs) <= 0:
        costs = [1.0] * len(costs)  # e.g. no parameters at all: balance layer counts
    stage_of = plan_lib.balance_contiguous(costs, device_weights)
    return plan_lib.Plan(assignments=tuple((n, devices[s]) for n, s in zip(names, stage_of)))


def plan_from_rules(model, rules: Mapping[str, str]) -> plan_lib.Plan:
    """A plan from {regex: device} rules; each layer must match exactly one rule.

    Like keras.distribution.LayoutMap, a layer matching several rules is an
    error rather than a guess; so is a layer matching none, and a rule that
    matches no layer (usually a typo).

    Example:
      >>> plan = tfdist.split.plan_from_rules(model, {"^enc": "/cpu:0", "^dec|^head": "/cpu:1"})
    """
    return plan_lib.Plan(assignments=plan_lib.rules_to_assignments(
        [l.name for l in _layers(model)], rules))
