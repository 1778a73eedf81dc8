"""Bytes of training state each device really holds, read from the variables and the graph.

    report = tfdist.sharding.memory.state_bytes(model)
    report["/job:localhost/replica:0/task:0/device:CPU:1"]
    # {"parameters": ..., "gradients": ..., "optimizer": ..., "non_trainable": ...}

- parameters, non_trainable: the model's variables, each piece where it lives
  (a shard, a mirrored copy);
- optimizer: the optimizer's variables (slots and its step counter and
  learning rate), each piece where it lives (the host with offload);
- gradients: the reduced gradients the optimizer update received in the
  last traced training step, on each replica (the graph's tensors). Only a
  sharding strategy records them, after its first step; absent otherwise.

These are what `tfdist.cost.sharded_state_bytes` predicts (see tests).
"""

from __future__ import annotations

from typing import Any


def state_bytes(model: Any) -> dict[str, dict[str, int]]:
    """Per device: bytes of parameters, gradients, optimizer state and other model state.

    Args:
      model: a Keras model built (and, for gradients, trained a step) under a
        strategy.

    Returns:
      {device: {"parameters", "optimizer", "non_trainable"[, "gradients"]}}.
    """
    from tfdist.compat import optimizer_update
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
    sync = optimizer_update.gradient_sync(strategy)
    for device, size in getattr(sync, "traced_gradient_bytes", {}).items():
        add(device, "gradients", size)
    return out
