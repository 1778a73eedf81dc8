"""Keras variables stored as 1/N per replica, and the Keras touch points that make them.

tfdist.sharding (ZeRO stages 1-3) needs Keras 3's TensorFlow backend to hold
some variables as one shard per replica while everything that reads, saves
or restores them still sees the whole variable:

- optimizer slots (Adam's m and v, momentum, ...) of sharded variables, from
  stage 1 (`TFOptimizer.add_variable_from_reference` creates a full
  `MirroredVariable` per slot, colocated with its variable);
- large trainable weights at stage 3 (`keras.Variable._initialize` creates a
  full `MirroredVariable`).

Such a variable stays a `keras.Variable` (same path, shape, dtype, tracking)
whose storage (`_value`) is a `ShardedStorage`: one plain resource variable
of S = ceil(n / N) elements per local replica, on the replica's device (or on
the host CPU for offloaded optimizer state). It answers:

- in a replica context of its strategy: an optimizer slot reads and writes
  the replica's own shard (what the sharded update needs); a stage-3 weight
  reads as the whole weight, all-gathered from every replica (its gradient
  is reduce-scattered: each replica gets the summed gradient of its shard);
- anywhere else (saving, `get_weights`, `numpy()`, restoring): the whole
  value, so checkpoints are the same as an unsharded model's and load into
  one, and back.

The Keras touch points, each a `_patch.Fix` that passes through unless the
object belongs to a strategy tfdist made with sharding on:

- `TFOptimizer.add_variable_from_reference`: slots of sharded variables are
  created sharded (no full copy is ever made).
- `keras.Variable._initialize` (TF backend): large trainable weights created
  under a stage-3 strategy are made whole by the strategy (which, across
  workers, broadcasts worker 0's initial value), then cut into shards and the
  whole copy dropped.
- `TFOptimizer._apply_weight_decay`: decoupled weight decay (AdamW) of a
  stage-3 weight decays each replica's shard (Keras's own code updates a
  `MirroredVariable` through `strategy.extended.update`, which a shard is not).
- `Operation.__call__` (what `Layer.__call__` runs `call` through): a layer
  that owns stage-3 weights runs `call` under `keras.remat`, so the weights
  it gathers are dropped after the forward pass and gathered again for the
  backward pass (the FSDP idea; the layer's forward runs twice); a layer
  type tfdist cannot gather this way is refused by name.

No upstream issue: Keras's TensorFlow backend has no sharded data
parallelism (its `distribution_lib` is marked "DO NOT USE"). Verified on the
versions in `tfdist.compat.TESTED`; tests/sharding/test_layout_and_options.py checks the
shapes these fixes rely on.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from tfdist._tf import import_tensorflow
from tfdist.compat import _owner, _patch
from tfdist.compat import sharding_collectives as collectives

ISSUE = "none upstream: Keras 3's TF backend has no sharded data parallelism (ZeRO)"

# Element-wise optimizers: their update of each element depends only on that element of
# the variable, its gradient and its slots, so updating a shard is updating the variable.
# Lamb (layer-wise norms), Adafactor (factored moments), Muon (matrix orthogonalisation)
# are not.
_ELEMENTWISE_OPTIMIZERS = ["SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad",
                           "Adadelta", "Ftrl", "Lion"]
_extra_optimizers: list[type] = []

# Layers whose call() is a pure function of its inputs and weights (no state updates, no
# randomness), so gathering the weights inside keras.remat gives the same result twice.
_GATHERABLE_LAYERS = ["Dense", "EinsumDense", "Embedding", "Conv1D", "Conv2D", "Conv3D",
                      "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose",
                      "DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D",
                      "SeparableConv2D", "LayerNormalization", "GroupNormalization",
                      "RMSNormalization"]
_extra_layers: list[type] = []


def supported_optimizers() -> tuple[str, ...]:
    return tuple(_ELEMENTWISE_OPTIMIZERS) + tuple(c.__name__ for c in _extra_optimizers)


def supported_layers() -> tuple[str, ...]:
    return tuple(_GATHERABLE_LAYERS) + tuple(c.__name__ for c in _extra_layers)


def register_elementwise_optimizer(cls: type) -> type:
    """Declares that `cls.update_step` is element-wise (safe to run on shards)."""
    if cls not in _extra_optimizers:
        _extra_optimizers.append(cls)
    return cls


def register_gatherable_layer(cls: type) -> type:
    """Declares that `cls.call` is a pure function of its inputs and weights."""
    if cls not in _extra_layers:
        _extra_layers.append(cls)
    return cls


def _keras_classes(names: list[str]) -> tuple[type, ...]:
    import keras

    return tuple(getattr(keras.layers, n) for n in names if hasattr(keras.layers, n))


def check_optimizer(optimizer: Any, *, stage: int) -> None:
    """Raises ValueError if `optimizer` cannot be sharded (received / expected / fix)."""
    import keras

    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        optimizer = inner
    known = tuple(getattr(keras.optimizers, n) for n in _ELEMENTWISE_OPTIMIZERS)
    if type(optimizer) not in known + tuple(_extra_optimizers):
        raise ValueError(
            f"Sharding updates each replica's 1/N of every variable with the optimizer's own "
            f"update_step, which is only exact for element-wise optimizers. Received: "
            f"{type(optimizer).__name__}. Supported: {', '.join(supported_optimizers())}. "
            "Fix: use one of these, shard='none', or (if its update is element-wise) "
            "tfdist.sharding.register_elementwise_optimizer(YourOptimizer).")
    if getattr(optimizer, "use_ema", False):
        raise ValueError(
            "Sharding does not support use_ema=True (the moving average is kept whole and "
            "updated outside the optimizer's update step). Received: "
            f"{type(optimizer).__name__}(use_ema=True). Fix: use_ema=False, or shard='none'.")
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(
            "Sharding does not support gradient_accumulation_steps (the accumulators are "
            "whole variables updated outside the sharded update). Received: "
            f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps}. Fix: drop "
            "it (raise the global batch instead), or shard='none'.")
    if stage >= 3:
        clips = {name: getattr(optimizer, name, None)
                 for name in ("clipnorm", "global_clipnorm", "clipvalue")}
        given = {name: value for name, value in clips.items() if value is not None}
        if given:
            raise ValueError(
                "shard='parameters' hands the optimizer gradients that are already summed "
                "over replicas and cut into shards, so Keras's gradient clipping (which acts "
                "on each replica's whole, unreduced gradient) cannot run. Received: "
                f"{', '.join(f'{k}={v}' for k, v in given.items())}. Fix: drop clipping, or "
                "use shard='gradients'.")


def check_layer(layer: Any) -> None:
    """Raises ValueError if `layer` owns stage-3 weights but cannot gather them per call."""
    supported = _keras_classes(_GATHERABLE_LAYERS) + tuple(_extra_layers)
    if isinstance(layer, supported):
        return
    names = [v.path for v in _own_sharded(layer)]
    raise ValueError(
        f"shard='parameters' gathers each layer's weights inside its call and again in the "
        f"backward pass, which is only safe for layers whose call is a pure function of its "
        f"inputs and weights. Received: layer {layer.name!r} ({type(layer).__name__}) owns "
        f"sharded weights {', '.join(names)}. Supported layers (and subclasses): "
        f"{', '.join(supported_layers())}. Fix: keep its weights replicated by raising "
        "shard_min_bytes above their size, use shard='gradients', or declare the layer "
        "with tfdist.sharding.register_gatherable_layer(YourLayer) if its call is pure.")


# --- the storage ----------------------------------------------------------------------


def _strategy_replica_context(strategy: Any) -> bool:
    """True inside `strategy.run` (a replica context of this very strategy)."""
    tf = import_tensorflow()
    context = tf.distribute.get_replica_context()
    return context is not None and context.strategy is strategy


def _in_symbolic_scope() -> bool:
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()


class ShardedStorage:
    """The storage of one Keras variable, cut into equal shards over a strategy's replicas.

    Attributes:
      kind: "slot" (optimizer state) or "parameter" (a stage-3 weight).
      layout: the `tfdist.sharding.layout.ShardLayout` of the variable.
      components: one resource variable of `layout.shard_size` elements per
        local replica, in replica order; component i holds shard
        `plan.ranks[i]`.
    """

    _should_act_as_resource_variable = True

    def __init__(self, *, strategy, plan, layout, components, dtype, name: str,
                 trainable: bool, kind: str):
        self._strategy = strategy
        self.plan = plan
        self.layout = layout
        self.components = tuple(components)
        self._dtype = dtype
        self._name = name
        self._trainable = trainable
        self.kind = kind
        self._unique_id = f"tfdist_sharded/{self.components[0]._unique_id}"

    @classmethod
    def create(cls, *, strategy, plan, value, shape, dtype, name: str, trainable: bool,
               kind: str):
        """Shards of the whole `value` (a tensor, or a callable returning one), one per replica.

        Works where Keras creates variables: eagerly under `strategy.scope()`, and
        inside `strategy.run` in a tf.function (a custom training loop building
        its optimizer on the first step), where only the variable creators of
        the strategy and of tf.function can make a variable that outlives the
        trace.
        """
        tf = import_tensorflow()
        layout = plan.layout(shape)
        dtype = tf.as_dtype(dtype)

        def block(rank):
            whole = tf.cast(value() if callable(value) else value, dtype)
            flat = tf.pad(tf.reshape(whole, [-1]),
                          [[0, layout.padded_size - layout.num_elements]])
            start, stop = layout.shard_range(rank)
            return flat[start:stop]

        in_replica = _strategy_replica_context(strategy)
        components = []
        for replica, rank in enumerate(plan.ranks):
            device = (plan.state_device(replica) if kind == "slot"
                      else plan.local_devices[replica])
            scope = contextlib.nullcontext() if in_replica else strategy.scope()
            with scope, tf.variable_creator_scope(_on_one_device(device)):
                components.append(tf.Variable(
                    lambda rank=rank: block(rank), trainable=trainable,
                    name=f"{name}_shard{rank}", dtype=dtype))
        return cls(strategy=strategy, plan=plan, layout=layout, components=components,
                   dtype=dtype, name=name, trainable=trainable, kind=kind)

    # -- what Keras and TensorFlow read -----------------------------------------------

    @property
    def dtype(self):
        return self._dtype

    @property
    def shape(self):
        tf = import_tensorflow()
        return tf.TensorShape(self.layout.shape)

    @property
    def name(self) -> str:
        return self._name

    @property
    def trainable(self) -> bool:
        return self._trainable

    @property
    def device(self) -> str:
        return self.local().device

    @property
    def _shared_name(self) -> str:
        return self._name

    @property
    def handle(self):
        """The replica's own shard's handle (what a GradientTape differentiates against)."""
        return self.local().handle

    def local(self):
        """This replica's shard (a resource variable). Replica context of the strategy only."""
        if not _strategy_replica_context(self._strategy):
            raise ValueError(
                f"The shard of sharded variable {self._name!r} that belongs to 'this replica' "
                "exists only inside strategy.run; outside, the variable reads as a whole.")
        return self.components[collectives.local_replica_id()]

    def local_rank(self) -> int:
        return self.plan.ranks[collectives.local_replica_id()]

    def __tf_tensor__(self, dtype=None, name=None):
        tf = import_tensorflow()
        if _strategy_replica_context(self._strategy):
            if self.kind == "slot":
                value = self.local().read_value()
            else:
                value = gather_parameter(self)
        else:
            value = self.whole()
        if dtype is not None and dtype != value.dtype:
            value = tf.cast(value, dtype)
        return tf.identity(value, name=name) if name else value

    def value(self):
        tf = import_tensorflow()
        return tf.convert_to_tensor(self)

    read_value = value

    def whole(self):
        """The whole variable (any context but a replica one; eager or in a graph)."""
        tf = import_tensorflow()
        if _in_symbolic_scope():
            # Keras computing output shapes in a scratch graph: no values needed.
            return tf.zeros(self.layout.shape, self._dtype)
        if self.plan.all_local:
            order = sorted(range(len(self.components)), key=lambda i: self.plan.ranks[i])
            with tf.device(self.plan.host_device):
                flat = tf.concat([self.components[i].read_value() for i in order], axis=0)
        else:
            flat = self._gather_across_workers()
        return tf.reshape(flat[:self.layout.num_elements], self.layout.shape)

    def _gather_across_workers(self):
        # Every worker must call this (a collective), as for any multi-worker checkpoint.
        first = min(self.plan.ranks)
        components = self.components
        per_replica = self._strategy.experimental_distribute_values_from_function(
            lambda context: components[context.replica_id_in_sync_group - first].read_value())
        return collectives.gather_blocks(self._strategy, per_replica)

    def numpy(self):
        return self.whole().numpy()

    def __array__(self, dtype=None):
        import numpy as np

        return np.asarray(self.numpy(), dtype=dtype)

    def __repr__(self) -> str:
        return (f"<ShardedStorage {self._name!r} shape={self.layout.shape} kind={self.kind} "
                f"shards={self.layout.num_shards}x{self.layout.shard_size}>")

    # -- writes ---------------------------------------------------------------------

    def _block_of(self, value, rank: int):
        tf = import_tensorflow()
        flat = tf.reshape(tf.cast(value, self._dtype), [-1])
        flat = tf.pad(flat, [[0, self.layout.padded_size - self.layout.num_elements]])
        start, stop = self.layout.shard_range(rank)
        return flat[start:stop]

    def assign(self, value, use_locking=None, name=None, read_value=True):
        """Slot in a replica context: the replica's shard. Otherwise: the whole value."""
        tf = import_tensorflow()
        del use_locking, name, read_value
        if _strategy_replica_context(self._strategy):
            if self.kind == "slot":
                return self.local().assign(value)
            return self.local().assign(self._block_of(value, self.local_rank()))
        updates = []
        for component, rank in zip(self.components, self.plan.ranks):
            with tf.device(component.device):
                updates.append(component.assign(self._block_of(value, rank)))
        return tf.group(updates)

    def assign_block(self, block):
        """Writes this replica's shard (replica context)."""
        return self.local().assign(block)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        if self.kind == "slot" and _strategy_replica_context(self._strategy):
            return self.local().assign_add(delta)
        return self.assign(self.value() + delta)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        if self.kind == "slot" and _strategy_replica_context(self._strategy):
            return self.local().assign_sub(delta)
        return self.assign(self.value() - delta)

    # -- checkpoints: always the whole variable ---------------------------------------

    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": self.whole()}

    def _restore_from_tensors(self, restored_tensors):
        return self.assign(restored_tensors["VARIABLE_VALUE"])

    def _export_to_saved_model_graph(self, *args, **kwargs):
        raise NotImplementedError(
            f"Variable {self._name!r} is sharded over replicas (tfdist shard=...), and a "
            "SavedModel needs whole variables. Fix: load the weights into an unsharded model "
            "(model.save_weights, then load_weights into the same model built without "
            "sharding) and export that one.")

    def _copy_trackable_to_cpu(self, object_map):
        self._export_to_saved_model_graph()


