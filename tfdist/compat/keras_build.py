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

   Pulling that first batch is a defect of its own: Keras opens a new
   iterator over the distributed dataset for it, on every `fit` and
   `evaluate` call (and every epoch's validation), and drops it. Where the
   input is Python code, what that iterator read is gone: a generator's first
   batches (what its prefetch took: 16 batches trained 13 steps under a
   2-replica `MirroredStrategy`, "Your input ran out of data"), and a shuffled
   `keras.utils.PyDataset` draws its order from Python's `random` once more,
   so every epoch's order differs from one device's; a `tf.data` pipeline
   that shuffles advances its seed the same way, and fills its shuffle buffer
   once more. With a generator, a PyDataset or a shuffled dataset the run
   then differs from one device's with the same seed (found by
   tests/programs/py_dataset_input.py; no upstream issue found).

   The symbolic build only reads shapes and dtypes (`Trainer._symbolic_build`
   makes a `KerasTensor(v.shape, v.dtype)` of each value), so the replacement
   reads nothing: it takes one replica's `TypeSpec`s from the distributed
   dataset's `element_spec` (the first of a `PerReplicaSpec`'s). No batch is
   read, no reduce, no cross-worker traffic, any dtype; the batch dimension
   is what the traced step will see (None where the dataset does not fix it).

   A model with no `call` of its own (keras.io's VAE and GAN: a `keras.Model`
   subclass holding sub-models, with its own `train_step`) cannot be built
   symbolically at all: the forward pass raises, and Keras reports "Unable to
   automatically build the model". Without a strategy Keras never tries: such a
   model and its optimizers are built while the first step is traced. The
   replacement does the same for these models under a tfdist strategy (under
   `parameter_server`, `tfdist.ps.CoordinatorTrainer.build` builds models
   itself, not through this method, and skips them the same way).
   Shape relied on: Keras's epoch iterator keeps its distributed dataset in
   `_distributed_dataset` (`TFEpochIterator.__init__`, Keras 3.10-3.15), a
   `tf.distribute.DistributedDataset` whose `element_spec` holds a
   `PerReplicaSpec` (its specs in `_value_specs`) where a worker has several
   replicas; `keras.Model.call` is the placeholder subclasses override.

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

