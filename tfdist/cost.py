"""Deprecated: the cost model moved to `tfdist.planning` (one module per job).

Every name this module had is still importable from here:

    from tfdist import cost             # deprecated
    from tfdist import planning         # instead: planning.parse_bytes, planning.Link, ...

`tfdist.cost.Cluster` (the hardware of several machines) is
`tfdist.planning.HardwareCluster`, named apart from `tfdist.Cluster` (TF_CONFIG).
"""

from __future__ import annotations

import warnings

from tfdist.planning.units import (  # noqa: F401
    DTYPE_BYTES,
    format_bytes,
    format_seconds,
    parse_bandwidth,
    parse_bytes,
    parse_duration,
)
from tfdist.planning.hardware import (  # noqa: F401
    Device,
    HardwareCluster,
    Link,
    Machine,
    as_cluster,
)
from tfdist.planning.stats import (  # noqa: F401
    LayerStats,
    ModelStats,
    model_stats,
)
from tfdist.planning.memory import (  # noqa: F401
    MemoryEstimate,
    OPTIMIZER_SLOTS,
    OptimizerState,
    ShardedStateBytes,
    optimizer_state,
    replica_memory,
    sharded_state_bytes,
    zero_bytes_per_param,
)
from tfdist.planning.communication import (  # noqa: F401
    COMPRESSED_BYTES_PER_NUMBER,
    SHARDED_TRAFFIC,
    central_reducer_bytes,
    central_reducer_time,
    compressed_allreduce_time,
    compressed_gradient_bytes,
    fit_alpha_beta,
    parameter_server_bytes,
    parameter_server_time,
    relative_traffic,
    ring_allreduce_bytes_per_rank,
    ring_allreduce_time,
)
from tfdist.planning.pipeline import (  # noqa: F401
    micro_batches_for_bubble,
    pipeline_bubble,
    pipeline_speedup,
)

Cluster = HardwareCluster

__all__ = [
    "COMPRESSED_BYTES_PER_NUMBER",
    "Cluster",
    "DTYPE_BYTES",
    "Device",
    "LayerStats",
    "Link",
    "Machine",
    "MemoryEstimate",
    "ModelStats",
    "OPTIMIZER_SLOTS",
    "OptimizerState",
    "SHARDED_TRAFFIC",
    "ShardedStateBytes",
    "as_cluster",
    "central_reducer_bytes",
    "central_reducer_time",
    "compressed_allreduce_time",
    "compressed_gradient_bytes",
    "fit_alpha_beta",
    "format_bytes",
    "format_seconds",
    "micro_batches_for_bubble",
    "model_stats",
    "optimizer_state",
    "parameter_server_bytes",
    "parameter_server_time",
    "parse_bandwidth",
    "parse_bytes",
    "parse_duration",
    "pipeline_bubble",
    "pipeline_speedup",
    "relative_traffic",
    "replica_memory",
    "ring_allreduce_bytes_per_rank",
    "ring_allreduce_time",
    "sharded_state_bytes",
    "zero_bytes_per_param",
]

warnings.warn("tfdist.cost is deprecated: import from tfdist.planning instead.",
              DeprecationWarning, stacklevel=2)
