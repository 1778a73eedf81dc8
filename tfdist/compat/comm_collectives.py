"""The TensorFlow and Keras touch points of tfdist.comm (gradient compression and buckets).

Two private pieces, each behind one small function:

- `all_reduce_sum(strategy, tensors)`: the replicas' sum of a list of dense
  tensors, launched from the calling replica without `merge_call`, through
  the strategy's `CollectiveAllReduce._all_reduce(reduce_op, value,
  replica_id, options)` (TensorFlow's own merge-free path,
  `MirroredExtended._replica_ctx_all_reduce` /
  `CollectiveAllReduceExtended._replica_ctx_all_reduce`). Unlike the public
  `ReplicaContext.all_reduce`, which goes through `merge_call` on CPUs and
  fails inside `tf.cond` ("merge_call called while defining a new graph"), it
  can run inside a `tf.cond` branch: PowerSGD's warm-up switches between the
  plain and the compressed exchange with one. Each call is one pack, so a
  bucket is one collective that starts as soon as its own inputs exist.
- `STATE_FIX` (`BaseOptimizer.build`): after Keras builds an optimizer of a
  strategy whose GradientSync keeps per-replica state (PowerSGD's error
  feedback and warm-start matrices), the sync creates that state as
  variables of the optimizer, so it exists before `fit` restores a backup
  (`tfdist.BackupAndRestore` restores in `on_train_begin`, before the first
  step traces the update) and is saved with the optimizer. Passes through
  for every optimizer whose strategy tfdist did not make, or whose sync keeps
  no state.

No upstream issue: Keras 3 and TensorFlow have no gradient compression hook
(PyTorch DDP's communication hooks are the reference design).
"""

from __future__ import annotations

from typing import Any, Sequence

from tfdist.compat import _owner, _patch

ISSUE = ("none upstream: Keras 3 / TensorFlow have no gradient-compression hook "
         "(PyTorch DDP communication hooks are the reference design)")


def collective_ops(strategy: Any) -> Any | None:
    """The strategy's CollectiveAllReduce, or None if it reduces some other way."""
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    from tensorflow.python.distribute import cross_device_ops as cdo

    extended = strategy.extended
    ops = getattr(extended, "_cross_device_ops", None)
    if not isinstance(ops, cdo.CollectiveAllReduce):
        getter = getattr(extended, "_get_cross_device_ops", None)
        if getter is not None:
            ops = getter(tf.constant(0.0))  # float values: what gradients use
    return ops if isinstance(ops, cdo.CollectiveAllReduce) else None


def check_collectives(strategy: Any) -> None:
    """Raises ValueError unless `strategy` all-reduces with TensorFlow's collectives."""
    if collective_ops(strategy) is None:
        ops = getattr(strategy.extended, "_cross_device_ops", None)
        raise ValueError(
            "gradient_compression and bucket_bytes need TensorFlow's collective all-reduce "
            "(CollectiveAllReduce: the default on CPUs, cross_device_ops='ring', and "
            f"multi_worker_mirrored); this strategy reduces with {type(ops).__name__}. Use "
            "cross_device_ops='ring' (or 'auto' on CPUs), or drop gradient_compression and "
            "bucket_bytes.")


def all_reduce_sum(strategy: Any, tensors: Sequence[Any], *, bytes_per_pack: int = 0
                   ) -> list[Any]:
    """Sums dense `tensors` over the replicas, from replica context; one pack by default.

    Inside a `tf.function` the collective is launched from this replica alone
    (no `merge_call`), so it may sit in a `tf.cond` branch. Eagerly it falls
    back to `ReplicaContext.all_reduce` (replicas run one after the other
    there, and launching collectives from each would block).
    """
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    from tensorflow.python.distribute import collective_util

    tensors = list(tensors)
    if not tensors:
        return []
    if strategy.num_replicas_in_sync == 1:
        return [tf.identity(t) for t in tensors]  # the sum over one replica
    context = tf.distribute.get_replica_context()
    if tf.executing_eagerly():
        return list(context.all_reduce(tf.distribute.ReduceOp.SUM, tensors))
    ops = collective_ops(strategy)
    if ops is None:
        check_collectives(strategy)
    options = collective_util.Options(bytes_per_pack=bytes_per_pack)
    return list(ops._all_reduce(tf.distribute.ReduceOp.SUM, tensors,
                                context._replica_id, options))


def track_on_optimizer(optimizer: Any, **variables: list) -> None:
    """Makes lists of variables attributes `_tfdist_<name>` of a Keras optimizer.

    Keras's attribute tracker then lists them in `optimizer.variables`, and
    TensorFlow's object graph reaches them: saved and restored with the
    optimizer (`model.save`, tf.train.Checkpoint, tfdist.BackupAndRestore).
    """
    for name, values in variables.items():
        setattr(optimizer, f"_tfdist_{name}", list(values))


# --- optimizer state ---------------------------------------------------------------


def _state_target():
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from keras.src.optimizers import base_optimizer

    return base_optimizer.BaseOptimizer, "build"


def _state_check(original) -> None:
    _patch.require_signature(original, "variables", what="BaseOptimizer.build")


def _state_make(original):
    def sync_of(optimizer):
        from tfdist.compat import optimizer_update

        strategy = getattr(optimizer, "_distribution_strategy", None)
        if strategy is None or not _owner.owns(strategy):
            return None
        if hasattr(optimizer, "inner_optimizer"):
            return None  # LossScaleOptimizer: its inner optimizer runs the update
        sync = optimizer_update.gradient_sync(strategy, optimizer)
        return sync if callable(getattr(sync, "build_state", None)) else None

    def applies(self, variables):
        return sync_of(self) is not None

    @_patch.passthrough(original, applies)
    def build(self, variables):
        original(self, variables)
        sync_of(self).build_state(self, list(variables))

    return build


STATE_FIX = _patch.Fix(
    name="comm_collectives.optimizer_state",
    issue=ISSUE,
    target=_state_target,
    check=_state_check,
    make=_state_make,
)


def install() -> tuple[str, ...]:
    """Lets tfdist.comm create its per-replica state when Keras builds an optimizer.

    Returns:
      The names of the fixes this call installed.
    """
    return _patch.install_all((STATE_FIX,))
