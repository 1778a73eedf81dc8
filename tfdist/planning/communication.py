"""Communication: bytes and alpha-beta times of the gradient exchange, and what compression saves.

With K = gradient bytes, N = replicas, a = latency per message, b = seconds
per byte (1 / bandwidth):

- ring all-reduce: each rank sends (and receives) 2(N-1)/N * K bytes, nearly
  independent of N; T = 2(N-1)a + 2(N-1)/N * K * b;
- central reducer (reduce to one device, one parameter server):
  2(N-1) * K bytes pass through it, T = 2(N-1)(a + K b);
- IndexedSlices gradients (an Embedding's) are all-gathered, rows and ids,
  not summed (`sparse_exchange`);
- ZeRO stages and compression scale the all-reduce's bytes
  (`relative_traffic`, `compressed_gradient_bytes`);
- ZeRO stage 3 with `shard_remat` (the default) gathers each weight twice and
  recomputes the forward pass (1.5x the bytes, `recomputed_forward_passes`);
  without it, 1.0x and no recomputation;
- `recommend` picks a gradient compression for the planner and `auto` from
  the alpha-beta time of each method plus its compute overhead: PowerSGD's
  own matmuls, orthogonalisation and error feedback (`powersgd_seconds`: about
  6 n m r + 3 n m FLOPs and 13 x 4 n m bytes per compressed n x m gradient, each
  op at the slower of the device's FLOP and memory rates), and the latency of
  each of its collectives (`powersgd_collectives`).

    >>> ring_allreduce_bytes_per_rank(100e6, 8)
    175000000.0

No TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from tfdist import config as config_lib
from tfdist.planning.hardware import Link
from tfdist.planning.units import check_positive, format_bytes, format_seconds


def _check_k_n(gradient_bytes: float, num_replicas: int) -> None:
    check_positive("gradient_bytes", gradient_bytes, allow_zero=True)
    check_positive("num_replicas", num_replicas, integer=True)


def ring_allreduce_bytes_per_rank(gradient_bytes: float, num_replicas: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce: 2(N-1)/N * K."""
    _check_k_n(gradient_bytes, num_replicas)
    n = num_replicas
    return 2.0 * (n - 1) / n * gradient_bytes


def central_reducer_bytes(gradient_bytes: float, num_replicas: int) -> float:
    """Bytes through one reducer: N-1 gradients in, N-1 results out: 2(N-1) * K."""
    _check_k_n(gradient_bytes, num_replicas)
    return 2.0 * (num_replicas - 1) * gradient_bytes


def parameter_server_bytes(gradient_bytes: float, *, num_workers: int, num_ps: int) -> float:
    """Bytes through each parameter server per round of one step on every worker.

    Each worker pushes K gradient bytes and pulls K parameter bytes, spread
    evenly over the servers: 2 * W * K / P through each.
    """
    check_positive("gradient_bytes", gradient_bytes, allow_zero=True)
    check_positive("num_workers", num_workers, integer=True)
    check_positive("num_ps", num_ps, integer=True)
    return 2.0 * num_workers * gradient_bytes / num_ps


def ring_allreduce_time(gradient_bytes: float, num_replicas: int, link: Link) -> float:
    """alpha-beta ring all-reduce: T = 2(N-1) a + 2(N-1)/N * K * b (0 for one replica)."""
    _check_k_n(gradient_bytes, num_replicas)
    n = num_replicas
    return 2 * (n - 1) * link.latency + ring_allreduce_bytes_per_rank(gradient_bytes, n) \
        * link.seconds_per_byte


def central_reducer_time(gradient_bytes: float, num_replicas: int, link: Link) -> float:
    """alpha-beta central reducer: T = 2(N-1)(a + K b): its link carries every message."""
    _check_k_n(gradient_bytes, num_replicas)
    return 2 * (num_replicas - 1) * link.latency + central_reducer_bytes(
        gradient_bytes, num_replicas) * link.seconds_per_byte


def parameter_server_time(gradient_bytes: float, *, num_workers: int, num_ps: int,
                          link: Link) -> float:
    """alpha-beta time for one step of every worker through the busiest server."""
    volume = parameter_server_bytes(gradient_bytes, num_workers=num_workers, num_ps=num_ps)
    return 2 * num_workers * link.latency + volume * link.seconds_per_byte


