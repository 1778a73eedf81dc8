"""Keras 3 variables under ParameterServerStrategy: exact counters, sharded training.

Two upstream gaps, both part of keras-team/keras#18624 (Keras 3 has no
ParameterServerStrategy support; see also keras-team/keras#18668, "Optimizer
race in variable update under PS strategy"). Verified on Keras 3.15 / TF 2.21.

1. Lost increments. Keras 3's `Variable.assign_add(v)` is
   `self.assign(self + v)` (keras/src/backend/common/variables.py): a read,
   an add on the worker, and a write. Asynchronous workers interleave those
   three steps, so `optimizer.iterations` and every metric (`total`,
   `count`) lose updates. TensorFlow's own `ResourceVariable.assign_add` is
   one `AssignAddVariableOp` executed on the ps under the variable's lock.
   Fixes `assign_add` / `assign_sub` route Keras's methods to it for
   variables created under a tfdist ParameterServerStrategy.

2. Sharded variables (`variable_partitioner`): the Keras variable then wraps
   a `ShardedVariable`, which has no `.handle`, so `tape.gradient(loss,
   model.trainable_weights)` fails ("'ShardedVariable' object has no attribute
   'handle'"); and `strategy.extended.update` converts the variable as a
   reference, which ShardedVariable refuses ("ShardedVariable doesn't support
   being used as a reference"). tf_keras trains shard by shard. We do the
   same without changing what users see:
   - `tape_gradient`: `GradientTape.gradient` differentiates w.r.t. the shard
     variables of a sharded Keras variable among the sources and stitches the
     shard gradients into one full-shape gradient (dense, or IndexedSlices for
     embedding lookups), so custom `train_step`s keep working unchanged;
   - `array`: `np.asarray(variable)` (what `model.save` uses) reads the
     concatenated shards instead of failing ("'ShardedVariable' object has no
     attribute '__array__'");
   - `distributed_update_step`, `weight_decay`: the TF optimizer applies its
     update to the ShardedVariable directly (its `assign*`/`scatter_*` methods
     split the update per shard, each one atomic on its own ps);
   - `slot_from_reference`: optimizer slots of a sharded variable are created
     with the strategy's partitioner, so slots are sharded too. Keras's own
     code colocates each slot with its variable, which TensorFlow refuses for
     a ShardedVariable. Slots created lazily inside `strategy.run` (the
     public tutorial's custom loop) are created in the replica context they
     are asked for in: entering `strategy.scope()` there raises "Method
     requires being in cross-replica context".

Every fix passes straight through to Keras/TensorFlow unless the variable (or
the optimizer's strategy) belongs to a ParameterServerStrategy made by
`tfdist.make_strategy`; `install()` is idempotent and is called by the
`parameter_server` preset; `tfdist.compat._patch.uninstall()` undoes it. The
canaries in tests/ps/run_sharded_variables.py and tests/ps/run_fit_cases.py run
the unpatched path and see it fail.
"""

from __future__ import annotations

from tfdist._tf import import_tensorflow
from tfdist.compat import _owner, _patch, ps_keras

UPSTREAM_ISSUE = "https://github.com/keras-team/keras/issues/18624"
RACE_ISSUE = "https://github.com/keras-team/keras/issues/18668"


def is_sharded(variable) -> bool:
    """True for a Keras variable (or TF variable) backed by a ShardedVariable."""
    from tensorflow.python.distribute import sharded_variable

    value = getattr(variable, "_value", variable)
    return isinstance(value, sharded_variable.ShardedVariable)


def _owned_variable(variable) -> bool:
    return ps_keras.owned_ps_strategy(_owner.strategy_of_variable(variable))


def _owned_sharded(variable) -> bool:
    return is_sharded(variable) and _owned_variable(variable)


def _keras_variable_class():
    import_tensorflow()
    from keras.src.backend.tensorflow import core

    return core.Variable


def _optimizer_class():
    import_tensorflow()
    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    return tf_optimizer.TFOptimizer


# --- 1. atomic assign_add / assign_sub -----------------------------------------------


def _check_update(original) -> None:
    _patch.require_signature(original, "value", what="keras Variable.assign_add/assign_sub")
    _patch.require_attributes(_keras_variable_class(), "_convert_to_tensor", "shape",
                              what="keras TensorFlow Variable")


