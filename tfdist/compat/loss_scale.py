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
    from tfdist.compat import comm_collectives

    def applies(self, grads):
        strategy = getattr(self, "_distribution_strategy", None)
        return (strategy is not None and _owner.owns(strategy)
                and strategy.num_replicas_in_sync > 1
                and tf.distribute.get_replica_context() is not None
                and not tf.executing_eagerly()
                and comm_collectives.collective_ops(strategy) is not None)

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


def install() -> tuple[str, ...]:
    """Makes dynamic loss scaling skip a step when any replica's gradients overflow.

    Returns:
      The names of the fixes this call installed.
    """
    return _patch.install_all((FIX,))
