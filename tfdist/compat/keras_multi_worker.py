"""Two fixes that make Keras 3 `model.fit` work under MultiWorkerMirroredStrategy.

Upstream: keras-team/keras#20585 (open; also tensorflow/tensorflow#72388).
Verified on Keras 3.15 + TensorFlow 2.21. Both patch Keras, not TensorFlow,
and both change behaviour only when the strategy really spans several
workers (`_collective_all_reduce_multi_worker(strategy)` is true), so
single-machine strategies run Keras's own code path untouched.

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

2. `reduce_per_replica(reduction="auto")` reduces the step's logs (scalar
   loss and metric values) with `strategy.reduce("MEAN", v, axis=0)` in
   multi-worker mode, which fails on scalars with "Invalid reduction
   dimension 0 for input with 0 dimensions". `_make_function` hard-codes
   "auto", so `model.distribute_reduction_method` does not help. Fix: use
   axis=None (the mean over replicas) for scalars; tensors with a batch
   dimension keep Keras's axis=0.

`apply()` is idempotent and is called by the multi_worker_mirrored preset,
never at `import tfdist`. tests/test_compat_multi_worker.py fails when the
patched Keras code changes (so the fix must be re-checked) and when upstream
no longer has the bug.
"""

from __future__ import annotations

import inspect
import logging
import threading
import warnings

from tfdist._tf import import_tensorflow
from tfdist.compat import _versions

logger = logging.getLogger("tfdist")

UPSTREAM_ISSUES = ("keras-team/keras#20585", "tensorflow/tensorflow#72388")

# Markers of the upstream code each fix targets; when a marker disappears,
# upstream changed that code and the fix is skipped (with a warning) rather
# than applied blindly.
_SYMBOLIC_BUILD_MARKER = "self.distribute_strategy.reduce("
_REDUCE_PER_REPLICA_MARKER = 'strategy.reduce("MEAN", v, axis=0)'

_lock = threading.Lock()
_applied: dict[str, bool] = {}


def _trainer_module():
    import_tensorflow()
    from keras.src.backend.tensorflow import trainer

    return trainer


def _source(obj) -> str | None:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return None


def symbolic_build_fix_needed() -> bool:
    """True while Keras's `_maybe_symbolic_build` still reduces the first batch."""
    trainer = _trainer_module()
    original = getattr(trainer.TensorFlowTrainer._maybe_symbolic_build,
                       "__tfdist_original__", trainer.TensorFlowTrainer._maybe_symbolic_build)
    source = _source(original)
    return source is not None and _SYMBOLIC_BUILD_MARKER in source


def reduce_per_replica_fix_needed() -> bool:
    """True while Keras's `reduce_per_replica` reduces scalars with axis=0."""
    trainer = _trainer_module()
    original = getattr(trainer.reduce_per_replica, "__tfdist_original__",
                       trainer.reduce_per_replica)
    source = _source(original)
    return source is not None and _REDUCE_PER_REPLICA_MARKER in source


def _patch_symbolic_build(trainer) -> None:
    tf = import_tensorflow()
    from keras.src import tree

    cls = trainer.TensorFlowTrainer
    original = cls._maybe_symbolic_build

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if (iterator is None or strategy is None
                or not trainer._collective_all_reduce_multi_worker(strategy)):
            return original(self, iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:
            batch = next(it)
            # Shapes and dtypes are all the build needs: no cross-worker reduce.
            data_batch = tree.map_structure(
                lambda v: (strategy.experimental_local_results(v)[0]
                           if isinstance(v, tf.distribute.DistributedValues) else v),
                batch)
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    _maybe_symbolic_build.__tfdist_original__ = original
    _maybe_symbolic_build.__doc__ = original.__doc__
    cls._maybe_symbolic_build = _maybe_symbolic_build


def _patch_reduce_per_replica(trainer) -> None:
    tf = import_tensorflow()
    from keras.src import tree

    original = trainer.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not trainer._collective_all_reduce_multi_worker(
                strategy):
            return original(values, strategy, reduction)

        def _reduce(v):
            local = (strategy.experimental_local_results(v)[0]
                     if isinstance(v, tf.distribute.DistributedValues) else v)
            if tf.is_tensor(local) and local.shape.rank == 0:
                return strategy.reduce("MEAN", v, axis=None)
            return original(v, strategy, reduction)

        return tree.map_structure(_reduce, values)

    reduce_per_replica.__tfdist_original__ = original
    reduce_per_replica.__doc__ = original.__doc__
    # `_make_function` looks the function up in the module at trace time.
    trainer.reduce_per_replica = reduce_per_replica


def apply() -> dict[str, bool]:
    """Applies both fixes once (idempotent, thread-safe).

    Returns:
      {"symbolic_build": applied?, "reduce_per_replica": applied?}. A fix is
      not applied when the Keras code it targets no longer has the bug
      (upstream fixed or changed it); tfdist then warns once.
    """
    with _lock:
        if _applied:
            return dict(_applied)
        _versions.check_versions(warn=True)
        trainer = _trainer_module()
        for name, needed, patch in (
            ("symbolic_build", symbolic_build_fix_needed, _patch_symbolic_build),
            ("reduce_per_replica", reduce_per_replica_fix_needed, _patch_reduce_per_replica),
        ):
            if needed():
                patch(trainer)
                _applied[name] = True
                logger.debug("tfdist: applied Keras multi-worker fix %s (%s)", name,
                             UPSTREAM_ISSUES[0])
            else:
                _applied[name] = False
                warnings.warn(
                    f"tfdist.compat.keras_multi_worker: the Keras code fixed by '{name}' "
                    f"({UPSTREAM_ISSUES[0]}) has changed; the fix was not applied. If "
                    "model.fit fails under MultiWorkerMirroredStrategy, check whether "
                    "upstream fixed the bug and update tfdist.",
                    stacklevel=2,
                )
        return dict(_applied)


def applied() -> dict[str, bool]:
    """Which fixes `apply()` installed ({} before the first call)."""
    return dict(_applied)