def sparse_exchange(gradients: Sequence[Any], *, per_replica_batch_size: int,
                    num_replicas: int, link: Link) -> tuple[float, float]:
    """(seconds, bytes each rank sends) of exchanging IndexedSlices gradients per step.

    TensorFlow's collective all-reduce (`multi_worker_mirrored`, and
    `mirrored` on CPUs or with cross_device_ops="ring") does not sum an
    IndexedSlices: it all-gathers it (CollectiveReplicaLauncher's
    all_reduce_indexed_slices): one all-gather of each replica's row count
    (4 bytes), then one of its values and one of its indices (rows = the
    `SparseGradient`'s rows per example x the per-replica batch). A ring
    all-gather of b bytes per rank sends (N-1) b and takes (N-1)(a + b / bandwidth).
    Gradient compression leaves them as they are (`tfdist.comm.sync`).

    Args:
      gradients: `tfdist.planning.SparseGradient`s (`ModelStats.sparse_gradients`).
      per_replica_batch_size: examples each replica looks up per step.
      num_replicas: N.
      link: the alpha-beta link of the exchange.
    """
    check_positive("per_replica_batch_size", per_replica_batch_size, integer=True)
    check_positive("num_replicas", num_replicas, integer=True)
    n = num_replicas
    seconds = sent = 0.0
    for g in gradients:
        rows = g.rows_per_example * per_replica_batch_size
        for size in (4, rows * g.row_bytes, rows * g.index_bytes):
            sent += (n - 1) * size
            seconds += (n - 1) * (link.latency + size * link.seconds_per_byte)
    return seconds, sent


def fit_alpha_beta(points: Sequence[tuple[float, float]], num_replicas: int, *,
                   relative: bool = True) -> Link:
    """Calibrates a ring all-reduce link from measured (bytes, seconds) points.

    Least squares for T = 2(N-1) a + 2(N-1)/N * K * b with a, b >= 0. With
    `relative` (default) each point's residual is divided by its measured
    time, so small and large messages count alike (the model is judged by
    relative error); otherwise large messages dominate.

    Raises:
      ValueError: fewer than two distinct sizes, a non-positive time, or a
        fit with no positive bandwidth.
    """
    check_positive("num_replicas", num_replicas, integer=True)
    if num_replicas < 2:
        raise ValueError(
            f"An all-reduce needs >= 2 replicas. Received: num_replicas={num_replicas}")
    pts = [(float(k), float(t)) for k, t in points]
    if len({k for k, _ in pts}) < 2:
        raise ValueError(
            "fit_alpha_beta needs measurements at two or more message sizes. "
            f"Received: {len(pts)} point(s) at sizes {sorted({k for k, _ in pts})}"
        )
    if any(t <= 0 for _, t in pts):
        raise ValueError(f"Measured times must be > 0. Received: {pts}")
    n = num_replicas
    xs = [2 * (n - 1) / n * k for k, _ in pts]  # bytes per rank
    ts = [t for _, t in pts]
    ws = [1 / t**2 if relative else 1.0 for t in ts]

    def solve(with_intercept: bool) -> tuple[float, float]:
        sw = sum(ws)
        swx = sum(w * x for w, x in zip(ws, xs))
        swt = sum(w * t for w, t in zip(ws, ts))
        swxx = sum(w * x * x for w, x in zip(ws, xs))
        swxt = sum(w * x * t for w, x, t in zip(ws, xs, ts))
        if not with_intercept:
            return 0.0, swxt / swxx
        det = sw * swxx - swx * swx
        return (swxx * swt - swx * swxt) / det, (sw * swxt - swx * swt) / det

    intercept, beta = solve(True)
    if intercept < 0:  # refit through the origin: latency 0
        intercept, beta = solve(False)
    if beta <= 0:
        raise ValueError(
            "The measurements do not grow with message size, so no bandwidth can be fitted "
            f"(slope {beta:.3g} s/byte). Measure larger messages."
        )
    return Link(bandwidth=1.0 / beta, latency=intercept / (2 * (n - 1)))


