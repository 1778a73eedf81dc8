"""Communication for the synchronous presets: gradient compression and bucketed all-reduce.

    strategy = tfdist.make_strategy("multi_worker_mirrored",
                                    gradient_compression="powersgd", powersgd_rank=4)

`make_strategy` attaches a `CommSync` (a `GradientSync`) to `mirrored` and
`multi_worker_mirrored` strategies whose options ask for compression or
buckets; see `tfdist.comm.sync` for what crosses the wire and
docs/performance.md for when each method helps.
"""

from __future__ import annotations

from typing import Any

from tfdist import config as config_lib

COMPRESSIONS = config_lib.GRADIENT_COMPRESSIONS

__all__ = ["COMPRESSIONS", "attach", "wants_sync"]


def wants_sync(options: Any) -> bool:
    """True if `options` (a preset's options) ask for compression or buckets."""
    return (getattr(options, "gradient_compression", "none") != "none"
            or bool(getattr(options, "bucket_bytes", 0)))


def attach(strategy: Any, options: Any):
    """Makes `strategy` exchange gradients as `options` say; returns the CommSync.

    Raises:
      ValueError: the strategy does not all-reduce with TensorFlow's
        collectives (e.g. NCCL chosen by "auto" on GPUs).
    """
    from tfdist.comm.sync import CommSync
    from tfdist import sync as sync_lib
    from tfdist.compat import comm_collectives

    sync = CommSync(
        strategy=strategy,
        compression=options.gradient_compression,
        rank=config_lib.powersgd_rank_of(options),  # both only used by powersgd
        warmup_steps=config_lib.powersgd_warmup_of(options),
        bucket_bytes=options.bucket_bytes,
        bucket_priority=options.bucket_priority,
        bytes_per_pack=getattr(options, "bytes_per_pack", 0),
    )
    comm_collectives.install()
    sync_lib.set_gradient_sync(strategy, sync)
    return sync
