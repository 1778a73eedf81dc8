"""Two fixes that make Keras 3 `model.fit` work under MultiWorkerMirroredStrategy.

Upstream: keras-team/keras#20585 (open; also tensorflow/tensorflow#72388).
Both replace Keras code (keras/src/backend/tensorflow/trainer.py), and both
pass straight through to Keras unless the model's strategy was made by
tfdist *and* really spans several workers
(`_collective_all_reduce_multi_worker(strategy)`): a plain model, a user's
own strategy and single-machine presets run Keras's code untouched.

1. `TensorFlowTrainer._maybe_symbolic_build` builds the model before `fit`
   from the first batch. With a distributed batch it calls
   `strategy.reduce("MEAN", <tuple of PerReplica>)` to turn it into one
   tensor; `CollectiveAllReduceExtended._reduce_to` does not take nested
   values, so fit dies with "Attempt to convert a value (PerReplica...)".
   The reduce is not needed at all: the symbolic build only uses shapes and
   dtypes, which every local replica's batch has. Fix: take the first local
   replica's batch. (The alternative, teaching TensorFlow's `_reduce_to` to
   map over structures, changes `strategy.reduce` for every user and still
   runs a needless cross-worker all-reduce of the whole first batch.)
   Shape relied on: the epoch iterator is iterable and yields tuples whose
   last item is the data iterator (Keras 3.10 yields `(step, iterator)`,
   3.11.3 and later `(begin_step, end_step, iterator)`; both work). Keras
   3.5's epoch iterator is not iterable: refused at install.

2. `reduce_per_replica(reduction="auto")` reduces the step's logs (scalar
   loss and metric values) with `strategy.reduce("MEAN", v, axis=0)` in
   multi-worker mode, which fails on scalars with "Invalid reduction
   dimension 0 for input with 0 dimensions". `_make_function` hard-codes
   "auto", so `model.distribute_reduction_method` does not help. Fix: use
   axis=None (the mean over replicas) for scalars; tensors with a batch
   dimension keep Keras's axis=0.

`install()` is idempotent and is called by the multi_worker_mirrored preset,
never at `import tfdist`; `tfdist.compat.uninstall()` undoes both. The
canary, tests/test_compat_multi_worker.py, runs a real 2-worker `fit` with
the fixes uninstalled and sees both failures (so the fixes are still needed).
"""

from __future__ import annotations

import inspect

from tfdist.compat import _owner, _patch

UPSTREAM_ISSUE = "keras-team/keras#20585 (also tensorflow/tensorflow#72388)"
SYMBOLIC_BUILD = "keras_multi_worker.symbolic_build"
REDUCE_PER_REPLICA = "keras_multi_worker.reduce_per_replica"


def _trainer_module():
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from keras.src.backend.tensorflow import trainer

    return trainer


def _multi_worker_owned(strategy) -> bool:
    """True for a strategy tfdist made that spans several workers."""
    return (_owner.owns(strategy)
            and bool(_trainer_module()._collective_all_reduce_multi_worker(strategy)))


# --- 1. _maybe_symbolic_build ----------------------------------------------------


def _check_symbolic_build(original) -> None:
    trainer = _trainer_module()
    _patch.require_signature(original, "iterator", "data_batch",
                             what="TensorFlowTrainer._maybe_symbolic_build")
    _patch.require_attributes(trainer.TensorFlowTrainer, "_symbolic_build",
                              what="TensorFlowTrainer")
    _patch.require_attributes(trainer, "_collective_all_reduce_multi_worker",
                              what="keras.src.backend.tensorflow.trainer")
    # What the replacement iterates: Keras's epoch iterator, one step at a time.
    epoch_iterator = trainer.TFEpochIterator
    _patch.require_attributes(epoch_iterator, "__iter__", "__next__", "_enumerate_iterator",
                              what="TFEpochIterator")
    if not inspect.isgeneratorfunction(
            _patch._unwrap_descriptor(inspect.getattr_static(epoch_iterator,
                                                             "_enumerate_iterator"))):
        raise _patch.CompatError(
            "TFEpochIterator._enumerate_iterator is no longer a generator of steps; the tfdist "
            f"fix {SYMBOLIC_BUILD!r} iterates it. See tfdist.compat.SUPPORTED.")


def _data_iterator(step):
    """The data iterator in one item of Keras's epoch iterator (a tuple ending with it)."""
    if isinstance(step, tuple) and step and hasattr(step[-1], "__next__"):
        return step[-1]
    raise _patch.CompatError(
        f"tfdist fix {SYMBOLIC_BUILD!r} ({UPSTREAM_ISSUE}): Keras's epoch iterator yielded "
        f"{type(step).__name__} {step!r:.80}; the fix expects a tuple ending with the data "
        "iterator ((step, iterator) in Keras 3.10, (begin, end, iterator) from 3.11.3). This "
        "Keras version is outside what tfdist supports: see tfdist.compat.SUPPORTED.")


def _make_symbolic_build(original):
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    from keras import tree

    def applies(self, iterator=None, data_batch=None):
        return iterator is not None and _multi_worker_owned(self._distribute_strategy)

    @_patch.passthrough(original, applies)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        for step in iterator:
            batch = next(_data_iterator(step))
            # Shapes and dtypes are all the build needs: no cross-worker reduce.
            data_batch = tree.map_structure(
                lambda v: (strategy.experimental_local_results(v)[0]
                           if isinstance(v, tf.distribute.DistributedValues) else v),
                batch)
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    return _maybe_symbolic_build


SYMBOLIC_BUILD_FIX = _patch.Fix(
    name=SYMBOLIC_BUILD,
    issue=UPSTREAM_ISSUE,
    target=lambda: (_trainer_module().TensorFlowTrainer, "_maybe_symbolic_build"),
    check=_check_symbolic_build,
    make=_make_symbolic_build,
)


# --- 2. reduce_per_replica --------------------------------------------------------


def _check_reduce_per_replica(original) -> None:
    _patch.require_signature(original, "values", "strategy", "reduction",
                             what="keras.src.backend.tensorflow.trainer.reduce_per_replica")
    _patch.require_attributes(_trainer_module(), "_collective_all_reduce_multi_worker",
                              what="keras.src.backend.tensorflow.trainer")


def _make_reduce_per_replica(original):
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    from keras import tree

    def applies(values, strategy, reduction):
        return reduction in ("auto", "mean") and _multi_worker_owned(strategy)

    @_patch.passthrough(original, applies)
    def reduce_per_replica(values, strategy, reduction):
        def _reduce(v):
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

FIXES = (SYMBOLIC_BUILD_FIX, REDUCE_PER_REPLICA_FIX)


def install() -> tuple[str, ...]:
    """Installs both fixes, or neither (idempotent, thread-safe).

    Returns:
      The names of the fixes this call installed (() if they already were).

    Raises:
      CompatError: Keras's code is not shaped as the fixes expect (nothing is
        installed then); UnsupportedVersionError outside the supported range.
    """
    return _patch.install_all(FIXES)
