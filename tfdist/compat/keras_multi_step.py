"""`steps_per_execution > 1` with several synchronous replicas (keras-team/keras#19246).

Keras 3's TensorFlow trainer (`TensorFlowTrainer._make_function`) runs
`steps_per_execution` steps in one `tf.function` as a `tf.while_loop` whose
body calls the distributed step inside a `tf.cond` (on
`iterator.get_next_as_optional().has_value()`). Under MirroredStrategy and
MultiWorkerMirroredStrategy with two or more replicas that fails at the
first step: "You must feed a value for placeholder tensor
'while/body/.../while/cond/then/.../while/cond/Placeholder'" (the replicas'
synchronisation inside the cond branch). One replica, ParameterServerStrategy
and the default strategy are unaffected.

The fix builds, for models whose strategy tfdist made and that has several
replicas, the loop tf_keras used: the first step, then `steps_per_execution
- 1` more in a `tf.range` loop, each reading `iterator.get_next()`, with no
`tf.cond` around the step. Running out of data inside an execution raises
`OutOfRangeError`, which Keras's epoch iterator turns into the end of the
epoch (the steps already run in that execution are applied, as in tf_keras).
Every op of a step waits for its batch (a control dependency on the batch's
tensors): ops that read no data, such as the optimizer's
`iterations.assign_add(1)`, otherwise ran in the step whose `get_next` ended
the epoch, and an epoch of 7 batches at `steps_per_execution=4` counted 8
optimizer steps (Adam's bias correction then drifted: 1.8e-4 off after 2
epochs in tests/core/run_step_options.py).
Everything else (one step per execution, other strategies) runs Keras's own
code.

Only the last step of an execution returns its logs (Keras's loop, like
tf_keras's, hands callbacks the last step's), so the steps before it skip
`reduce_per_replica`: under MultiWorkerMirroredStrategy that reduction is a
cross-worker collective per step, and with it skipped an execution of K steps
runs K gradient all-reduces and one reduction of logs instead of K of each.
"""

from __future__ import annotations

from tfdist.compat import _owner, _patch

UPSTREAM_ISSUE = "https://github.com/keras-team/keras/issues/19246"


def _target():
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from keras.src.backend.tensorflow import trainer

    return trainer.TensorFlowTrainer, "_make_function"


def _check(original) -> None:
    from keras.src.backend.tensorflow import trainer

    _patch.require_signature(original, "step_function",
                             what="TensorFlowTrainer._make_function")
    # `_autoconvert_optionals` (Keras >= 3.11) is applied where Keras's own
    # `_make_function` applies it; Keras 3.10's has no such step, and neither does ours there.
    _patch.require_attributes(trainer.TensorFlowTrainer, "distribute_strategy",
                              what="TensorFlowTrainer")
    _patch.require_attributes(trainer, "reduce_per_replica", what="keras TF trainer module")


def _several_replicas(model) -> bool:
    strategy = model.distribute_strategy
    return _owner.owns(strategy) and strategy.num_replicas_in_sync > 1


def _make(original):
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    from keras.src.backend.tensorflow import trainer

    def applies(self, step_function):
        return (self.steps_per_execution > 1 and not self.run_eagerly
                and _several_replicas(self))

    @_patch.passthrough(original, applies)
    def _make_function(self, step_function):
        def gated_step(data):
            # Every op of the step waits for its batch. Without this, ops that read no data
            # (the optimizer's step counter: `iterations.assign_add(1)`) ran in the step whose
            # `get_next` ended the epoch, one optimizer step more than batches whenever an
            # epoch's steps are not a multiple of steps_per_execution.
            with tf.control_dependencies(_batch_tensors(tf, data)):
                return step_function(data)

        @tf.autograph.experimental.do_not_convert
        def one_step_on_data(data):
            outputs = self.distribute_strategy.run(gated_step, args=(data,))
            return trainer.reduce_per_replica(outputs, self.distribute_strategy,
                                              reduction="auto")

        @tf.autograph.experimental.do_not_convert
        def step_without_logs(data):
            # A step whose logs nobody reads: no reduction of them across replicas.
            self.distribute_strategy.run(gated_step, args=(data,))

        one_step_on_data = tf.function(one_step_on_data, reduce_retracing=True,
                                       jit_compile=self.jit_compile)
        step_without_logs = tf.function(step_without_logs, reduce_retracing=True,
                                        jit_compile=self.jit_compile)
        if hasattr(self, "_autoconvert_optionals"):
            one_step_on_data = self._autoconvert_optionals(one_step_on_data)
            step_without_logs = self._autoconvert_optionals(step_without_logs)
        steps = self.steps_per_execution

        @tf.function(reduce_retracing=True)
        def multi_step_on_iterator(iterator):
            for _ in tf.range(steps - 1):
                step_without_logs(iterator.get_next())
            return one_step_on_data(iterator.get_next())

        def function(iterator):
            if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
                return multi_step_on_iterator(iterator)
            # A list of batches (Keras's epoch iterator with plain Python data).
            for data in iterator:
                outputs = one_step_on_data(data)
            return outputs

        return function

    return _make_function


def _batch_tensors(tf, data) -> list:
    """The dense tensors a batch is made of (a sparse or ragged input's components too)."""
    return [t for t in tf.nest.flatten(data, expand_composites=True) if isinstance(t, tf.Tensor)]


FIX = _patch.Fix(
    name="keras_multi_step.make_function",
    issue=UPSTREAM_ISSUE,
    target=_target,
    check=_check,
    make=_make,
)


def install() -> tuple[str, ...]:
    """Lets Keras run steps_per_execution > 1 under tfdist's multi-replica strategies.

    Returns:
      The names of the fixes this call installed.
    """
    return _patch.install_all((FIX,))
