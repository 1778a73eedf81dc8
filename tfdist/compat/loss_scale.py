"""Dynamic loss scaling that decides on every replica's gradients, not replica 0's alone.

Keras 3's `LossScaleOptimizer` (TensorFlow backend, `_tf_apply`) asks each
replica whether its gradients are finite, "arbitrarily takes `finite` from the
first replica" on the grounds that the gradients were all-reduced, and runs
the update or skips it on that answer. In Keras 3 the gradients reach
`check_finite` *before* the all-reduce (it happens inside the inner
optimizer's update), so a step where another replica's gradients overflow is
applied: the all-reduced gradient is Inf/NaN and so are the weights. Across
workers (MultiWorkerMirroredStrategy) each worker takes its own replica 0's
answer, so workers can take different branches: one enters the update's
all-reduce, the other does not, and they no longer match up.

The fix: for optimizers of strategies tfdist made (with several replicas and
TensorFlow's collective all-reduce), `check_finite` sums the count of
replicas with non-finite gradients over all replicas (one 4-byte collective,
merge-free so it can run where Keras calls it) and answers for all of them.
No upstream issue found (the wrong comment is in
keras/src/optimizers/loss_scale_optimizer.py, `_tf_apply`).

A second fix sums the gradients before the check, as Keras's comment above
assumes (and as Keras 2's optimizer did: aggregate, then check). Keras 3 runs
the optimizer's update, and with it the all-reduce, inside the `cond` on
whether every gradient is finite, so no gradient bucket's collective can start
before the whole backward pass has ended, and the check needs the collective
above of its own. For strategies tfdist made (mirrored, multi_worker_mirrored)
whose GradientSync asks for it (`reduces_before_loss_scale`: the default sync,
`CommSync` except PowerSGD), `_tf_apply` first sums the scaled gradients over
replicas with the sync's own `reduce` (buckets, `bucket_priority`), then runs
Keras's code on the sums, with the inner optimizer's update told they are
summed already (`optimizer_update.gradients_reduced`). Every replica then
checks the same sums, so the finite check needs no collective of its own (one
collective fewer per step), and a gradient that overflows on one replica makes
the sum non-finite everywhere (Inf and NaN survive a sum). The first fix still
decides for syncs that do not ask for it (ZeRO's sharded update, PowerSGD),
and this one also fixes the overflow for `cross_device_ops` without TensorFlow's
collectives (`reduction_to_one_device`, ...), where the first cannot apply. The
sums are of the scaled gradients, as one device checks them; with
`gradient_compression="fp16"` the loss scale then also keeps the half-precision
sums in range (as Horovod and Apex send them). Dividing by the scale is linear,
so the update is the same as before up to rounding.
"""

from __future__ import annotations

from tfdist.compat import _owner, _patch

ISSUE = ("keras/src/optimizers/loss_scale_optimizer.py _tf_apply: finite taken from the first "
         "replica before the all-reduce (no upstream issue found)")


def _target():
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from keras.src.optimizers import loss_scale_optimizer

    return loss_scale_optimizer.LossScaleOptimizer, "check_finite"


def _check(original) -> None:
    from keras.src.optimizers import loss_scale_optimizer

    _patch.require_signature(original, "grads", what="LossScaleOptimizer.check_finite")
    _patch.require_attributes(loss_scale_optimizer.LossScaleOptimizer, "_tf_apply",
                              what="LossScaleOptimizer")


def _make(original):
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    from tfdist.compat import comm_collectives, optimizer_update

    def applies(self, grads):
        strategy = getattr(self, "_distribution_strategy", None)
        return (_replicated(tf, strategy)
                and comm_collectives.collective_ops(strategy) is not None
                and not optimizer_update.reduced_already(self.inner_optimizer))

    @_patch.passthrough(original, applies)
    def check_finite(self, grads):
        finite_here = original(self, grads)
        overflowed = tf.cast(tf.logical_not(finite_here), tf.float32)
        total = comm_collectives.all_reduce_sum(self._distribution_strategy, [overflowed])[0]
        return tf.equal(total, 0.0)

    return check_finite


FIX = _patch.Fix(
    name="loss_scale.check_finite",
    issue=ISSUE,
    target=_target,
    check=_check,
    make=_make,
)


def _replicated(tf, strategy) -> bool:
    """A strategy tfdist made, with several replicas, while a replica traces its step."""
    return (strategy is not None and _owner.owns(strategy)
            and strategy.num_replicas_in_sync > 1
            and tf.distribute.get_replica_context() is not None
            and not tf.executing_eagerly())


APPLY_ISSUE = ("keras/src/optimizers/loss_scale_optimizer.py _tf_apply: the all-reduce runs "
               "inside the cond on finite gradients, after the whole backward pass (no upstream "
               "issue found)")


def _apply_target():
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from keras.src.optimizers import loss_scale_optimizer

    return loss_scale_optimizer.LossScaleOptimizer, "_tf_apply"


def _apply_check(original) -> None:
    from keras.src.backend.tensorflow import optimizer as tf_optimizer
    from keras.src.optimizers import loss_scale_optimizer

    _patch.require_signature(original, "grads", "trainable_variables",
                             what="LossScaleOptimizer._tf_apply")
    _patch.require_attributes(loss_scale_optimizer.LossScaleOptimizer, "check_finite",
                              "_stateful_handle_finite_grads",
                              what="LossScaleOptimizer")
    _patch.require_attributes(tf_optimizer.TFOptimizer, "_all_reduce_sum_gradients",
                              what="TFOptimizer")


def _make_apply(original):
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    from keras.src import backend

    from tfdist.compat import optimizer_update

    mirrored = (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)

    def sync_of(self):
        strategy = getattr(self, "_distribution_strategy", None)
        if not _replicated(tf, strategy):
            return None
        sync = optimizer_update.gradient_sync(strategy, self.inner_optimizer)
        if not (getattr(sync, "reduces_before_loss_scale", False)
                and isinstance(strategy, mirrored)):  # not parameter servers
            return None
        return sync

    @_patch.passthrough(original, lambda self, *args, **kwargs: sync_of(self) is not None)
    def _tf_apply(self, grads, trainable_variables=None):
        inner = self.inner_optimizer
        variables = [v.value if isinstance(v, backend.Variable) else v
                     for v in (trainable_variables or self._trainable_variables)]
        with tf.name_scope(self.name):  # the collectives named as in Keras's update
            reduced = optimizer_update.sum_over_replicas(sync_of(self), inner,
                                                         list(zip(grads, variables)))
        with optimizer_update.gradients_reduced(inner):
            return original(self, [g for g, _ in reduced], trainable_variables)

    return _tf_apply


APPLY_FIX = _patch.Fix(
    name="loss_scale.tf_apply",
    issue=APPLY_ISSUE,
    target=_apply_target,
    check=_apply_check,
    make=_make_apply,
)


def install() -> tuple[str, ...]:
    """Makes dynamic loss scaling skip a step when any replica's gradients overflow, deciding
    on the gradients summed over replicas where the strategy's GradientSync allows it.

    Returns:
      The names of the fixes this call installed.
    """
    return _patch.install_all((FIX, APPLY_FIX))