# --- ZeRO stages and compression ------------------------------------------------

# Bytes each replica moves per step, relative to a ring all-reduce of its gradients, by ZeRO
# stage (docs/sharding.md): stage 1 all-reduces the whole gradient, then all-gathers the
# updated shards (1 + 1/2); stage 2 reduce-scatters instead (the same bytes as the
# all-reduce's two halves: 1); stage 3 reduce-scatters its gradients (1/2) and all-gathers
# each sharded weight in the forward pass (1/2) and, with `shard_remat` (the default), again
# in the backward pass, where keras.remat recomputes the layer's forward (1/2 more: 1.5).
# With shard_remat=False a layer keeps the weights it gathered until its backward pass:
# one gather per weight per step (1.0), no recomputed forward.
SHARDED_TRAFFIC = {0: 1.0, 1: 1.5, 2: 1.0, 3: 1.5}
STAGE3_NO_REMAT_TRAFFIC = 1.0


def relative_traffic(*, stage: int = 0, compression: str = "none",
                     remat: bool = True) -> float:
    """Gradient-exchange bytes per step relative to plain data parallelism's all-reduce.

    `stage`: ZeRO stage 0-3 (`SHARDED_TRAFFIC`); `remat`: stage 3's
    `shard_remat` (False: each weight gathered once per step, 1.0; ignored at
    other stages); `compression`: none, fp16 or bf16 (the ratio of
    `COMPRESSED_BYTES_PER_NUMBER`; powersgd depends on the shapes: use
    `compressed_gradient_bytes`).
    """
    if stage not in SHARDED_TRAFFIC:
        raise ValueError(f"stage must be 0, 1, 2 or 3. Received: stage={stage!r}")
    if compression not in ("none", "fp16", "bf16"):
        raise ValueError("compression must be none, fp16 or bf16 (powersgd's bytes depend on "
                         "the shapes: use compressed_gradient_bytes). Received: "
                         f"compression={compression!r}")
    if not isinstance(remat, bool):
        raise ValueError(f"remat must be True or False. Received: remat={remat!r}")
    ratio = COMPRESSED_BYTES_PER_NUMBER[compression] / COMPRESSED_BYTES_PER_NUMBER["none"]
    traffic = STAGE3_NO_REMAT_TRAFFIC if stage == 3 and not remat else SHARDED_TRAFFIC[stage]
    return traffic * ratio


def recomputed_forward_passes(*, stage: int = 0, remat: bool = True) -> float:
    """Extra forward passes per step: 1 at stage 3 with `shard_remat` (keras.remat), else 0.

    A training step is about 3 forward passes of FLOPs (forward + backward), so
    stage 3 with remat computes about 4/3 of plain data parallelism's step (the
    layers that own sharded weights; `tfdist.sharding` runs every such layer under
    keras.remat).
    """
    if stage not in SHARDED_TRAFFIC:
        raise ValueError(f"stage must be 0, 1, 2 or 3. Received: stage={stage!r}")
    return 1.0 if stage == 3 and remat else 0.0


COMPRESSED_BYTES_PER_NUMBER = {"none": 4, "fp16": 2, "bf16": 2, "powersgd": 4}


def compressed_gradient_bytes(shapes: Sequence[Sequence[int]], *, compression: str = "none",
                              rank: int = 4) -> int:
    """Bytes one replica contributes to the all-reduces per step (float32 gradients).

    none: every gradient (4 bytes a number); fp16/bf16: 2 bytes a number;
    powersgd: (n + m) * rank numbers for each weight matrix it compresses
    (`tfdist.comm.powersgd.compresses`), the others whole.
    """
    from tfdist.comm import powersgd

    if compression not in COMPRESSED_BYTES_PER_NUMBER:
        raise ValueError(f"compression must be one of {', '.join(COMPRESSED_BYTES_PER_NUMBER)}. "
                         f"Received: compression={compression!r}")
    per_number = COMPRESSED_BYTES_PER_NUMBER[compression]
    if compression != "powersgd":
        return per_number * sum(math.prod(int(d) for d in s) for s in shapes)
    return per_number * sum(powersgd.wire_numbers(s, rank) for s in shapes)