def _atomic(tf_method: str):
    def make(original):
        from keras.src.backend.common.stateless_scope import in_stateless_scope

        tf = import_tensorflow()

        def applies(self, value):
            # Inside a StatelessScope Keras records the update instead of applying it.
            return (getattr(self, "_value", None) is not None and not in_stateless_scope()
                    and _owned_variable(self))

        @_patch.passthrough(original, applies)
        def update(self, value):
            target = self._value
            value = self._convert_to_tensor(value, dtype=self._dtype)
            if not value.shape.is_compatible_with(self.shape):
                return original(self, value)  # Keras raises its own shape error
            return getattr(target, tf_method)(tf.cast(value, target.dtype))

        return update

    return make


ASSIGN_ADD = _patch.Fix(
    name="ps_variables.assign_add", issue=RACE_ISSUE,
    target=lambda: (_keras_variable_class(), "assign_add"),
    check=_check_update, make=_atomic("assign_add"))
ASSIGN_SUB = _patch.Fix(
    name="ps_variables.assign_sub", issue=RACE_ISSUE,
    target=lambda: (_keras_variable_class(), "assign_sub"),
    check=_check_update, make=_atomic("assign_sub"))


# --- 2a. gradients w.r.t. sharded variables ------------------------------------------


def _stitch(tf, shard_grads, shards, full_shape):
    """One full-shape gradient from the gradients of consecutive row shards."""
    if all(g is None for g in shard_grads):
        return None
    if any(isinstance(g, tf.IndexedSlices) for g in shard_grads):
        values, indices, offset = [], [], 0
        for g, shard in zip(shard_grads, shards):
            rows = shard.shape[0]
            if g is not None:
                if not isinstance(g, tf.IndexedSlices):
                    g = tf.IndexedSlices(g, tf.range(rows, dtype=tf.int64),
                                         tf.shape(g, out_type=tf.int64))
                values.append(g.values)
                indices.append(tf.cast(g.indices, tf.int64) + offset)
            offset += rows
        return tf.IndexedSlices(tf.concat(values, 0), tf.concat(indices, 0),
                                tf.constant(full_shape.as_list(), tf.int64))
    dense = [tf.zeros(shard.shape, shard.dtype) if g is None else tf.convert_to_tensor(g)
             for g, shard in zip(shard_grads, shards)]
    return tf.concat(dense, 0)


def _tape_target():
    import_tensorflow()
    from tensorflow.python.eager import backprop

    return backprop.GradientTape, "gradient"


def _check_tape(original) -> None:
    _patch.require_signature(original, "target", "sources", "output_gradients",
                             "unconnected_gradients", what="tf.GradientTape.gradient")


def _make_tape(original):
    tf = import_tensorflow()
    from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients

    def applies(self, target, sources, output_gradients=None,
                unconnected_gradients=UnconnectedGradients.NONE):
        return any(_owned_sharded(s) for s in tf.nest.flatten(sources))

    @_patch.passthrough(original, applies)
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=UnconnectedGradients.NONE):
        flat = tf.nest.flatten(sources)
        expanded = [list(s._value.variables) if is_sharded(s) else s for s in flat]
        grads = original(self, target, expanded, output_gradients, unconnected_gradients)
        stitched = [
            _stitch(tf, g, s._value.variables, s._value.shape) if is_sharded(s) else g
            for g, s in zip(grads, flat)
        ]
        return tf.nest.pack_sequence_as(sources, stitched)

    return gradient


TAPE_GRADIENT = _patch.Fix(
    name="ps_variables.tape_gradient", issue=UPSTREAM_ISSUE, target=_tape_target,
    check=_check_tape, make=_make_tape)


# --- 2b. reading a sharded variable as an array ---------------------------------------


def _make_array(original):
    import numpy as np

    # numpy may pass more (copy=): anything not ours goes to Keras exactly as sent.
    @_patch.passthrough(original, lambda self, *args, **kwargs: _owned_sharded(self))
    def __array__(self, dtype=None, *args, **kwargs):
        # ShardedVariable has numpy() (the concatenated shards), no __array__.
        return np.asarray(self._value.numpy(), dtype=dtype)

    return __array__


ARRAY = _patch.Fix(
    name="ps_variables.array", issue=UPSTREAM_ISSUE,
    target=lambda: (_keras_variable_class(), "__array__"),
    check=lambda original: _patch.require_signature(original, "dtype",
                                                    what="keras Variable.__array__"),
    make=_make_array)


# --- 2c. optimizer updates and slots for sharded variables -------------------------------


def _owned_optimizer(optimizer) -> bool:
    return ps_keras.owned_ps_strategy(getattr(optimizer, "_distribution_strategy", None))


