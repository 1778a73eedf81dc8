"""What gradient compression saves, for the planner and `auto` (no TensorFlow needed).

    choice = tfdist.comm.planning.recommend(shapes=[(784, 512), (512,), ...],
                                            num_replicas=2, link=cost.Link(...),
                                            compute_seconds=0.05)
    choice.compression, choice.reason

The cost of a method is the alpha-beta time of its all-reduces
(`tfdist.cost.compressed_allreduce_time`) plus a compute overhead: PowerSGD
multiplies each compressed n x m gradient by Q and P (4 n m r FLOPs) and
orthogonalises P. The planner's data-driven candidates call `candidates()`
(one row per method: bytes per step, seconds per step); with only the gradient
bytes (`ModelStats.gradient_bytes`) it costs none, fp16 and bf16.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tfdist import config as config_lib
from tfdist import cost
from tfdist.comm import powersgd

# Below this share of the step spent in communication, compression is not worth its
# numerical change: the step would be at most this much faster.
MIN_COMM_SHARE = 0.10


@dataclasses.dataclass(frozen=True)
class CompressionCost:
    """One method for one model and cluster.

    Attributes:
      compression: "none", "fp16", "bf16" or "powersgd".
      wire_bytes: bytes one replica contributes to the all-reduces per step.
      comm_seconds: alpha-beta time of those all-reduces.
      compute_seconds: extra compute per step (PowerSGD's matmuls).
      step_seconds: `compute_seconds` of the model plus the above.
    """

    compression: str
    wire_bytes: int
    comm_seconds: float
    compute_seconds: float
    step_seconds: float


def candidates(*, shapes: Sequence[Sequence[int]] | None = None, num_replicas: int,
               link: cost.Link, compute_seconds: float, gradient_bytes: int | None = None,
               flops_per_second: float = 100e9,
               rank: int = config_lib.DEFAULT_POWERSGD_RANK) -> list[CompressionCost]:
    """The cost of every method (no overlap of compute and communication assumed).

    Args:
      shapes: the trainable variables' shapes (needed for powersgd).
      gradient_bytes: float32 gradient bytes, when the shapes are not known
        (`ModelStats.gradient_bytes`): none, fp16 and bf16 are costed, not powersgd.
    """
    if shapes is None:
        if gradient_bytes is None:
            raise ValueError("Pass shapes=[...] (the trainable variables' shapes) or "
                             "gradient_bytes=K. Received neither.")
        shapes = [(max(1, int(gradient_bytes) // 4),)]  # one vector: never factorised
    methods = [m for m in config_lib.GRADIENT_COMPRESSIONS
               if m != "powersgd" or any(powersgd.compresses(s, rank) for s in shapes)]
    rows = []
    for method in methods:
        wire = cost.compressed_gradient_bytes(shapes, compression=method, rank=rank)
        comm = cost.compressed_allreduce_time(shapes, num_replicas, link, compression=method,
                                              rank=rank)
        extra = 0.0
        if method == "powersgd":
            flops = sum(4 * n * m * rank for n, m in (
                powersgd.matrix_shape(s) for s in shapes if powersgd.compresses(s, rank)))
            extra = flops / flops_per_second
        rows.append(CompressionCost(method, wire, comm, extra, compute_seconds + comm + extra))
    return rows


def recommend(*, shapes: Sequence[Sequence[int]] | None = None, num_replicas: int,
              link: cost.Link, compute_seconds: float, gradient_bytes: int | None = None,
              flops_per_second: float = 100e9,
              rank: int = config_lib.DEFAULT_POWERSGD_RANK) -> tuple[str, str]:
    """(compression, reason): the fastest method, or "none" when communication is small."""
    rows = candidates(shapes=shapes, num_replicas=num_replicas, link=link,
                      compute_seconds=compute_seconds, gradient_bytes=gradient_bytes,
                      flops_per_second=flops_per_second, rank=rank)
    plain = rows[0]
    if num_replicas < 2:
        return "none", "one replica: nothing crosses the wire"
    share = plain.comm_seconds / plain.step_seconds
    if share < MIN_COMM_SHARE:
        return "none", (f"the all-reduce of {cost.format_bytes(plain.wire_bytes)} takes "
                        f"{share:.0%} of the step: compression would gain little")
    best = min(rows, key=lambda r: r.step_seconds)
    if best.compression == "none":
        return "none", "no method is predicted faster than the plain all-reduce"
    return best.compression, (
        f"the all-reduce takes {share:.0%} of the step; {best.compression} sends "
        f"{cost.format_bytes(best.wire_bytes)} instead of {cost.format_bytes(plain.wire_bytes)}"
        f" per replica: predicted step {cost.format_seconds(best.step_seconds)} vs "
        f"{cost.format_seconds(plain.step_seconds)}")