def _layout(shapes: Sequence[Sequence[int]], bucket_bytes: int,
            layers: Sequence | None, *, split: bool) -> list:
    """`tfdist.comm.buckets.layout` of float32 gradients of `shapes`, last first, as
    `tfdist.comm.sync.CommSync` lays them out."""
    from tfdist.comm import buckets

    if layers is not None and len(layers) != len(shapes):
        raise ValueError(f"layers has {len(layers)} entries for {len(shapes)} shapes; pass "
                         "one layer per shape (e.g. tfdist.comm.buckets.layer_of of each "
                         "trainable variable), in the same order.")
    return buckets.layout([math.prod(int(d) for d in s) for s in reversed(shapes)],
                          bucket_bytes, split=split,
                          layers=None if layers is None else list(reversed(layers)))


def bucket_collectives(shapes: Sequence[Sequence[int]], *, bucket_bytes: int = 0,
                       layers: Sequence | None = None) -> int:
    """All-reduces of the dense gradients per step without PowerSGD (`CommSync.sum_dense`).

    Without `bucket_bytes`: one. With it: the float32 gradients, last first,
    go into buckets of at most `bucket_bytes` cut at layer boundaries
    (`layers`: each shape's layer; None: each shape its own), a layer larger
    than that cut into ceil(bytes / bucket_bytes) spans of its own
    (`tfdist.comm.buckets.layout`; counted in float32 bytes with fp16/bf16
    too); each bucket is one collective.
    """
    check_positive("bucket_bytes", bucket_bytes, integer=True, allow_zero=True)
    if not shapes:
        return 0
    if not bucket_bytes:
        return 1
    return len(_layout(shapes, bucket_bytes, layers, split=True))


def powersgd_collectives(shapes: Sequence[Sequence[int]], rank: int, *,
                         bucket_bytes: int = 0, layers: Sequence | None = None) -> int:
    """All-reduces PowerSGD launches per step, as `tfdist.comm.sync.CommSync` runs it.

    The dense gradients, last first, are grouped whole into buckets of about
    `bucket_bytes` cut at layer boundaries (0: one bucket; a layer larger than
    that is one bucket; `layers` as in `bucket_collectives`); a bucket holding a
    compressed matrix runs two collectives (its P's packed with its
    uncompressed gradients, then its Q's), one holding none runs one.
    """
    from tfdist.comm import powersgd

    compressed = [powersgd.compresses(s, rank) for s in reversed(shapes)]
    return sum(2 if any(compressed[segment.item] for segment in bucket) else 1
               for bucket in _layout(shapes, bucket_bytes, layers, split=False))


def _powersgd_ops(n: int, m: int, rank: int) -> list[tuple[float, float]]:
    """(FLOPs, bytes read and written) of each op `CommSync._compressed` runs on an n x m gradient.

    float32 throughout; r = rank, N-independent.
    """
    r = rank
    return [
        (n * m, 3 * 4 * n * m),                              # A = G + E
        (2 * n * m * r, 4 * (n * m + m * r + n * r)),        # P = A Q
        (4 * n * r**2 - 4 * r**3 / 3, 4 * 2 * n * r),        # P's thin Q (Householder QR)
        (2 * n * m * r, 4 * (n * m + n * r + m * r)),        # Q = A^T P
        (2 * n * m * r, 4 * (n * r + m * r + n * m)),        # P Q^T
        (n * m, 2 * 4 * n * m),                              # P Q^T / N
        (n * m, 3 * 4 * n * m),                              # E = A - P Q^T / N
        (0, 2 * 4 * n * m),                                  # E assigned (a copy)
    ]


def _powersgd_matrices(shapes: Sequence[Sequence[int]], rank: int) -> list[tuple[int, int]]:
    from tfdist.comm import powersgd

    check_positive("rank", rank, integer=True)
    return [powersgd.matrix_shape(s) for s in shapes if powersgd.compresses(s, rank)]


