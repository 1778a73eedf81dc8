"""The fix that makes Keras 3 `model.fit` log its step results under MultiWorkerMirroredStrategy.

Upstream: keras-team/keras#20585 (open; also tensorflow/tensorflow#72388).
Keras 3 `fit` on several workers fails twice. The first failure, in
`TensorFlowTrainer._maybe_symbolic_build` ("Attempt to convert a value
(PerReplica...)"), is shared with string and bool inputs on one machine and
is fixed for every tfdist strategy by `tfdist.compat.keras_build`. The second
is here, and passes straight through to Keras unless the strategy was made by
tfdist *and* really spans several workers
(`_collective_all_reduce_multi_worker(strategy)`): a plain model, a user's own
strategy and single-machine presets run Keras's code untouched.

`reduce_per_replica(reduction="auto")` reduces the step's logs (scalar loss
and metric values) with `strategy.reduce("MEAN", v, axis=0)` in multi-worker
mode, which fails on scalars with "Invalid reduction dimension 0 for input
with 0 dimensions". `_make_function` hard-codes "auto", so
`model.distribute_reduction_method` does not help. Fix: use axis=None (the
mean over replicas) for scalars; tensors with a batch dimension keep Keras's
axis=0. A variable (a metric whose `result()` returns its own variable,
keras.io's `CategoricalTruePositives`) holds one value for every replica and
worker already and is returned as it is, as Keras does on one machine (Keras's
multi-worker path fails on it with "Invalid reduction dimension 0", and
TensorFlow's `strategy.reduce(..., axis=None)` with "Cannot convert
`input_tensor` to a `PerReplica` object because it doesn't have device set").

`install()` is idempotent and is called by the multi_worker_mirrored preset
(with `keras_build`'s fix), never at `import tfdist`;
`tfdist.compat.uninstall()` undoes both. The canary,
tests/compat/test_keras_multi_worker.py, runs a real 2-worker `fit` with the fixes
uninstalled and sees both failures (so the fixes are still needed).
"""

from __future__ import annotations

from tfdist.compat import _owner, _patch, keras_build

UPSTREAM_ISSUE = "keras-team/keras#20585 (also tensorflow/tensorflow#72388)"
REDUCE_PER_REPLICA = "keras_multi_worker.reduce_per_replica"


def _trainer_module():
    return _patch.upstream("keras.src.backend.tensorflow.trainer")


def _multi_worker_owned(strategy) -> bool:
    """True for a strategy tfdist made that spans several workers."""
    return (_owner.owns(strategy)
            and bool(_trainer_module()._collective_all_reduce_multi_worker(strategy)))


# --- reduce_per_replica --------------------------------------------------------


def _check_reduce_per_replica(original) -> None:
    _patch.require_signature(original, "values", "strategy", "reduction",
                             what="keras.src.backend.tensorflow.trainer.reduce_per_replica")
    _patch.require_attributes(_trainer_module(), "_collective_all_reduce_multi_worker",
                              what="keras.src.backend.tensorflow.trainer")


def _make_reduce_per_replica(original):
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    import keras
    from keras import tree

    def applies(values, strategy, reduction):
        return reduction in ("auto", "mean") and _multi_worker_owned(strategy)

    @_patch.passthrough(original, applies)
    def reduce_per_replica(values, strategy, reduction):
        def _reduce(v):
            if isinstance(v, (tf.Variable, keras.Variable)):
                # A metric whose `result()` returns its own variable (keras.io's
                # CategoricalTruePositives): read across replicas and workers, it holds one
                # value already; strategy.reduce refuses it ("Cannot convert `input_tensor`
                # to a `PerReplica` object"). Tensors are per worker even when not
                # PerReplica (one local replica), so they are still reduced.
                return v
            local = (strategy.experimental_local_results(v)[0]
                     if isinstance(v, tf.distribute.DistributedValues) else v)
            if tf.is_tensor(local) and local.shape.rank == 0:
                return strategy.reduce("MEAN", v, axis=None)
            return original(v, strategy, reduction)

        return tree.map_structure(_reduce, values)

    return reduce_per_replica


# `_make_function` looks `reduce_per_replica` up in the module at trace time.
REDUCE_PER_REPLICA_FIX = _patch.Fix(
    name=REDUCE_PER_REPLICA,
    issue=UPSTREAM_ISSUE,
    target=lambda: (_trainer_module(), "reduce_per_replica"),
    check=_check_reduce_per_replica,
    make=_make_reduce_per_replica,
)

FIXES = (keras_build.SYMBOLIC_BUILD_FIX, REDUCE_PER_REPLICA_FIX)


def install() -> tuple[str, ...]:
    """Installs this fix and `keras_build`'s, or neither (idempotent, thread-safe).

    Returns:
      The names of the fixes this call installed (() if they already were).

    Raises:
      CompatError: Keras's code is not shaped as the fixes expect (nothing is
        installed then); UnsupportedVersionError outside the supported range.
    """
    return _patch.install_all(FIXES)
