"""Bytes of training state each device really holds, read from the variables and the graph.

    report = tfdist.sharding.memory.state_bytes(model)
    report["/job:localhost/replica:0/task:0/device:CPU:1"]
    # {"parameters": ..., "gradients": ..., "optimizer": ..., "non_trainable": ...}

- parameters, non_trainable: the model's variables, each piece where it lives
  (a shard, a mirrored copy);
- optimizer: the optimizer's variables (slots and its step counter and
  learning rate), each piece where it lives (the host with offload);
- gradients: the reduced gradients the optimizer update received in the
  last traced training step, on each replica (the graph's tensors). A
  sharding strategy records them; for another strategy tfdist made, call
  `record_gradients(strategy)` before training. Absent until recorded.

These are what `tfdist.planning.sharded_state_bytes` predicts (tests/sharding/).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tfdist import sync as sync_lib


def state_bytes(model: Any) -> dict[str, dict[str, int]]:
    """Per device: bytes of parameters, gradients, optimizer state and other model state.

    Args:
      model: a Keras model built (and, for gradients, trained a step) under a
        strategy.

    Returns:
      {device: {"parameters", "optimizer", "non_trainable"[, "gradients"]}}.
    """
    from tfdist.compat import sharding_variables

    strategy = model.distribute_strategy
    out: dict[str, dict[str, int]] = {}

    def add(device: str, kind: str, size: int) -> None:
        row = out.setdefault(device, {"parameters": 0, "optimizer": 0, "non_trainable": 0})
        row[kind] = row.get(kind, 0) + size

    for variable in model.trainable_variables:
        for device, size in sharding_variables.placed_bytes(variable, strategy):
            add(device, "parameters", size)
    for variable in model.non_trainable_variables:
        for device, size in sharding_variables.placed_bytes(variable, strategy):
            add(device, "non_trainable", size)
    optimizer = getattr(model, "optimizer", None)
    for variable in (optimizer.variables if optimizer is not None else ()):
        for device, size in sharding_variables.placed_bytes(variable, strategy):
            add(device, "optimizer", size)
    sync = sync_lib.gradient_sync(strategy)
    for device, size in getattr(sync, "traced_gradient_bytes", {}).items():
        add(device, "gradients", size)
    return out


def reduced_gradient_bytes(grads_and_vars) -> int:
    """Bytes of these (traced) gradient tensors: values and indices of IndexedSlices.

    A sparse gradient's row count is known only when the step runs (an
    Embedding's reduced IndexedSlices); it is counted at its variable's dense
    size, the most its values can take.
    """
    total = 0
    for gradient, variable in grads_and_vars:
        if gradient is None:
            continue
        sparse = hasattr(gradient, "values") and hasattr(gradient, "indices")
        parts = (gradient.values, gradient.indices) if sparse else (gradient,)
        if sparse and any(p.shape.num_elements() is None for p in parts):
            total += int(np.prod(tuple(variable.shape))) * gradient.values.dtype.size
            continue
        for part in parts:
            elements = part.shape.num_elements()
            if elements is None:
                raise ValueError(f"Cannot count the bytes of a gradient of unknown shape "
                                 f"{part.shape}.")
            total += int(elements) * part.dtype.size
    return total


class RecordingSync(sync_lib.GradientSync):
    """Keras's gradient exchange unchanged, recording the bytes each replica receives.

    Attributes:
      traced_gradient_bytes: per replica device, bytes of the reduced gradients
        handed to the update in the last traced step.
    """

    def __init__(self, strategy: Any):
        self._devices = tuple(strategy.extended.worker_devices)
        self.traced_gradient_bytes: dict[str, int] = {}

    def reduce(self, optimizer, grads_and_vars, keras_all_reduce):
        from tfdist.compat import sharding_collectives

        reduced = sync_lib.DEFAULT_SYNC.reduce(optimizer, grads_and_vars,
                                                      keras_all_reduce)
        device = self._devices[sharding_collectives.local_replica_id()]
        self.traced_gradient_bytes[device] = reduced_gradient_bytes(reduced)
        return reduced


def record_gradients(strategy: Any) -> None:
    """Makes an unsharded strategy tfdist made record its reduced gradients' bytes.

    Sharding strategies record them already. Training is unchanged.

    Raises:
      ValueError: the strategy already exchanges gradients its own way (another
        GradientSync), which this would replace.
    """
    current = sync_lib.gradient_sync(strategy)
    if hasattr(current, "traced_gradient_bytes"):
        return
    if current is not sync_lib.DEFAULT_SYNC:
        raise ValueError(
            "record_gradients() would replace this strategy's own gradient exchange "
            f"({type(current).__name__}). Received a strategy that does not use the default "
            "one. Fix: measure it without that option.")
    sync_lib.set_gradient_sync(strategy, RecordingSync(strategy))