3. `keras_build.adopt_optimizer` replaces `BaseOptimizer.build`. Keras 3's TensorFlow
   optimizer keeps the strategy in scope when it is created (`TFOptimizer.__init__`:
   `self._distribution_strategy = tf.distribute.get_strategy()`) and creates its step
   counter and learning-rate variables there. keras.io's examples often make the optimizer
   before the model (a module-level `optimizer = keras.optimizers.Adam(...)`, a
   `get_optimizer_and_loss()` helper); a user who then puts the model and `compile` in
   `strategy.scope()`, as the distributed-training guide says, gets an optimizer that
   belongs to no strategy, and `fit` fails when it builds its slots: "Mixing different
   tf.distribute.Strategy objects: <...MirroredStrategy> is not
   <..._DefaultDistributionStrategy>" (keras-team/keras#17187, open since Keras 2.11; TF
   2.1-2.10's optimizers allowed it). The replacement adopts such an optimizer when it is
   built under a tfdist strategy and has not been built before: each variable it made
   without a strategy gets a new TensorFlow variable of the same value created under the
   strategy (the Keras variable object stays the same, so every reference to it and its
   place in `optimizer.variables` hold), and the optimizer takes the strategy. Built inside
   `strategy.run` (a custom training loop's `apply_gradients`), every replica reaches the
   build: the variables are made once, in a `merge_call`. An unbuilt optimizer made under
   another strategy tfdist made (a notebook's strategy cell run again) is moved the same
   way; one made under a strategy tfdist did not make gets a clear error naming both
   strategies instead of Keras's "Mixing different tf.distribute.Strategy objects" (its
   objects are not tfdist's to move); one built already is left to Keras. Shape relied on: every
   Keras optimizer's `build` calls `BaseOptimizer.build` before it creates slots (Keras
   3.10-3.15); the optimizer's own variables are in `_variables`; a Keras variable on
   TensorFlow keeps its `tf.Variable` in `_value` and makes a new one in `_initialize`.

The replacements pass straight through to Keras unless the model's (or the
optimizer's, or for 3 the current) strategy was made by `tfdist.make_strategy`. `install()` is
idempotent; every preset that makes a strategy installs them, never `import
tfdist`; `tfdist.compat.uninstall()` undoes them.
"""

from __future__ import annotations

import inspect

from tfdist._tf import import_tensorflow
from tfdist.compat import _owner, _patch

UPSTREAM_ISSUE = ("keras-team/keras#20585 (several workers), tensorflow/tensorflow#80951 "
                  "(string and bool inputs); the first batch read for the build (no issue "
                  "found)")
SYMBOLIC_BUILD = "keras_build.symbolic_build"
OPTIMIZER_VARIABLES = "keras_build.optimizer_variables"
OPTIMIZER_ISSUE = "keras-team/keras#23085 (fixed by keras-team/keras#23087 after Keras 3.15.1)"
ADOPT_OPTIMIZER = "keras_build.adopt_optimizer"
ADOPT_ISSUE = "keras-team/keras#17187 (an optimizer created outside the strategy's scope)"


def _trainer_module():
    return _patch.upstream("keras.src.backend.tensorflow.trainer")


def _check_symbolic_build(original) -> None:
    trainer = _trainer_module()
    _patch.require_signature(original, "iterator", "data_batch",
                             what="TensorFlowTrainer._maybe_symbolic_build")
    _patch.require_attributes(trainer.TensorFlowTrainer, "_symbolic_build",
                              what="TensorFlowTrainer")
    _patch.require_attributes(_model_class(), "call", what="keras.Model")
    # What the replacement reads: the epoch iterator's distributed dataset, and the
    # per-replica specs of its elements.
    init = inspect.getsource(inspect.unwrap(trainer.TFEpochIterator.__init__))
    if "self._distributed_dataset" not in init:
        raise _patch.CompatError(
            "TFEpochIterator.__init__ no longer keeps its dataset in self._distributed_dataset; "
            f"the tfdist fix {SYMBOLIC_BUILD!r} reads its element_spec. See "
            "tfdist.compat.SUPPORTED.")
    tf = import_tensorflow()
    spec = _per_replica_spec_class()(tf.TensorSpec([1]), tf.TensorSpec([1]))
    _patch.require_attributes(spec, "_value_specs", what="PerReplicaSpec")


def _per_replica_spec_class():
    return _patch.upstream("tensorflow.python.distribute.values.PerReplicaSpec")


def replica_batch_spec(iterator):
    """One replica's batch as `TypeSpec`s (each has the shape and dtype the symbolic
    build reads), from the element spec of `iterator`'s distributed dataset: nothing is
    read from the data."""
    tf = import_tensorflow()
    dataset = getattr(iterator, "_distributed_dataset", None)
    if not isinstance(dataset, tf.distribute.DistributedDataset):
        raise _patch.CompatError(
            f"tfdist fix {SYMBOLIC_BUILD!r}: Keras's epoch iterator "
            f"({type(iterator).__name__}) holds {type(dataset).__name__} in "
            "_distributed_dataset, not a tf.distribute.DistributedDataset. This Keras version "
            "is outside what tfdist supports: see tfdist.compat.SUPPORTED.")
    per_replica = _per_replica_spec_class()
    return tf.nest.map_structure(
        lambda spec: spec._value_specs[0] if isinstance(spec, per_replica) else spec,
        dataset.element_spec)


def _model_class():
    import keras

    return keras.Model


def has_own_call(model) -> bool:
    """True unless `model` keeps `keras.Model`'s placeholder `call` (which only raises)."""
    return type(model).call is not _model_class().call


def _make_symbolic_build(original):
    def applies(self, iterator=None, data_batch=None):
        return _owner.owns(self._distribute_strategy)

    @_patch.passthrough(original, applies)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if not has_own_call(self):
            # Nothing to run symbolically: the model and its optimizers are built while
            # the first step is traced, as Keras does without a strategy.
            return
        if iterator is not None:
            # Shapes and dtypes are all the build needs: nothing read, no reduce, any dtype.
            data_batch = replica_batch_spec(iterator)
        with self._distribute_strategy.scope():
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


# --- 3. an optimizer created before the strategy's scope ---------------------------------


def _base_optimizer_class():
    return _patch.upstream("keras.src.optimizers.base_optimizer.BaseOptimizer")


def _keras_tf_variable_class():
    return _patch.upstream("keras.src.backend.tensorflow.core.Variable")


def _check_adopt_optimizer(original) -> None:
    _patch.require_signature(original, "variables", what="BaseOptimizer.build")
    _patch.require_attributes(_keras_tf_variable_class(), "_initialize",
                              what="keras.src.backend.tensorflow.core.Variable")