def powersgd_flops(shapes: Sequence[Sequence[int]], rank: int) -> float:
    """FLOPs of PowerSGD's own work per step on one replica (`CommSync._compressed`).

    Per compressed gradient viewed as an n x m matrix, at rank r:
    the error feedback A = G + E (n m); P = A Q (2 n m r); P's orthonormal
    basis, a Householder QR with its thin Q formed (4 n r^2 - 4 r^3 / 3);
    Q = A^T P (2 n m r); the approximation P Q^T (2 n m r); the new error
    E = A - P Q^T / N (2 n m): about 6 n m r + 3 n m. Gradients sent whole
    cost nothing extra.
    """
    return float(sum(f for n, m in _powersgd_matrices(shapes, rank)
                     for f, _ in _powersgd_ops(n, m, rank)))


def powersgd_bytes(shapes: Sequence[Sequence[int]], rank: int) -> float:
    """Bytes PowerSGD's own ops read and write per step on one replica (float32).

    The same ops as `powersgd_flops`: each streams the n x m matrix (reading
    its inputs, writing its output), 13 x 4 n m bytes per compressed gradient
    in all (the error assignment counted as a copy), plus the n x r and m x r
    factors.
    """
    return float(sum(b for n, m in _powersgd_matrices(shapes, rank)
                     for _, b in _powersgd_ops(n, m, rank)))


def powersgd_seconds(shapes: Sequence[Sequence[int]], rank: int, *, flops_per_second: float,
                     bytes_per_second: float | None = None) -> float:
    """PowerSGD's own compute per step: each op at the slower of its FLOPs and its bytes.

    A roofline per op: max(FLOPs / `flops_per_second`, bytes / `bytes_per_second`).
    The rank-r products do 2r FLOPs per number of the n x m matrix they stream and
    the error feedback fewer than one, so where the memory rate is known (a
    measured streaming rate, e.g. `a + b` over gradient-sized tensors) it is
    what bounds them on a CPU. Without it, FLOPs alone (a lower bound).
    """
    check_positive("flops_per_second", flops_per_second)
    if bytes_per_second is not None:
        check_positive("bytes_per_second", bytes_per_second)
    total = 0.0
    for n, m in _powersgd_matrices(shapes, rank):
        for flops, nbytes in _powersgd_ops(n, m, rank):
            seconds = flops / flops_per_second
            if bytes_per_second is not None:
                seconds = max(seconds, nbytes / bytes_per_second)
            total += seconds
    return total


def compressed_allreduce_time(shapes: Sequence[Sequence[int]], num_replicas: int, link: Link,
                              *, compression: str = "none", rank: int = 4,
                              bucket_bytes: int = 0, layers: Sequence | None = None) -> float:
    """alpha-beta time of one step's gradient exchange with `compression`.

    One ring all-reduce of the compressed bytes, paying the latency once per
    collective: none/fp16/bf16 run one per bucket of `bucket_bytes`
    (`bucket_collectives`; one without buckets); PowerSGD runs two per bucket
    that holds a compressed matrix (P with the uncompressed gradients, then Q;
    `powersgd_collectives`), so pays it at least twice. Its local compute is
    `powersgd_flops`, costed by `candidates`.
    """
    total = compressed_gradient_bytes(shapes, compression=compression, rank=rank)
    rounds = powersgd_collectives(shapes, rank, bucket_bytes=bucket_bytes, layers=layers) \
        if compression == "powersgd" else max(1, bucket_collectives(
            shapes, bucket_bytes=bucket_bytes, layers=layers))
    if num_replicas < 2:
        return 0.0
    return (rounds - 1) * 2 * (num_replicas - 1) * link.latency + ring_allreduce_time(
        total, num_replicas, link)


# --- choosing a compression (the planner and `auto`) ------------------------------------


