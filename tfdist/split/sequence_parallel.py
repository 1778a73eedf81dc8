"""Sequence parallelism for Keras transformer blocks: each device runs a slice of the sequence.

    sp = tfdist.split.sequence_parallel(model, devices=["/cpu:0", "/cpu:1"])
    sp.compile("adam", loss); sp.fit(x, y, batch_size=64)

The model's own layers run node by node (tfdist.split.graph). Where a
position-wise layer (LayerNormalization over features, Dense, Embedding,
Dropout, Activation, element-wise Add/Multiply/...) meets a (batch, sequence,
...) tensor whose sequence divides over the N devices, the tensor is cut into
N slices along the sequence and device i runs those layers on slice i: their
activations (the bulk of a transformer's) are 1/N per device.

Attention needs every position's keys and values. Each device all-gathers the
key/value *inputs* of a MultiHeadAttention (the N slices concatenated along
the sequence) and computes attention for its own queries only; a causal mask
is offset to the slice's positions. We gather rather than use the
DeepSpeed-Ulysses all-to-all (which swaps a sequence split for a head split
around attention): Keras's MultiHeadAttention keeps its projections and the
head split inside one layer, so an all-to-all would mean rewriting it, while
gathering its inputs runs it unchanged and exactly; the price is that every
device projects the full keys and values (N x that part of the projection
work) and holds them (one sequence of keys/values per device, during
attention). Anything else with a sliced input (pooling over the sequence, a
Reshape, the head) first gathers the full sequence on the first device.

Forward and gradients equal the unsplit model up to fp32 summation order
(tests/split/test_sequence_parallel.py); gradient ops follow their forward ops' devices
(tfdist.compat.placed_training). With replicas=R, devices are R groups of N,
one MirroredStrategy replica per group (variables mirrored on each group's
first device).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

from tfdist import parallelism as parallelism_lib
from tfdist._tf import import_tensorflow
from tfdist.compat import keras_graph, placed_training
from tfdist.split import graph as graph_lib

import_tensorflow()  # quietly, before keras imports TensorFlow itself

import keras  # noqa: E402

# keras layers and ops that act on each position independently
_ELEMENTWISE_OPS = frozenset(
    "Add Subtract Multiply Divide TrueDivide Maximum Minimum Average Negative Relu Gelu Tanh "
    "Sigmoid Silu Exp Square Sqrt Cast".split())
_POSITION_WISE_LAYERS = (keras.layers.Dense, keras.layers.Dropout, keras.layers.Activation,
                         keras.layers.Embedding, keras.layers.Add, keras.layers.Subtract,
                         keras.layers.Multiply, keras.layers.Average, keras.layers.Maximum,
                         keras.layers.Minimum, keras.layers.ReLU)


def _position_wise(op) -> bool:
    if isinstance(op, keras.layers.LayerNormalization):
        axis = op.axis if isinstance(op.axis, (list, tuple)) else [op.axis]
        return list(axis) == [-1]
    if isinstance(op, _POSITION_WISE_LAYERS):
        return True
    return not isinstance(op, keras.layers.Layer) and type(op).__name__ in _ELEMENTWISE_OPS


def nearest_valid_lengths(length: int, parts: int) -> tuple[int, int]:
    """The multiples of `parts` just below and above `length`."""
    below = length // parts * parts
    return (below if below > 0 else parts), below + parts


def check_length(length: int, parts: int) -> None:
    """Raises ValueError naming the nearest valid lengths when `length` does not divide."""
    if length % parts:
        low, high = nearest_valid_lengths(length, parts)
        raise ValueError(
            f"Sequence length {length} does not divide over {parts} devices (sequence "
            f"parallelism gives each device an equal slice). Use a length that is a multiple "
            f"of {parts}: the nearest are {low} and {high} (pad or crop the sequences), or "
            f"another number of devices.")


class SequenceParallelModel(keras.Model):
    """A keras.Model running another model with its sequence cut over devices.

    Attributes:
      devices: the N devices of replica 0 (slice i on devices[i]).
      replicas: data-parallel replicas (1 = none).
      parallelism: the `tfdist.Parallelism` it runs (replicas x sequence, devices).
      strategy: the replicas' strategy (None for one replica).
    """

    def __init__(self, *, graph, replica_devices, strategy, parallelism=None, **kwargs):
        super().__init__(name=kwargs.pop("name", f"{graph.model.name}_seqpar"), **kwargs)
        self._graph = graph
        self._placed = list(graph.layers.values())  # tracked: the model's own weights
        self.replica_devices = replica_devices
        self.devices = list(replica_devices[0])
        self.replicas = len(replica_devices)
        self.parallelism = parallelism
        self.strategy = strategy
        self.built = True

    def _replica_devices(self) -> list[str]:
        tf = import_tensorflow()
        if self.replicas == 1:
            return self.devices
        ctx = tf.distribute.get_replica_context()
        rid = 0 if ctx is None else tf.get_static_value(ctx.replica_id_in_sync_group)
        return self.replica_devices[int(rid or 0)]

    def call(self, inputs, training=None):
        return run(self._graph, inputs, self._replica_devices(), training=training)

    def compile(self, *args, **kwargs):
        scope = self.strategy.scope() if self.strategy is not None else contextlib.nullcontext()
        with scope:
            super().compile(*args, **kwargs)
        if self.optimizer is not None:
            placed_training.colocate_optimizer_slots(self.optimizer)

    def train_step(self, data):
        return placed_training.placed_train_step(self, data)

    def get_weights(self):
        return self._graph.model.get_weights()

    def set_weights(self, weights):
        self._graph.model.set_weights(weights)

    @property
    def layer_graph(self):
        return self._graph


class _Sharded:
    """N slices of one value along its sequence axis (axis 1)."""

    def __init__(self, parts):
        self.parts = list(parts)


def run(graph, inputs, devices: Sequence[str], *, training=None):
    """Runs the flattened graph with position-wise layers on sequence slices."""
    tf = import_tensorflow()
    n = len(devices)
    values: dict = dict(zip(graph.input_keys, graph.flat_inputs(inputs)))

    def whole(value, device=None):
        if isinstance(value, _Sharded):
            with tf.device(device or devices[0]):
                return tf.concat(value.parts, axis=1)
        return value

    def sliced(value, i, length):
        """Slice i of a whole value that has the sequence axis (else the value)."""
        if isinstance(value, _Sharded):
            return value.parts[i]
        if not tf.is_tensor(value) and not isinstance(value, (keras.Variable,)):
            return value
        shape = value.shape
        step = length // n
        if len(shape) >= 3 or (len(shape) == 2 and value.dtype.is_integer):
            if shape[1] == length:  # (batch, sequence, ...) or token ids (batch, sequence)
                return value[:, i * step:(i + 1) * step]
        if len(shape) == 2 and shape[0] == length:  # (sequence, features): positions
            return value[i * step:(i + 1) * step]
        return value

    for node in graph.nodes:
        inputs_now = [values[k] for k in node.input_keys]
        sharded = [v for v in inputs_now if isinstance(v, _Sharded)]
        op = node.operation
        length = None
        if sharded:
            length = sum(int(p.shape[1]) for p in sharded[0].parts)
        elif _position_wise(op) or isinstance(op, keras.layers.MultiHeadAttention):
            main = next((v for v in inputs_now if tf.is_tensor(v) and len(v.shape) >= 2
                         and v.shape[1] is not None and (len(v.shape) >= 3
                                                         or v.dtype.is_integer)), None)
            if main is not None and int(main.shape[1]) >= n:
                length = int(main.shape[1])
                check_length(length, n)
        if length is None or not (_position_wise(op)
                                  or isinstance(op, keras.layers.MultiHeadAttention)):
            local = {k: whole(values[k]) for k in node.input_keys}
            with tf.device(devices[0]):
                node.call(local, training)
            values.update({k: local[k] for k in node.output_keys})
            continue
        outputs = [[] for _ in node.output_keys]
        for i, device in enumerate(devices):
            local = {k: sliced(values[k], i, length) for k in node.input_keys}
            with tf.device(device):
                if isinstance(op, keras.layers.MultiHeadAttention):
                    gather = lambda v, d=device: whole(v, d)  # noqa: E731 - all-gather here
                    _attention_slice(node, local, values, gather, i, n, length, training)
                else:  # constants captured in the graph (positions) are sliced too
                    cut = lambda x, i=i: sliced(x, i, length) if tf.is_tensor(x) else x  # noqa
                    node.invoke(graph_lib._fill(node.args, local, cut),
                                graph_lib._fill(node.kwargs, local, cut), local, training)
            for j, k in enumerate(node.output_keys):
                outputs[j].append(local[k])
        for k, parts in zip(node.output_keys, outputs):
            values[k] = _Sharded(parts)
    return graph.pack_outputs([whole(values[k]) for k in graph.output_keys])


def _attention_slice(node, local, values, whole, i, n, length, training):
    """Device i's queries against every position's keys and values (gathered)."""
    tf = import_tensorflow()
    args, kwargs = list(node.args), dict(node.kwargs)
    refs = {"query": args[0] if args else kwargs.get("query"),
            "value": args[1] if len(args) > 1 else kwargs.get("value"),
            "key": args[2] if len(args) > 2 else kwargs.get("key")}
    query = local[refs["query"].key]
    value = whole(values[refs["value"].key])
    key = whole(values[refs["key"].key]) if refs["key"] is not None else value
    call = {k: v for k, v in graph_lib._fill(kwargs, local).items()
            if k not in ("query", "value", "key")}
    if call.pop("use_causal_mask", False):
        step = length // n
        q_pos = tf.range(i * step, (i + 1) * step)[:, None]
        k_pos = tf.range(length)[None, :]
        causal = q_pos >= k_pos
        mask = call.get("attention_mask")
        call["attention_mask"] = causal[None] if mask is None else tf.logical_and(
            tf.cast(mask, tf.bool), causal[None])
    if call.get("attention_mask") is not None and refs.get("query") is not None:
        mask = call["attention_mask"]
        if mask.shape.rank == 3 and mask.shape[1] == length:  # (batch, Tq, Tv): own rows
            step = length // n
            call["attention_mask"] = mask[:, i * step:(i + 1) * step]
    effective = training if training is not None else node.training
    if effective is not None:
        call["training"] = effective
    out = node.operation(query, value, key, **call)
    for k, v in zip(node.output_keys, keras.tree.flatten(out)):
        local[k] = v


def sequence_parallel(model, *, devices: Sequence[str] | None = None,
                      replicas: int | None = None,
                      parallelism: parallelism_lib.Parallelism | None = None,
                      strategy=None) -> SequenceParallelModel:
    """Runs `model` with its transformer layers on slices of the sequence.

    The model's own layers run (no copies); with replicas > 1 its variables
    become mirrored variables of a MirroredStrategy over each group's first
    device (made from the `tfdist.Parallelism`).

    Args:
      model: a built Functional or Sequential keras.Model.
      devices: R x N device names: N devices share each sequence, R replicas.
      replicas: data-parallel replicas R (MirroredStrategy), default 1.
      parallelism: `tfdist.Parallelism(replicas=R, sequence=N)` instead of
        `devices`/`replicas` (devices: its own, else the first R x N).
      strategy: a strategy `tfdist.make_strategy(parallelism)` made, instead
        of `parallelism`.

    Returns:
      A SequenceParallelModel: compile() and fit() it like the original.

    Raises:
      ValueError: bad devices, a Parallelism with a pipeline or tensor split,
        or a model input whose sequence length does not divide over N (naming
        the nearest valid lengths).

    Example:
      >>> sp = tfdist.split.sequence_parallel(model, devices=["/cpu:0", "/cpu:1"])
      >>> sp = tfdist.split.sequence_parallel(model, parallelism=tfdist.Parallelism(sequence=2))
    """
    from tfdist import devices as devices_lib
    from tfdist.split.pipeline import _check_devices_arg, given_parallelism

    dims = given_parallelism(parallelism, strategy, {"devices": devices, "replicas": replicas},
                             caller="sequence_parallel")
    if dims is not None:
        other = [f"{name}={getattr(dims, name)}" for name in ("stages", "tensor", "micro_batches")
                 if getattr(dims, name) > 1]
        if other:
            raise ValueError(
                f"sequence_parallel cuts sequences (Parallelism(sequence=N)); {dims} has "
                f"{', '.join(other)}, a pipeline or tensor split: use tfdist.split_model.")
    else:
        devices = _check_devices_arg(devices)
        if devices is None:
            raise ValueError("sequence_parallel needs devices=[...], one per sequence slice.")
        replicas = 1 if replicas is None else replicas
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an integer >= 1. Received: replicas={replicas!r}")
        if len(devices) % replicas:
            raise ValueError(f"{len(devices)} devices cannot be grouped into replicas={replicas} "
                             f"equal groups. Received: devices={devices}.")
        devices_lib.resolve_devices(devices)
        dims = parallelism_lib.Parallelism(replicas=replicas, sequence=len(devices) // replicas,
                                           devices=tuple(devices)).resolve()
    groups = [list(g) for g in dims.replica_groups]
    n = dims.sequence
    graph = graph_lib.flatten(model)
    if not any(isinstance(l, keras.layers.MultiHeadAttention) or _position_wise(l)
               for l in graph.layers.values()):
        raise ValueError(
            f"Model {model.name!r} has no layer sequence parallelism can slice "
            "(MultiHeadAttention, LayerNormalization, Dense, Embedding, ...).")
    for _, shape, _ in graph.input_specs:
        if len(shape) >= 2 and shape[1] is not None and len(shape) == 3:
            check_length(int(shape[1]), n)
    if dims.replicas == 1:
        strategy = None
    else:
        if strategy is None:
            from tfdist import strategies

            # The replicas' strategy, made from the Parallelism: one replica per group, on
            # the group's first device.
            strategy = strategies.make_strategy(dims)
        moved: set[int] = set()
        for layer in graph.layers.values():
            for variable in layer.variables:
                if id(variable) not in moved:
                    moved.add(id(variable))
                    keras_graph.move_variable(variable, groups[0][0], strategy=strategy)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        return SequenceParallelModel(graph=graph, replica_devices=groups, strategy=strategy,
                                     parallelism=dims)