def _tensor_method(name: str):
    def method(self, *args):
        tf = import_tensorflow()
        return getattr(tf.convert_to_tensor(self), name)(*args)

    method.__name__ = name
    return method


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__",
              "__rmod__", "__pow__", "__rpow__", "__matmul__", "__rmatmul__", "__neg__",
              "__pos__", "__abs__", "__getitem__", "__lt__", "__le__", "__gt__", "__ge__"):
    setattr(ShardedStorage, _name, _tensor_method(_name))


def _on_one_device(device: str):
    """A variable creator asking the strategy for a plain variable on `device`.

    What `tf.distribute` itself does for host-side numpy datasets
    (`numpy_dataset.SingleDevice`): the strategy's creator then makes one
    variable on that device instead of a MirroredVariable.
    """
    from tensorflow.python.distribute import numpy_dataset

    def creator(next_creator, **kwargs):
        kwargs["colocate_with"] = numpy_dataset.SingleDevice(device)
        return next_creator(**kwargs)

    return creator


def gather_parameter(storage: ShardedStorage):
    """The whole stage-3 weight in a replica context: all-gather; gradient: reduce-scatter."""
    tf = import_tensorflow()
    strategy, layout = storage._strategy, storage.layout

    @tf.custom_gradient
    def gather(block):
        whole = collectives.all_gather(strategy, block)

        def grad(upstream):
            upstream = tf.reshape(tf.convert_to_tensor(upstream), [-1])
            return collectives.reduce_scatter(strategy, upstream)

        return whole, grad

    whole = gather(storage.local().read_value())
    return tf.reshape(whole[:layout.num_elements], layout.shape)


