"""How Keras builds a model and its optimizer under a tfdist strategy.

1. `keras_build.symbolic_build` replaces `TensorFlowTrainer._maybe_symbolic_build`
   (keras/src/backend/tensorflow/trainer.py). Under any strategy, Keras builds
   the model, its compiled loss and metrics and its optimizer before the first
   step from the first batch of the distributed dataset, which it turns into one
   batch with `strategy.reduce("MEAN", batch, axis=None)`. That reduce fails
   where the batch is not a flat set of numbers:

   - on several workers, `CollectiveAllReduceExtended._reduce_to` does not take
     a nested batch: "Attempt to convert a value (PerReplica...)"
     (keras-team/keras#20585, tensorflow/tensorflow#72388);
   - with a string or bool input (a `TextVectorization` or `StringLookup`
     inside the model, KerasHub preprocessors' bool `padding_mask`), the sum
     behind the mean has no kernel: "Value for attr 'T' of string is not in the
     list of allowed values" (tensorflow/tensorflow#80951), under a plain
     `MirroredStrategy` too.

   The symbolic build only reads shapes and dtypes, which every local replica's
   batch has, so the replacement takes the first local replica's batch: no
   reduce, no cross-worker traffic, any dtype.

   A model with no `call` of its own (keras.io's VAE and GAN: a `keras.Model`
   subclass holding sub-models, with its own `train_step`) cannot be built
   symbolically at all: the forward pass raises, and Keras reports "Unable to
   automatically build the model". Without a strategy Keras never tries: such a
   model and its optimizers are built while the first step is traced. The
   replacement does the same for these models under a tfdist strategy (under
   `parameter_server`, `tfdist.ps.CoordinatorTrainer.build` builds models
   itself, not through this method, and skips them the same way).
   Shape relied on: the epoch iterator is iterable and yields tuples whose last
   item is the data iterator (Keras 3.10 yields `(step, iterator)`, 3.11.3 and
   later `(begin_step, end_step, iterator)`; both work); `keras.Model.call` is
   the placeholder subclasses override.

2. `keras_build.optimizer_variables` replaces `TFOptimizer.add_variable`
   (inherited from `BaseOptimizer`). An optimizer built while a step is traced
   (the optimizers of a model built lazily as above, or of a custom loop)
   creates its variables inside `strategy.run`'s function; with a strategy, a
   stateful optimizer (Adam, SGD with momentum) then fails at the first step
   with "You must feed a value for placeholder tensor 'cond/else/...'"
   (keras-team/keras#23085). The replacement creates them under
   `tf.init_scope()`, as Keras's own fix does (keras-team/keras#23087, merged
   after Keras 3.15.1). Shape relied on: the signature is `(shape,
   initializer, dtype, aggregation, layout, name)`, or the same without `layout`
   (the arguments are passed on as given).

Both replacements pass straight through to Keras unless the model's (or the
optimizer's) strategy was made by `tfdist.make_strategy`. `install()` is
idempotent; every preset that makes a strategy installs them, never `import
tfdist`; `tfdist.compat.uninstall()` undoes them.
"""

from __future__ import annotations

import inspect

from tfdist.compat import _owner, _patch

UPSTREAM_ISSUE = ("keras-team/keras#20585 (several workers), tensorflow/tensorflow#80951 "
                  "(string and bool inputs)")
SYMBOLIC_BUILD = "keras_build.symbolic_build"
OPTIMIZER_VARIABLES = "keras_build.optimizer_variables"
OPTIMIZER_ISSUE = "keras-team/keras#23085 (fixed by keras-team/keras#23087 after Keras 3.15.1)"


def _trainer_module():
    return _patch.upstream("keras.src.backend.tensorflow.trainer")


def _check_symbolic_build(original) -> None:
    trainer = _trainer_module()
    _patch.require_signature(original, "iterator", "data_batch",
                             what="TensorFlowTrainer._maybe_symbolic_build")
    _patch.require_attributes(trainer.TensorFlowTrainer, "_symbolic_build",
                              what="TensorFlowTrainer")
    _patch.require_attributes(_model_class(), "call", what="keras.Model")
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


def _model_class():
    import keras

    return keras.Model


def has_own_call(model) -> bool:
    """True unless `model` keeps `keras.Model`'s placeholder `call` (which only raises)."""
    return type(model).call is not _model_class().call


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
        return _owner.owns(self._distribute_strategy)

    @_patch.passthrough(original, applies)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if not has_own_call(self):
            # Nothing to run symbolically: the model and its optimizers are built while
            # the first step is traced, as Keras does without a strategy.
            return
        strategy = self._distribute_strategy
        if iterator is not None:
            for step in iterator:
                batch = next(_data_iterator(step))
                # Shapes and dtypes are all the build needs: no reduce, any dtype.
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


# --- 2. optimizer variables created while a step is traced ------------------------------


def _optimizer_module():
    return _patch.upstream("keras.src.backend.tensorflow.optimizer")


def _check_optimizer_variables(original) -> None:
    try:
        _patch.require_signature(original, "shape", "initializer", "dtype", "aggregation",
                                 "layout", "name", what="TFOptimizer.add_variable")
    except _patch.CompatError:  # a Keras whose optimizers take no `layout`
        _patch.require_signature(original, "shape", "initializer", "dtype", "aggregation",
                                 "name", what="TFOptimizer.add_variable")


def _make_optimizer_variables(original):
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()

    def applies(self, *args, **kwargs):
        return _owner.owns(getattr(self, "_distribution_strategy", None))

    @_patch.passthrough(original, applies)
    def add_variable(self, *args, **kwargs):
        # Outside any function being traced: the variable exists before the step runs.
        with tf.init_scope():
            return original(self, *args, **kwargs)

    return add_variable


OPTIMIZER_VARIABLES_FIX = _patch.Fix(
    name=OPTIMIZER_VARIABLES,
    issue=OPTIMIZER_ISSUE,
    target=lambda: (_optimizer_module().TFOptimizer, "add_variable"),
    check=_check_optimizer_variables,
    make=_make_optimizer_variables,
)

FIXES = (SYMBOLIC_BUILD_FIX, OPTIMIZER_VARIABLES_FIX)


def install() -> tuple[str, ...]:
    """Installs both fixes, or neither (idempotent, thread-safe).

    Returns:
      The names of the fixes this call installed (() if they already were).

    Raises:
      CompatError: Keras's code is not shaped as the fixes expect (nothing is
        installed then); UnsupportedVersionError outside the supported range.
    """
    return _patch.install_all(FIXES)
