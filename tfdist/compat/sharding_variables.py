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
  backward pass (the FSDP idea; the layer's forward runs twice). A layer not
  known to be pure, and every layer when the strategy's plan says
  `remat=False` (`shard_remat=False`), runs as written instead: each read
  gathers, and the tape keeps the gathered weights until the backward pass.

No upstream issue: Keras's TensorFlow backend has no sharded data
parallelism (its `distribution_lib` is marked "DO NOT USE"). Verified on the
versions in `tfdist.compat.TESTED`; tests/sharding/test_layout_and_options.py checks the
shapes these fixes rely on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from typing import Any

from tfdist._tf import import_tensorflow
from tfdist.compat import _owner, _patch
from tfdist.compat import sharding_collectives as collectives
from tfdist.sharding import registry

logger = logging.getLogger("tfdist")

ISSUE = "none upstream: Keras 3's TF backend has no sharded data parallelism (ZeRO)"

# --- the storage ----------------------------------------------------------------------


def _strategy_replica_context(strategy: Any) -> bool:
    """True inside `strategy.run` (a replica context of this very strategy)."""
    tf = import_tensorflow()
    context = tf.distribute.get_replica_context()
    return context is not None and context.strategy is strategy


_storages_made = [0]  # > 0 once any sharded variable exists in this process (fast path)
_export_state = threading.local()


def _exporting() -> bool:
    """True while model.export / ExportArchive.write_out / tf.saved_model.save runs."""
    return getattr(_export_state, "depth", 0) > 0


@contextlib.contextmanager
def exporting():
    """Sharded variables read as whole, plain variables (`export_variable`) in this block.

    Nested blocks share the outermost one's copies, which are dropped when it ends.
    """
    depth = getattr(_export_state, "depth", 0)
    if depth == 0:
        _export_state.copies = []
    _export_state.depth = depth + 1
    try:
        yield
    finally:
        _export_state.depth = depth
        if depth == 0:
            for storage in _export_state.copies:
                storage._export_copy = None
            _export_state.copies = []


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
        self._variable = None  # weakref to the Keras variable this stores (stage-3 weights)
        self._export_copy = None  # the whole variable, during an export only
        _storages_made[0] += 1

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
    def strategy(self):
        """The strategy whose replicas hold the shards."""
        return self._strategy

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

    def trains(self) -> bool:
        """False once the Keras variable it stores is frozen (e.g. a LoRA base weight)."""
        variable = self._variable() if self._variable is not None else None
        return self._trainable if variable is None else bool(variable.trainable)

    @property
    def device(self) -> str:
        if _exporting():
            return self.export_variable().device
        return self.local().device

    @property
    def _shared_name(self) -> str:
        return self._name

    @property
    def handle(self):
        """The replica's own shard's handle (what a GradientTape differentiates against).

        During a SavedModel export: the handle of the whole copy it is exported as.
        """
        if _exporting() and not _strategy_replica_context(self._strategy):
            return self.export_variable().handle
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
                with _in_layer_graph():
                    value = gather_parameter(self)
        elif _exporting():
            value = self.export_variable().read_value()
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

    # -- SavedModel export: a whole, plain variable in place of the shards ------------

    def export_variable(self):
        """The whole variable as one plain variable on the host, made once per export.

        Only during `model.export` / `tf.saved_model.save` (see `exporting`): the
        functions they trace read it, and the SavedModel holds it, so the
        exported model has whole variables and no collectives. Dropped when the
        export ends. Under multi_worker_mirrored reading the whole value is a
        collective: every worker exports, as every worker saves a checkpoint.
        """
        if not _exporting():
            raise ValueError(
                f"The export copy of sharded variable {self._name!r} exists only while "
                "model.export or tf.saved_model.save runs.")
        if self._export_copy is None:
            tf = import_tensorflow()
            with tf.init_scope():  # eager, also while an export traces a function
                value = self.whole()
                with self._strategy.scope(), tf.variable_creator_scope(
                        _on_one_device(self.plan.host_device)):
                    self._export_copy = tf.Variable(value, trainable=self.trains(),
                                                    name=self._name, dtype=self._dtype)
            _export_state.copies.append(self)
        return self._export_copy

    def _export_to_saved_model_graph(self, object_map=None, tensor_map=None, options=None,
                                     **kwargs):
        if self._export_copy is None:
            raise NotImplementedError(
                f"Variable {self._name!r} is sharded over replicas (tfdist shard=...) and "
                "this SavedModel writer did not gather it: tfdist gathers sharded variables "
                "into whole ones inside model.export, keras.export.ExportArchive.write_out "
                "and tf.saved_model.save (the functions must be traced there too, not "
                "before). Fix: export with one of those, or load the weights into the "
                "same model built without sharding and export that one.")
        copy = self._export_copy
        resources = copy._export_to_saved_model_graph(object_map=object_map,
                                                      tensor_map=tensor_map, options=options,
                                                      **kwargs)
        object_map[self] = object_map[copy]
        return resources

    def _write_object_proto(self, proto, options):
        return self.export_variable()._write_object_proto(proto, options)

    def _copy_trackable_to_cpu(self, object_map):
        raise NotImplementedError(
            f"Variable {self._name!r} is sharded over replicas (tfdist shard=...); "
            "asynchronous checkpoints (CheckpointOptions(experimental_enable_async_"
            "checkpoint=True)) copy each variable to the CPU as it is stored, which a "
            "sharded variable is not. Fix: write the checkpoint synchronously.")


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


_layer_graphs = threading.local()


@contextlib.contextmanager
def _layer_graph():
    """Records the graph a layer's call runs in (see `_in_layer_graph`)."""
    tf = import_tensorflow()
    stack = getattr(_layer_graphs, "stack", None)
    if stack is None:
        stack = _layer_graphs.stack = []
    stack.append(tf.compat.v1.get_default_graph())
    try:
        yield
    finally:
        stack.pop()


def _in_layer_graph():
    """The graph of the innermost layer call, if the weight is read in a function nested in it.

    A layer may run part of its call as a nested `tf.function`, XLA-compiled
    ones included (Keras's TF backend compiles grouped convolutions on CPU with
    XLA), where a collective cannot run. The gather is then built in the
    layer's own graph and the nested function captures the whole weight.
    """
    tf = import_tensorflow()
    stack = getattr(_layer_graphs, "stack", None)
    current = tf.compat.v1.get_default_graph()
    if not stack or stack[-1] is current:
        return contextlib.nullcontext()
    graph = current
    while graph is not None and graph is not stack[-1]:
        graph = getattr(graph, "outer_graph", None)
    return stack[-1].as_default() if graph is not None else contextlib.nullcontext()


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

    block = storage.local().read_value()
    if storage.trains():
        whole = gather(block)
    else:  # frozen: no gradient, so no reduce-scatter in the backward pass
        whole = tf.stop_gradient(collectives.all_gather(strategy, block))
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
        registry.check_optimizer(self, stage=plan.stage)
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
        self._value._variable = weakref.ref(self)
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


_logged_classes: set = set()


def _note_kept(layer) -> None:
    """Says once per class that a layer keeps its gathered weights until its backward pass."""
    cls = type(layer)
    if cls in _logged_classes:
        return
    _logged_classes.add(cls)
    logger.info(
        "shard='parameters': layer %r (%s) is not known to have a pure call, so it runs without "
        "rematerialisation: it gathers its sharded weights (%s) when it reads them and keeps "
        "them until its backward pass. Exact; it costs those weights' whole size in between. "
        "If its call is a pure function of its inputs and weights, "
        "tfdist.sharding.register_gatherable_layer(%s) drops them after the forward pass.",
        layer.name, registry.qualified(cls), ", ".join(v.path for v in _own_sharded(layer)),
        cls.__name__)


def _remat(strategy) -> bool:
    """False where the strategy keeps gathered weights until the backward pass (shard_remat)."""
    from tfdist.sharding import plan as plan_lib

    plan = plan_lib.plan_of(strategy)
    return plan is None or plan.remat


def _call_make(original):
    import keras

    def applies(self, *args, **kwargs):
        return _parameters_made[0] > 0 and bool(_own_sharded(self))

    @_patch.passthrough(original, applies)
    def __call__(self, *args, **kwargs):
        tf = import_tensorflow()
        strategy = _own_sharded(self)[0]._value._strategy
        if not _strategy_replica_context(strategy):
            return original(self, *args, **kwargs)
        gatherable = registry.is_gatherable(self)
        if not gatherable or not _remat(strategy):
            # Each read of a sharded weight gathers it (gather_parameter); the tape keeps
            # the gathered value for the backward pass, and the layer's state updates and
            # random draws happen once, as without sharding.
            if not gatherable:
                _note_kept(self)
            with _layer_graph():
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
            with _layer_graph():  # also when remat runs it again for the backward pass
                return original(self, *call_args, **call_kwargs)

        # Forward: gather, compute, drop the gathered weights. Backward: gather again.
        return keras.remat(call)(*inputs)

    return __call__


CALL_FIX = _patch.Fix(name="sharding_variables.layer_call", issue=ISSUE,
                      target=_call_target, check=_call_check, make=_call_make)

# --- fixes 5 and 6: a SavedModel gets whole variables -----------------------------------


def _copy_reachable(root) -> None:
    """Makes the export copy of every sharded variable reachable from `root`, eagerly.

    Before any function is traced: a variable first made inside a trace would
    belong to that trace. Optimizer slots get theirs too (a SavedModel of a
    model holds them, and no function reads them).
    """
    tf = import_tensorflow()
    for trackable in tf.train.TrackableView(root).descendants():
        storage = sharded_storage(trackable)
        if storage is not None:
            storage.export_variable()


def _save_target():
    import_tensorflow()
    from tensorflow.python.saved_model import save

    return save, "save_and_return_nodes"


def _save_check(original) -> None:
    tf = import_tensorflow()
    _patch.require_signature(original, "obj", "export_dir", "signatures", "options",
                             "experimental_skip_checkpoint",
                             what="tensorflow saved_model save_and_return_nodes")
    _patch.require_attributes(tf.train, "TrackableView", what="tf.train")


def _save_make(original):
    def applies(obj, *args, **kwargs):
        return _storages_made[0] > 0

    @_patch.passthrough(original, applies)
    def save_and_return_nodes(obj, *args, **kwargs):
        with exporting():
            _copy_reachable(obj)
            return original(obj, *args, **kwargs)

    return save_and_return_nodes


SAVE_FIX = _patch.Fix(name="sharding_variables.saved_model_save", issue=ISSUE,
                      target=_save_target, check=_save_check, make=_save_make)


def _write_out_target():
    from tfdist.compat import keras_files

    return keras_files._export_archive_class(), "write_out"


def _write_out_make(original):
    def applies(self, *args, **kwargs):
        return _storages_made[0] > 0

    @_patch.passthrough(original, applies)
    def write_out(self, *args, **kwargs):
        # Keras traces the endpoints here, before tf.saved_model.save: they must read the
        # whole copies too.
        with exporting():
            _copy_reachable(getattr(self, "_tf_trackable", self))
            return original(self, *args, **kwargs)

    return write_out


WRITE_OUT_FIX = _patch.Fix(
    name="sharding_variables.export_write_out", issue=ISSUE, target=_write_out_target,
    check=lambda original: _patch.require_signature(original, "filepath", "options",
                                                    "verbose", what="ExportArchive.write_out"),
    make=_write_out_make)

FIXES = (SLOT_FIX, VARIABLE_FIX, DECAY_FIX, CALL_FIX, SAVE_FIX, WRITE_OUT_FIX)


def install() -> tuple[str, ...]:
    """Installs the six fixes, or none (idempotent); returns the names installed by this call."""
    collectives.check_supported()
    return _patch.install_all(FIXES)


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