def sharded_storage(variable: Any) -> ShardedStorage | None:
    """The ShardedStorage behind a Keras variable (or the storage itself), else None."""
    if isinstance(variable, ShardedStorage):
        return variable
    storage = getattr(variable, "_value", None)
    return storage if isinstance(storage, ShardedStorage) else None


def _own_sharded(layer: Any) -> list:
    own = getattr(layer, "_trainable_variables", None) or ()
    return [v for v in own if isinstance(getattr(v, "_value", None), ShardedStorage)
            and v._value.kind == "parameter"]


# --- fix 1: optimizer slots are created sharded ------------------------------------------

_pending = threading.local()
_parameters_made = [0]  # > 0 once a stage-3 weight exists in this process (fast path)


@contextlib.contextmanager
def _creating_slot(strategy, plan):
    _pending.slot = (strategy, plan)
    try:
        yield
    finally:
        _pending.slot = None


def _slot_plan(optimizer, reference):
    from tfdist.sharding import plan as plan_lib

    strategy = getattr(optimizer, "_distribution_strategy", None)
    if not _owner.owns(strategy):
        return None
    plan = plan_lib.plan_of(strategy)
    if plan is None or getattr(reference, "overwrite_with_gradient", False):
        return None
    tf = import_tensorflow()
    if not plan.shards(reference.shape, tf.as_dtype(reference.dtype).size):
        return None
    return strategy, plan


