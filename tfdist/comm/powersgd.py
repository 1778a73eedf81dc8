"""PowerSGD: rank-r gradient approximation with error feedback (Vogels et al. 2019).

The reference design is PyTorch's `powerSGD_hook` (torch/distributed/algorithms/
ddp_comm_hooks/powerSGD_hook.py): per weight matrix M (the gradient plus this
replica's error), P = M Q is all-reduced and orthogonalised, Q = M^T P is
all-reduced, M is replaced by P Q^T, and the error M - P Q^T is kept for the
next step; Q is kept too (warm start). Two all-reduces of (n + m) r numbers
replace one of n m.

tfdist follows Keras's convention: each replica's gradient is already scaled
so that the SUM over replicas is the step's gradient (Keras divides the loss
by the replica count). With A_i = M_i + e_i on replica i, the exchanged P and
Q are sums, so the approximation P Q^T approximates sum_i A_i, and replica i
keeps e_i = A_i - P Q^T / N. Everything that crosses the wire, and so the
update, depends only on sum_i e_i: a backup that saves that sum (the
error variables are `SyncOnRead` with SUM aggregation) and restores it split
evenly resumes the same training.

Pure functions of shapes here (which variables are compressed, how many
numbers cross the wire); the TensorFlow side is in `tfdist.comm.sync`.
"""

from __future__ import annotations

import math
from typing import Sequence

# Compress a matrix only if it shrinks at least this much (PyTorch's
# min_compression_rate default): small matrices cost two collectives for little.
MIN_COMPRESSION_RATE = 2.0


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """The (rows, columns) a weight of `shape` is viewed as; None for scalars and vectors.

    Keras kernels keep the output dimension last (Dense (in, out), Conv2D
    (h, w, in, out)), so every leading dimension becomes a row.
    """
    shape = [int(d) for d in shape]
    if len(shape) < 2:
        return None
    return math.prod(shape[:-1]), shape[-1]


def compresses(shape: Sequence[int], rank: int) -> bool:
    """True if a gradient of `shape` is sent as rank-`rank` factors (else sent whole)."""
    matrix = matrix_shape(shape)
    if matrix is None:
        return False
    n, m = matrix
    return (n + m) * rank * MIN_COMPRESSION_RATE < n * m


def check_rank(named_shapes: Sequence[tuple[str, Sequence[int]]], rank: int) -> None:
    """Raises ValueError if `rank` exceeds the smaller dimension of every weight matrix.

    A matrix with a dimension smaller than the rank is sent whole, as every matrix that a
    rank-`rank` factorisation would not shrink (`compresses`), like PyTorch's PowerSGD
    hook: e.g. BERT's (2, hidden) segment embedding or a 2-class logits kernel at rank 4.
    A rank that fits no matrix at all compresses nothing and is refused.

    Args:
      named_shapes: (variable path, shape) of every trainable variable.
      rank: the PowerSGD rank.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"powersgd_rank must be an integer >= 1. Received: powersgd_rank={rank!r}")
    matrices = [(name, shape, min(matrix_shape(shape))) for name, shape in named_shapes
                if matrix_shape(shape) is not None]
    if not matrices or any(limit >= rank for _, _, limit in matrices):
        return
    name, shape, limit = max(matrices, key=lambda m: m[2])
    raise ValueError(
        f"powersgd_rank={rank} is larger than the smaller dimension of every weight matrix "
        f"(the largest, variable {name!r}, has shape {tuple(shape)}, viewed as a "
        f"{matrix_shape(shape)[0]} x {matrix_shape(shape)[1]} matrix): a rank-{rank} "
        f"approximation exists for none of them, so nothing would be compressed. Use "
        f"powersgd_rank <= {limit}.")


def wire_numbers(shape: Sequence[int], rank: int) -> int:
    """Numbers one replica contributes to the all-reduces for a gradient of `shape`."""
    if compresses(shape, rank):
        n, m = matrix_shape(shape)
        return (n + m) * rank
    return math.prod(int(d) for d in shape)
