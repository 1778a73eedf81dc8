"""Keras 3 variables under ParameterServerStrategy: exact counters, sharded training.

Two upstream gaps, both part of keras-team/keras#18624 (Keras 3 has no
ParameterServerStrategy support; see also keras-team/keras#18668, "Optimizer
race in variable update under PS strategy"). Verified on Keras 3.15 / TF 2.21.

1. Lost increments. Keras 3's `Variable.assign_add(v)` is
   `self.assign(self + v)` (keras/src/backend/common/variables.py): a read,
   an add on the worker, and a write. Asynchronous workers interleave those
   three steps, so `optimizer.iterations` and every metric (`total`,
   `count`) lose 10-25% of their updates. TensorFlow's own
   `ResourceVariable.assign_add` is one `AssignAddVariableOp` executed on the
   ps under the variable's lock. Under a ParameterServerStrategy we route
   Keras's `assign_add`/`assign_sub` to it.

2. Sharded variables (`variable_partitioner`): the Keras variable then wraps
   a `ShardedVariable`, which has no `.handle`, so `tape.gradient(loss,
   model.trainable_weights)` fails ("'ShardedVariable' object has no attribute
   'handle'"); and `strategy.extended.update` converts the variable as a
   reference, which ShardedVariable refuses ("ShardedVariable doesn't support
   being used as a reference"). tf_keras trains shard by shard. We do the
   same without changing what users see:
   - `GradientTape.gradient` differentiates w.r.t. the shard variables of any
     sharded Keras variable among the sources and stitches the shard
     gradients into one full-shape gradient (dense, or IndexedSlices for
     embedding lookups), so custom `train_step`s keep working unchanged;
   - `np.asarray(variable)` (what `model.save` uses) reads the concatenated
     shards instead of failing ("'ShardedVariable' object has no attribute
     '__array__'");
   - the TF optimizer applies its update step to the ShardedVariable
     directly (its `assign*`/`scatter_*` methods split the update per shard,
     each one atomic on its own ps), and creates optimizer slots for a
     sharded variable with the same partitioner, so slots are sharded too.

`install()` is idempotent and is called by the `parameter_server` preset.
Outside a ParameterServerStrategy and without sharded variables every
patched method defers to the original.
"""

from __future__ import annotations

import functools

from tfdist._tf import import_tensorflow
from tfdist.compat._versions import check_versions

UPSTREAM_ISSUE = "https://github.com/keras-team/keras/issues/18624"
RACE_ISSUE = "https://github.com/keras-team/keras/issues/18668"

_installed = False


def upstream_assign_add_is_read_modify_write() -> bool:
    """True while Keras's `Variable.assign_add` is still `assign(self + value)`.

    tests/test_ps_compat.py asserts this, so the test fails (and this fix can
    be retired) once upstream makes `assign_add` a native increment.
    """
    import inspect

    from keras.src.backend.common import variables

    source = inspect.getsource(variables.Variable.assign_add)
    return "self.assign(self + value)" in source


def _is_parameter_server_strategy(strategy) -> bool:
    from tensorflow.python.distribute import parameter_server_strategy_v2

    return isinstance(strategy, parameter_server_strategy_v2.ParameterServerStrategyV2)


def _in_parameter_server_strategy() -> bool:
    tf = import_tensorflow()
    return tf.distribute.has_strategy() and _is_parameter_server_strategy(
        tf.distribute.get_strategy())


def is_sharded(variable) -> bool:
    """True for a Keras variable (or TF variable) backed by a ShardedVariable."""
    from tensorflow.python.distribute import sharded_variable

    value = getattr(variable, "_value", variable)
    return isinstance(value, sharded_variable.ShardedVariable)


# --- 1. atomic assign_add / assign_sub ---------------------------------------


def _atomic_update(original, tf_method: str):
    @functools.wraps(original)
    def update(self, value):
        from keras.src.backend.common.stateless_scope import in_stateless_scope

        tf = import_tensorflow()
        target = self._value
        if (target is None or in_stateless_scope()
                or not _in_parameter_server_strategy()):
            return original(self, value)
        value = self._convert_to_tensor(value, dtype=self._dtype)
        if not value.shape.is_compatible_with(self.shape):
            return original(self, value)  # Keras raises its own shape error
        return getattr(target, tf_method)(tf.cast(value, target.dtype))

    update._tfdist_patched = True
    return update


# --- 2a. gradients w.r.t. sharded variables -----------------------------------


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


def _patched_gradient(original):
    @functools.wraps(original)
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=None, **kwargs):
        tf = import_tensorflow()
        if unconnected_gradients is not None:
            kwargs["unconnected_gradients"] = unconnected_gradients
        flat = tf.nest.flatten(sources)
        if not any(is_sharded(s) for s in flat):
            return original(self, target, sources, output_gradients, **kwargs)
        expanded = [list(s._value.variables) if is_sharded(s) else s for s in flat]
        grads = original(self, target, expanded, output_gradients, **kwargs)
        stitched = [
            _stitch(tf, g, s._value.variables, s._value.shape) if is_sharded(s) else g
            for g, s in zip(grads, flat)
        ]
        return tf.nest.pack_sequence_as(sources, stitched)

    gradient._tfdist_patched = True
    return gradient