def _slot_target():
    import_tensorflow()
    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    return tf_optimizer.TFOptimizer, "add_variable_from_reference"


def _slot_check(original) -> None:
    from keras.src.optimizers import base_optimizer

    _patch.require_signature(original, "reference_variable", "name", "initializer",
                             what="TFOptimizer.add_variable_from_reference")
    _patch.require_signature(base_optimizer.BaseOptimizer.add_variable_from_reference,
                             "reference_variable", "name", "initializer",
                             what="BaseOptimizer.add_variable_from_reference")


def _slot_make(original):
    from keras.src.optimizers import base_optimizer

    def applies(self, reference_variable, name=None, initializer="zeros"):
        return _slot_plan(self, reference_variable) is not None

    @_patch.passthrough(original, applies)
    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        strategy, plan = _slot_plan(self, reference_variable)
        check_optimizer(self, stage=plan.stage)
        with _creating_slot(strategy, plan):
            # The base class's method: TFOptimizer's colocates the slot with its variable,
            # which a sharded weight is not (and the shards are placed explicitly).
            return base_optimizer.BaseOptimizer.add_variable_from_reference(
                self, reference_variable, name=name, initializer=initializer)

    return add_variable_from_reference


SLOT_FIX = _patch.Fix(name="sharding_variables.add_variable_from_reference", issue=ISSUE,
                      target=_slot_target, check=_slot_check, make=_slot_make)


