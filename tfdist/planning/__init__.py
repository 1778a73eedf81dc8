"""Cost and planning: what a training setup needs in memory and time, and which to choose.

One job per module, none importing TensorFlow at import time:

- units: bytes, bandwidths and durations read from text and printed;
- hardware: `Link`, `Device`, `Machine`, `HardwareCluster` (the alpha-beta model);
- stats: `model_stats` of a built Keras model, with flops (FLOPs traced
  from its forward pass, layer by layer);
- memory: optimizer state, memory per replica, ZeRO-style sharded state;
- communication: bytes and times of the gradient exchange, what compression saves;
- pipeline: the bubble formula, the balanced cut into stages, per-layer costs;
- planner: `plan()` -> a `Recommendation` (the preset to run and why).

    from tfdist import planning
    planning.ring_allreduce_bytes_per_rank(100e6, 8)       # 175000000.0
    planning.pipeline_bubble(stages=4, micro_batches=12)    # 0.2
    recommendation = planning.plan(model, global_batch_size=512, machine=...)

Every public name of those modules is available here; `tfdist.cost` and
`tfdist.planner` are the deprecated former homes.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    # units
    "DTYPE_BYTES": "tfdist.planning.units",
    "format_bytes": "tfdist.planning.units",
    "format_seconds": "tfdist.planning.units",
    "parse_bandwidth": "tfdist.planning.units",
    "parse_bytes": "tfdist.planning.units",
    "parse_duration": "tfdist.planning.units",
    # hardware
    "Device": "tfdist.planning.hardware",
    "HardwareCluster": "tfdist.planning.hardware",
    "Link": "tfdist.planning.hardware",
    "Machine": "tfdist.planning.hardware",
    "as_cluster": "tfdist.planning.hardware",
    # stats
    "LayerStats": "tfdist.planning.stats",
    "ModelStats": "tfdist.planning.stats",
    "SparseGradient": "tfdist.planning.stats",
    "model_stats": "tfdist.planning.stats",
    "sparse_gradients": "tfdist.planning.stats",
    # memory
    "MemoryEstimate": "tfdist.planning.memory",
    "OPTIMIZER_SLOTS": "tfdist.planning.memory",
    "OptimizerState": "tfdist.planning.memory",
    "ShardedStateBytes": "tfdist.planning.memory",
    "exchange_bytes": "tfdist.planning.memory",
    "optimizer_state": "tfdist.planning.memory",
    "replica_memory": "tfdist.planning.memory",
    "sharded_state_bytes": "tfdist.planning.memory",
    "zero_bytes_per_param": "tfdist.planning.memory",
    # communication
    "COMPRESSED_BYTES_PER_NUMBER": "tfdist.planning.communication",
    "CompressionCost": "tfdist.planning.communication",
    "MIN_COMM_SHARE": "tfdist.planning.communication",
    "SHARDED_TRAFFIC": "tfdist.planning.communication",
    "STAGE3_NO_REMAT_TRAFFIC": "tfdist.planning.communication",
    "bucket_collectives": "tfdist.planning.communication",
    "candidates": "tfdist.planning.communication",
    "central_reducer_bytes": "tfdist.planning.communication",
    "central_reducer_time": "tfdist.planning.communication",
    "compressed_allreduce_time": "tfdist.planning.communication",
    "compressed_gradient_bytes": "tfdist.planning.communication",
    "fit_alpha_beta": "tfdist.planning.communication",
    "parameter_server_bytes": "tfdist.planning.communication",
    "parameter_server_time": "tfdist.planning.communication",
    "powersgd_collectives": "tfdist.planning.communication",
    "powersgd_bytes": "tfdist.planning.communication",
    "powersgd_flops": "tfdist.planning.communication",
    "powersgd_seconds": "tfdist.planning.communication",
    "recommend": "tfdist.planning.communication",
    "recomputed_forward_passes": "tfdist.planning.communication",
    "relative_traffic": "tfdist.planning.communication",
    "ring_allreduce_bytes_per_rank": "tfdist.planning.communication",
    "ring_allreduce_time": "tfdist.planning.communication",
    "sparse_exchange": "tfdist.planning.communication",
    # pipeline
    "BALANCE_BY": "tfdist.planning.pipeline",
    "BalanceBy": "tfdist.planning.pipeline",
    "balance_contiguous": "tfdist.planning.pipeline",
    "forward_flops": "tfdist.planning.pipeline",
    "layer_costs": "tfdist.planning.pipeline",
    "measured_seconds": "tfdist.planning.pipeline",
    "micro_batches_for_bubble": "tfdist.planning.pipeline",
    "param_bytes": "tfdist.planning.pipeline",
    "pipeline_bubble": "tfdist.planning.pipeline",
    "pipeline_speedup": "tfdist.planning.pipeline",
    # planner
    "Recommendation": "tfdist.planning.planner",
    "plan": "tfdist.planning.planner",
    "this_machine": "tfdist.planning.planner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tfdist.planning' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