def adopt_optimizer(optimizer, strategy) -> None:
    """Moves an unbuilt optimizer created without a strategy, or under another strategy
    tfdist made, onto `strategy` (fix 3).

    Raises:
      RuntimeError: the optimizer was created under a strategy tfdist did not make.
      CompatError: the optimizer's own variables are not what Keras's optimizers hold.
    """
    tf = import_tensorflow()
    context = tf.distribute.get_replica_context()
    if context is not None and context.strategy is strategy:
        # Built inside `strategy.run` (a custom training loop): every replica reaches this
        # build; the variables are made once, in cross-replica context.
        context.merge_call(lambda _: _adopt(tf, optimizer, strategy))
    else:
        _adopt(tf, optimizer, strategy)


def _adopt(tf, optimizer, strategy) -> None:
    origin = getattr(optimizer, "_distribution_strategy", None)
    if origin is strategy:
        return  # another replica's build adopted it in the same merge
    if not (_owner.is_default_strategy(origin) or _owner.owns(origin)):
        raise RuntimeError(
            f"This {type(optimizer).__name__} optimizer was created under "
            f"{_strategy_name(origin)}, which tfdist did not make, and is being built under "
            f"tfdist's {_strategy_name(strategy)}: an optimizer's variables belong to the "
            f"strategy it is created under ({ADOPT_ISSUE}). Create the optimizer inside "
            "`with strategy.scope():` of the strategy you train with, or outside every "
            "strategy's scope (tfdist then moves it onto its strategy).")
    variables = getattr(optimizer, "_variables", None)
    if not isinstance(variables, list):
        raise _patch.CompatError(
            f"{type(optimizer).__name__} has no `_variables` list; tfdist cannot move it onto "
            "the strategy. Create the optimizer inside `with strategy.scope():`.")
    for variable in variables:
        if _owner.strategy_of_variable(variable) is strategy:
            continue  # created under the strategy already (a LossScaleOptimizer's counters)
        value = getattr(variable, "_value", None)
        if not isinstance(value, tf.Variable) or not hasattr(variable, "_initialize"):
            raise _patch.CompatError(
                f"{type(optimizer).__name__}'s variable {getattr(variable, 'name', variable)!r}"
                " is not a Keras variable holding a tf.Variable; tfdist cannot move it onto the "
                "strategy. Create the optimizer inside `with strategy.scope():`.")
        with tf.init_scope():
            if not _owner.is_default_strategy(origin):  # the old strategy's first copy
                value = origin.experimental_local_results(value)[0]
            try:
                initial = value.numpy()
            except tf.errors.OpError as e:
                raise RuntimeError(
                    f"This {type(optimizer).__name__} optimizer's variable "
                    f"{getattr(variable, 'path', variable.name)!r} lives on {value.device}, "
                    f"which this process cannot reach any more ({e.message.splitlines()[0]}): "
                    f"the optimizer was created before tfdist's {type(strategy).__name__} "
                    "connected the process to its cluster. Create the optimizer after "
                    "`tfdist.make_strategy(...)`, inside `with strategy.scope():`.") from None
            with strategy.scope():
                variable._initialize(initial)
    optimizer._distribution_strategy = strategy


def _strategy_name(strategy) -> str:
    return f"{type(strategy).__name__} at {id(strategy):#x}"


def _make_adopt_optimizer(original):
    def applies(self, *args, **kwargs):
        origin, current = getattr(self, "_distribution_strategy", None), _owner.current_strategy()
        return (not getattr(self, "built", True) and origin is not None
                and origin is not current and _owner.owns(current))

    @_patch.passthrough(original, applies)
    def build(self, *args, **kwargs):
        adopt_optimizer(self, _owner.current_strategy())
        return original(self, *args, **kwargs)

    return build


ADOPT_OPTIMIZER_FIX = _patch.Fix(
    name=ADOPT_OPTIMIZER,
    issue=ADOPT_ISSUE,
    target=lambda: (_base_optimizer_class(), "build"),
    check=_check_adopt_optimizer,
    make=_make_adopt_optimizer,
)

FIXES = (SYMBOLIC_BUILD_FIX, OPTIMIZER_VARIABLES_FIX, ADOPT_OPTIMIZER_FIX)


def install() -> tuple[str, ...]:
    """Installs the three fixes, or none (idempotent, thread-safe).

    Returns:
      The names of the fixes this call installed (() if they already were).

    Raises:
      CompatError: Keras's code is not shaped as the fixes expect (nothing is
        installed then); UnsupportedVersionError outside the supported range.
    """
    return _patch.install_all(FIXES)