# --- fix 2: keras.Variable storage (slots being created; stage-3 weights) ---------------


def _parameter_plan(variable, value):
    from tfdist.sharding import plan as plan_lib

    strategy = _owner.current_strategy()
    if not _owner.owns(strategy):
        return None
    plan = plan_lib.plan_of(strategy)
    if plan is None or plan.stage < 3 or not variable.trainable:
        return None
    tf = import_tensorflow()
    if tf.distribute.get_replica_context() is not None:  # replica context: not a creation
        return None
    dtype = tf.as_dtype(variable._dtype)
    if not dtype.is_floating:
        return None
    shape = variable._shape
    if shape is None:
        if callable(value):
            return None
        shape = tuple(tf.convert_to_tensor(value).shape)
    if any(d is None for d in shape) or not plan.shards(shape, dtype.size):
        return None
    return strategy, plan


def _variable_target():
    import_tensorflow()
    from keras.src.backend.tensorflow import core

    return core.Variable, "_initialize"


def _variable_check(original) -> None:
    from keras.src.backend.tensorflow import core

    from tensorflow.python.distribute import numpy_dataset

    _patch.require_signature(original, "value", what="keras TF Variable._initialize")
    _patch.require_attributes(numpy_dataset, "SingleDevice", what="tf.distribute numpy_dataset")
    _patch.require_attributes(core.Variable, "trainable", "name", "path", "value",
                              what="keras TF Variable")