def _powersgd():
    from tfdist.comm import powersgd

    return powersgd


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
               link: Link, compute_seconds: float, gradient_bytes: int | None = None,
               flops_per_second: float = 100e9,
               rank: int = config_lib.DEFAULT_POWERSGD_RANK,
               bucket_bytes: int = 0,
               bytes_per_second: float | None = None,
               layers: Sequence | None = None) -> list[CompressionCost]:
    """The cost of every method (no overlap of compute and communication assumed).

    Each method's step is `compute_seconds` + its exchange's alpha-beta time
    (`compressed_allreduce_time`: the latency once per collective) + its own
    compute. PowerSGD's is `powersgd_seconds`: each of its ops at the slower of
    its FLOPs / `flops_per_second` and its bytes / `bytes_per_second`. Pass
    the rates the device reaches (training FLOPs / measured step; a measured
    streaming rate), not datasheet peaks. Its rank-r products stream each n x m
    gradient for 2r FLOPs per number, so on a CPU the memory rate bounds them;
    without `bytes_per_second` the estimate is FLOPs alone, a lower bound.
    Casting to fp16/bf16 is costed as free.

    Args:
      shapes: the trainable variables' shapes (needed for powersgd).
      gradient_bytes: float32 gradient bytes, when the shapes are not known
        (`ModelStats.gradient_bytes`): none, fp16 and bf16 are costed, not _powersgd().
      flops_per_second: the device's FLOP rate for PowerSGD's compute.
      bucket_bytes: `bucket_bytes` of the exchange (one collective per bucket,
        two for a PowerSGD bucket that holds a compressed matrix).
      bytes_per_second: the device's memory streaming rate (None: unknown).
      layers: each shape's layer, where buckets are cut (None: each shape its
        own; `tfdist.comm.buckets.layer_of` of each trainable variable).
    """
    if shapes is None:
        if gradient_bytes is None:
            raise ValueError("Pass shapes=[...] (the trainable variables' shapes) or "
                             "gradient_bytes=K. Received neither.")
        shapes = [(max(1, int(gradient_bytes) // 4),)]  # one vector: never factorised
        layers = None
    methods = [m for m in config_lib.GRADIENT_COMPRESSIONS
               if m != "powersgd" or any(_powersgd().compresses(s, rank) for s in shapes)]
    rows = []
    for method in methods:
        wire = compressed_gradient_bytes(shapes, compression=method, rank=rank)
        comm = compressed_allreduce_time(shapes, num_replicas, link, compression=method,
                                         rank=rank, bucket_bytes=bucket_bytes, layers=layers)
        extra = 0.0
        if method == "powersgd":
            extra = powersgd_seconds(shapes, rank, flops_per_second=flops_per_second,
                                     bytes_per_second=bytes_per_second)
        rows.append(CompressionCost(method, wire, comm, extra, compute_seconds + comm + extra))
    return rows


def recommend(*, shapes: Sequence[Sequence[int]] | None = None, num_replicas: int,
              link: Link, compute_seconds: float, gradient_bytes: int | None = None,
              flops_per_second: float = 100e9,
              rank: int = config_lib.DEFAULT_POWERSGD_RANK,
              bucket_bytes: int = 0,
              bytes_per_second: float | None = None,
              layers: Sequence | None = None) -> tuple[str, str]:
    """(compression, reason): the fastest method, or "none" when communication is small."""
    rows = candidates(shapes=shapes, num_replicas=num_replicas, link=link,
                      compute_seconds=compute_seconds, gradient_bytes=gradient_bytes,
                      flops_per_second=flops_per_second, rank=rank, bucket_bytes=bucket_bytes,
                      bytes_per_second=bytes_per_second, layers=layers)
    plain = rows[0]
    if num_replicas < 2:
        return "none", "one replica: nothing crosses the wire"
    share = plain.comm_seconds / plain.step_seconds
    if share < MIN_COMM_SHARE:
        return "none", (f"the all-reduce of {format_bytes(plain.wire_bytes)} takes "
                        f"{share:.0%} of the step: compression would gain little")
    best = min(rows, key=lambda r: r.step_seconds)
    if best.compression == "none":
        return "none", "no method is predicted faster than the plain all-reduce"
    return best.compression, (
        f"the all-reduce takes {share:.0%} of the step; {best.compression} sends "
        f"{format_bytes(best.wire_bytes)} instead of {format_bytes(plain.wire_bytes)}"
        f" per replica: predicted step {format_seconds(best.step_seconds)} vs "
        f"{format_seconds(plain.step_seconds)}")