# --- 2b. optimizer updates and slots for sharded variables ------------------------


def _patched_add_variable_from_reference(original):
    @functools.wraps(original)
    def add_variable_from_reference(self, reference_variable, name=None,
                                    initializer="zeros"):
        if not is_sharded(reference_variable):
            return original(self, reference_variable, name=name, initializer=initializer)
        # Skip TFOptimizer's colocate_vars_with(ShardedVariable) (it fails, and
        # TF never partitions colocated variables): created under the
        # strategy's scope, the slot is partitioned like its variable.
        from keras.src.optimizers import base_optimizer

        with self._distribution_strategy.scope():
            return base_optimizer.BaseOptimizer.add_variable_from_reference(
                self, reference_variable, name=name, initializer=initializer)

    add_variable_from_reference._tfdist_patched = True
    return add_variable_from_reference


def _patched_distributed_update_step(original):
    @functools.wraps(original)
    def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        grads_and_vars = list(grads_and_vars)
        sharded = [(g, v) for g, v in grads_and_vars if is_sharded(v)]
        if not sharded:
            return original(self, distribution, grads_and_vars, learning_rate)
        plain = [(g, v) for g, v in grads_and_vars if not is_sharded(v)]
        if plain:
            original(self, distribution, plain, learning_rate)
        for grad, var in sharded:
            # ShardedVariable's assign*/scatter_* split each update per shard.
            self.update_step(grad, var, learning_rate)

    _distributed_tf_update_step._tfdist_patched = True
    return _distributed_tf_update_step


def _patched_apply_weight_decay(original):
    @functools.wraps(original)
    def _apply_weight_decay(self, variables):
        if self.weight_decay is None or not any(is_sharded(v) for v in variables):
            return original(self, variables)
        tf = import_tensorflow()
        original(self, [v for v in variables if not is_sharded(v)])
        for variable in variables:
            if is_sharded(variable) and self._use_weight_decay(variable):
                value = variable.value if hasattr(variable, "_value") else variable
                lr = tf.cast(self.learning_rate, value.dtype)
                wd = tf.cast(self.weight_decay, value.dtype)
                value.assign_sub(tf.convert_to_tensor(value) * wd * lr)

    _apply_weight_decay._tfdist_patched = True
    return _apply_weight_decay


def _patched_array(original):
    @functools.wraps(original)
    def __array__(self, dtype=None, *args, **kwargs):
        if not is_sharded(self):
            return original(self, dtype, *args, **kwargs)
        import numpy as np

        # ShardedVariable has numpy() (the concatenated shards), no __array__.
        return np.asarray(self._value.numpy(), dtype=dtype)

    __array__._tfdist_patched = True
    return __array__


def install() -> None:
    """Installs both fixes (idempotent)."""
    global _installed
    if _installed:
        return
    tf = import_tensorflow()
    from keras.src.backend.tensorflow import core
    from keras.src.backend.tensorflow import optimizer as tf_optimizer
    from tensorflow.python.eager import backprop

    cls = tf_optimizer.TFOptimizer
    for owner, name in ((cls, "add_variable_from_reference"),
                        (cls, "_distributed_tf_update_step"),
                        (cls, "_apply_weight_decay"),
                        (backprop.GradientTape, "gradient")):
        if not callable(getattr(owner, name, None)):
            raise RuntimeError(
                f"{owner.__name__}.{name} is missing in TensorFlow {tf.__version__} / this "
                "Keras; tfdist.compat.ps_variables needs updating (see tests/test_ps_compat.py)."
            )
    check_versions(warn=True)
    # Only while upstream's assign_add is still a read-modify-write.
    if "assign_add" not in vars(core.Variable) and upstream_assign_add_is_read_modify_write():
        core.Variable.assign_add = _atomic_update(core.Variable.assign_add, "assign_add")
        core.Variable.assign_sub = _atomic_update(core.Variable.assign_sub, "assign_sub")
    backprop.GradientTape.gradient = _patched_gradient(backprop.GradientTape.gradient)
    # model.save / save_weights convert variables with np.asarray.
    core.Variable.__array__ = _patched_array(core.Variable.__array__)
    cls.add_variable_from_reference = _patched_add_variable_from_reference(
        cls.add_variable_from_reference)
    cls._distributed_tf_update_step = _patched_distributed_update_step(
        cls._distributed_tf_update_step)
    cls._apply_weight_decay = _patched_apply_weight_decay(cls._apply_weight_decay)
    _installed = True
