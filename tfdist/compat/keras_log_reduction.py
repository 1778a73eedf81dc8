"""One collective for a multi-worker training step's logs, instead of one per value.

Keras 3's TensorFlow trainer reduces what a `fit`/`evaluate` step returns (the
loss and every metric's running value) with `reduce_per_replica` after
`strategy.run`. Under MultiWorkerMirroredStrategy each scalar is its own
cross-worker all-reduce: Keras's own code (`strategy.reduce("MEAN", v,
axis=0)`, which fails on scalars, keras-team/keras#20585) and tfdist's
`keras_multi_worker.reduce_per_replica` alike reduce one value at a time. A
step of a model compiled with one metric therefore runs three collectives one
after the other (the packed gradients, the loss, the metric), each a ring of
2(N-1) messages between N workers, and every further metric adds one more. On
a step whose compute is small that is most of the step (measured in
experiments/bench_multiworker.py).

Fix: the step's floating-point scalar values are stacked, replica by replica,
into one vector per dtype (`strategy.run(tf.stack)`), MEAN-reduced over the
replicas in one collective (`strategy.reduce("MEAN", v, axis=None)`, the same
reduction the per-value path applies to each scalar) and split again. Each
element is the same sum over the same replicas, so the logs equal the
per-value path's. Every other value (tensors with a batch dimension, integer
or string values, values that are not per-replica) goes to the function this
fix wraps, one value at a time, as before.

Pass-through: Keras's (or the wrapped) function runs unchanged unless the
strategy was made by tfdist and spans several workers
(`_collective_all_reduce_multi_worker`), the reduction is "auto"/"mean", and
at least two scalar values qualify. Installed by the multi_worker_mirrored
preset after `keras_multi_worker`'s fix (so it wraps that one); undone by
`tfdist.compat.uninstall()`. Canary: tests/comm/test_log_reduction.py counts
the collectives of a traced 2-worker step with this fix taken out (one per
log value) and with it (one for all of them).
"""

from __future__ import annotations

from tfdist.compat import _patch, keras_multi_worker

UPSTREAM_ISSUE = ("keras-team/keras#20585 (Keras's multi-worker log reduction; every value "
                  "its own collective)")
NAME = "keras_log_reduction.reduce_per_replica"


# The same function keras_multi_worker's fix wraps, shape-checked the same way.
_trainer_module = keras_multi_worker._trainer_module
_check = keras_multi_worker._check_reduce_per_replica


_multi_worker_owned = keras_multi_worker._multi_worker_owned


def packable_indices(flat: list, strategy) -> dict:
    """{dtype: [indices]} of the per-replica floating-point scalars in `flat`, in order.

    A per-replica value is a `DistributedValues` whose local results are all
    scalars; with one replica on this worker (a CPU per worker),
    `strategy.run` returns the local replica's tensor itself, so a plain
    scalar tensor counts then too.
    """
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    one_local_replica = len(strategy.extended.worker_devices) == 1
    groups: dict = {}
    for i, value in enumerate(flat):
        if isinstance(value, tf.distribute.DistributedValues):
            local = strategy.experimental_local_results(value)
        elif one_local_replica and isinstance(value, tf.Tensor):
            local = (value,)
        else:
            continue
        if not all(isinstance(t, tf.Tensor) and t.shape.rank == 0 and t.dtype.is_floating
                   for t in local):
            continue
        groups.setdefault(local[0].dtype, []).append(i)
    return groups


def _make(original):
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    from keras import tree

    def _groups(values, strategy):
        return packable_indices(tree.flatten(values), strategy)

    def applies(values, strategy, reduction):
        return (reduction in ("auto", "mean") and _multi_worker_owned(strategy)
                and sum(len(g) for g in _groups(values, strategy).values()) >= 2)

    @_patch.passthrough(original, applies)
    def reduce_per_replica(values, strategy, reduction):
        flat = tree.flatten(values)
        reduced: dict[int, object] = {}
        # Groups in order of first appearance: every worker traces the same
        # structure, so every worker launches the same collectives in the same order.
        for indices in _groups(values, strategy).values():
            if len(indices) < 2:
                continue
            scalars = tuple(flat[i] for i in indices)
            if any(isinstance(v, tf.distribute.DistributedValues) for v in scalars):
                stacked = strategy.run(lambda *local: tf.stack(local), args=scalars)
            else:  # the one local replica's own tensors
                stacked = tf.stack(scalars)
            mean = strategy.reduce("MEAN", stacked, axis=None)
            for i, part in zip(indices, tf.unstack(mean, num=len(indices))):
                reduced[i] = part
        out = [reduced[i] if i in reduced else original(v, strategy, reduction)
               for i, v in enumerate(flat)]
        return tree.pack_sequence_as(values, out)

    return reduce_per_replica


# `_make_function` looks `reduce_per_replica` up in the module at trace time.
FIX = _patch.Fix(
    name=NAME,
    issue=UPSTREAM_ISSUE,
    target=lambda: (_trainer_module(), "reduce_per_replica"),
    check=_check,
    make=_make,
)


def install() -> tuple[str, ...]:
    """Installs the fix (idempotent, thread-safe).

    Returns:
      The names of the fixes this call installed (() if it already was).

    Raises:
      CompatError: Keras's code is not shaped as the fix expects (nothing is
        installed then); UnsupportedVersionError outside the supported range.
    """
    return _patch.install_all((FIX,))