def _variable_make(original):
    def applies(self, value):
        return getattr(_pending, "slot", None) is not None or (
            _parameter_plan(self, value) is not None)

    @_patch.passthrough(original, applies)
    def _initialize(self, value):
        pending = getattr(_pending, "slot", None)
        if pending is not None:
            _pending.slot = None  # one slot per add_variable_from_reference
            strategy, plan = pending
            self._value = ShardedStorage.create(
                strategy=strategy, plan=plan, value=value, shape=self._shape,
                dtype=self._dtype, name=self.name, trainable=False, kind="slot")
            return
        strategy, plan = _parameter_plan(self, value)
        # The strategy makes the whole variable first: across workers it broadcasts worker 0's
        # initial value, so every worker cuts the same weight. The whole copy is dropped.
        original(self, value)
        whole = self._value
        self._value = ShardedStorage.create(
            strategy=strategy, plan=plan, value=whole.read_value(), shape=whole.shape,
            dtype=whole.dtype, name=self.name, trainable=True, kind="parameter")
        del whole
        _parameters_made[0] += 1

    return _initialize


VARIABLE_FIX = _patch.Fix(name="sharding_variables.variable_initialize", issue=ISSUE,
                          target=_variable_target, check=_variable_check, make=_variable_make)


# --- fix 3: decoupled weight decay of stage-3 weights -----------------------------------


def _decay_target():
    import_tensorflow()
    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    return tf_optimizer.TFOptimizer, "_apply_weight_decay"


def _decay_check(original) -> None:
    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    _patch.require_signature(original, "variables", what="TFOptimizer._apply_weight_decay")
    _patch.require_attributes(tf_optimizer.TFOptimizer, "_use_weight_decay", "learning_rate",
                              what="TFOptimizer")