def _make_slot_from_reference(original):
    tf = import_tensorflow()
    from keras.src.optimizers import base_optimizer

    def applies(self, reference_variable, name=None, initializer="zeros"):
        return _owned_optimizer(self) and is_sharded(reference_variable)

    @_patch.passthrough(original, applies)
    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        # Skip TFOptimizer's colocate_vars_with(ShardedVariable) (it fails, and
        # TF never partitions colocated variables): created by the strategy's
        # variable creator, the slot is partitioned like its variable.
        def create():
            return base_optimizer.BaseOptimizer.add_variable_from_reference(
                self, reference_variable, name=name, initializer=initializer)

        strategy = self._distribution_strategy
        if tf.distribute.has_strategy() and tf.distribute.get_strategy() is strategy:
            # In its scope already, or inside strategy.run (a slot created lazily by
            # the first apply_gradients of a custom loop): scope() would raise there.
            return create()
        with strategy.scope():
            return create()

    return add_variable_from_reference


SLOT_FROM_REFERENCE = _patch.Fix(
    name="ps_variables.slot_from_reference", issue=UPSTREAM_ISSUE,
    target=lambda: (_optimizer_class(), "add_variable_from_reference"),
    check=lambda original: _patch.require_signature(
        original, "reference_variable", "name", "initializer",
        what="TFOptimizer.add_variable_from_reference"),
    make=_make_slot_from_reference)


def _make_distributed_update_step(original):
    def applies(self, distribution, grads_and_vars, learning_rate):
        return _owned_optimizer(self) and any(is_sharded(v) for _, v in grads_and_vars)

    @_patch.passthrough(original, applies)
    def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        grads_and_vars = list(grads_and_vars)
        plain = [(g, v) for g, v in grads_and_vars if not is_sharded(v)]
        if plain:
            original(self, distribution, plain, learning_rate)
        for grad, var in grads_and_vars:
            if is_sharded(var):
                # ShardedVariable's assign*/scatter_* split each update per shard.
                self.update_step(grad, var, learning_rate)

    return _distributed_tf_update_step


def _check_update_step(original) -> None:
    _patch.require_signature(original, "distribution", "grads_and_vars", "learning_rate",
                             what="TFOptimizer._distributed_tf_update_step")
    _patch.require_attributes(_optimizer_class(), "update_step", what="TFOptimizer")


DISTRIBUTED_UPDATE_STEP = _patch.Fix(
    name="ps_variables.distributed_update_step", issue=UPSTREAM_ISSUE,
    target=lambda: (_optimizer_class(), "_distributed_tf_update_step"),
    check=_check_update_step, make=_make_distributed_update_step)


def _make_weight_decay(original):
    tf = import_tensorflow()

    def applies(self, variables):
        return (self.weight_decay is not None and _owned_optimizer(self)
                and any(is_sharded(v) for v in variables))

    @_patch.passthrough(original, applies)
    def _apply_weight_decay(self, variables):
        original(self, [v for v in variables if not is_sharded(v)])
        for variable in variables:
            if is_sharded(variable) and self._use_weight_decay(variable):
                value = variable.value if hasattr(variable, "_value") else variable
                lr = tf.cast(self.learning_rate, value.dtype)
                wd = tf.cast(self.weight_decay, value.dtype)
                value.assign_sub(tf.convert_to_tensor(value) * wd * lr)

    return _apply_weight_decay


def _check_weight_decay(original) -> None:
    _patch.require_signature(original, "variables", what="TFOptimizer._apply_weight_decay")
    _patch.require_attributes(_optimizer_class(), "_use_weight_decay", "learning_rate",
                              what="TFOptimizer")


WEIGHT_DECAY = _patch.Fix(
    name="ps_variables.weight_decay", issue=UPSTREAM_ISSUE,
    target=lambda: (_optimizer_class(), "_apply_weight_decay"),
    check=_check_weight_decay, make=_make_weight_decay)


FIXES = (ASSIGN_ADD, ASSIGN_SUB, TAPE_GRADIENT, ARRAY, SLOT_FROM_REFERENCE,
         DISTRIBUTED_UPDATE_STEP, WEIGHT_DECAY)


def install() -> tuple[str, ...]:
    """Installs every fix above (idempotent); returns the names installed by this call."""
    from tfdist.compat._versions import check_versions

    check_versions(warn=True)
    return tuple(fix.name for fix in FIXES if _patch.install(fix))


def names() -> tuple[str, ...]:
    """The names of this module's fixes (for `_patch.uninstall`)."""
    return tuple(fix.name for fix in FIXES)