def _decay_make(original):
    def applies(self, variables):
        return any(sharded_storage(v) is not None for v in variables)

    @_patch.passthrough(original, applies)
    def _apply_weight_decay(self, variables):
        tf = import_tensorflow()
        if self.weight_decay is None:
            return
        whole = [v for v in variables if sharded_storage(v) is None]
        if whole:
            original(self, whole)
        for variable in variables:
            storage = sharded_storage(variable)
            if storage is None or not self._use_weight_decay(variable):
                continue
            # Keras's own rule, on each shard: variable -= variable * wd * lr.
            lr = tf.cast(self.learning_rate, storage.dtype)
            wd = tf.cast(self.weight_decay, storage.dtype)
            if _strategy_replica_context(storage._strategy):
                shards = [storage.local()]
            else:
                shards = list(storage.components)
            for shard in shards:
                shard.assign_sub(shard * wd * lr)

    return _apply_weight_decay


DECAY_FIX = _patch.Fix(name="sharding_variables.apply_weight_decay", issue=ISSUE,
                       target=_decay_target, check=_decay_check, make=_decay_make)


# --- fix 4: layers gather their stage-3 weights per call, again in the backward pass -----


def _call_target():
    import_tensorflow()
    from keras.src.ops import operation

    return operation.Operation, "__call__"


def _call_check(original) -> None:
    from keras.src.layers import layer as layer_module

    # A layer's own weights are in `_trainable_variables`, filled by `_track_variable`.
    _patch.require_attributes(layer_module.Layer, "_track_variable", "call",
                              what="keras Layer")
    _patch.require_signature(original, "args", "kwargs", what="keras Operation.__call__")


def _call_make(original):
    import keras

    def applies(self, *args, **kwargs):
        return _parameters_made[0] > 0 and bool(_own_sharded(self))

    @_patch.passthrough(original, applies)
    def __call__(self, *args, **kwargs):
        tf = import_tensorflow()
        check_layer(self)
        strategy = _own_sharded(self)[0]._value._strategy
        if not _strategy_replica_context(strategy):
            return original(self, *args, **kwargs)
        # keras.remat differentiates its positional arguments: pass the float tensors
        # (inputs whose gradient flows back), keep everything else (ids, masks, flags) in
        # the closure; a layer with no float input (Embedding) gets a dummy one.
        flat = tf.nest.flatten((args, kwargs))
        positions = [i for i, x in enumerate(flat)
                     if isinstance(x, tf.Tensor) and x.dtype.is_floating]
        inputs = [flat[i] for i in positions] or [tf.zeros([])]

        def call(*tensors):
            items = list(flat)
            for position, tensor in zip(positions, tensors):
                items[position] = tensor
            call_args, call_kwargs = tf.nest.pack_sequence_as((args, kwargs), items)
            return original(self, *call_args, **call_kwargs)

        # Forward: gather, compute, drop the gathered weights. Backward: gather again.
        return keras.remat(call)(*inputs)

    return __call__


CALL_FIX = _patch.Fix(name="sharding_variables.layer_call", issue=ISSUE,
                      target=_call_target, check=_call_check, make=_call_make)

FIXES = (SLOT_FIX, VARIABLE_FIX, DECAY_FIX, CALL_FIX)


def install() -> None:
    """Installs the four fixes (idempotent)."""
    collectives.check_supported()
    for fix in FIXES:
        _patch.install(fix)


def placed_bytes(variable: Any, strategy: Any) -> list[tuple[str, int]]:
    """(device, bytes) of every piece of storage behind a Keras (or TF) variable.

    A sharded variable: its shards; a MirroredVariable: one whole copy per
    replica; a plain variable: itself. Read from the variables, not computed.
    """
    storage = getattr(variable, "_value", variable)
    if isinstance(storage, ShardedStorage):
        pieces = storage.components
    elif hasattr(storage, "values") and hasattr(storage, "_primary"):  # DistributedVariable
        pieces = strategy.experimental_local_results(storage)
    else:
        pieces = (storage,)
    return [(piece.device, int(piece.shape.num_elements()) * piece.dtype.size)
            for piece in pieces]
