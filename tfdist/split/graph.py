"""A model's layer graph, flattened, run node by node, and cut into stages.

`flatten(model)` reads a Sequential or Functional model (KerasHub task models
and backbones included) as one flat list of calls ("nodes") in execution
order: nested Functional and Sequential models are inlined, so the layers of
a backbone nested in a task model can go to different stages; a layer called
twice (shared layers, a language-model head tied to the token embedding) is
one layer with two nodes. A subclassed model is accepted when its layers,
applied one after another in `model.layers` order, compute what the model
computes (checked numerically).

The split runs the model's *own* layers: nothing is rebuilt from configs
(real layers do not always round-trip through `get_config`), and each
layer's variables are moved to its stage's device (see
`tfdist.compat.keras_graph.move_variable`). The graph is then cut into stages
(maximal runs of layers on one device); tensors that skip a stage (residual
connections crossing a cut) are carried past it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import numpy as np

from tfdist._tf import import_tensorflow
from tfdist.compat import keras_graph
from tfdist.split import plan as plan_lib

import_tensorflow()  # quietly, before keras imports TensorFlow itself

import keras  # noqa: E402

Key = tuple  # a value in the flattened graph: (call scope, id of its KerasTensor)


@dataclasses.dataclass(frozen=True)
class _Ref:
    """Placeholder for a graph value inside a node's call arguments."""

    key: Key


@dataclasses.dataclass
class Node:
    """One call in the flattened graph.

    Attributes:
      index: position in execution order.
      operation: the layer (or keras op) called; the model's own object.
      layer: the plan name of the layer, or None for a keras op such as `x + y`.
      first_call: this is the layer's first call (its variables' stage).
      args, kwargs: the call's arguments, values replaced by `_Ref`s.
      input_keys, output_keys: the values it reads and writes.
      output_specs: (shape, dtype) of each output, batch dimension first.
      training: a fixed `training=` from the enclosing model call, if any.
    """

    index: int
    operation: Any
    layer: str | None
    first_call: bool
    args: tuple
    kwargs: dict
    input_keys: tuple
    output_keys: tuple
    output_specs: tuple
    training: bool | None = None

    @property
    def name(self) -> str:
        return self.layer or getattr(self.operation, "name", type(self.operation).__name__)

    def call(self, values: dict, training=None):
        """Runs the node on `values` (key -> tensor) and stores its outputs there.

        `training` follows Keras's Functional: the outer call's value, when
        given, overrides what the graph recorded (even a nested model's
        `training=False`); without it, the recorded value applies.
        """
        self.invoke(_fill(self.args, values), _fill(self.kwargs, values), values, training)

    def invoke(self, args, kwargs: dict, values: dict, training=None):
        """Calls the operation on filled-in arguments; stores the outputs in `values`."""
        kwargs = dict(kwargs)
        effective = training if training is not None else self.training
        if effective is not None and "training" in keras_graph.call_context_args(self.operation):
            kwargs["training"] = effective
        outputs = self.operation(*args, **kwargs)
        for key, value in zip(self.output_keys, keras.tree.flatten(outputs)):
            values[key] = value


def _fill(structure, values, constant=None):
    """The structure with each _Ref replaced by its value (and other leaves by
    `constant(leaf)` when given)."""
    if not structure:
        return structure
    return keras.tree.map_structure(
        lambda x: values[x.key] if isinstance(x, _Ref) else
        (constant(x) if constant is not None else x), structure)


@dataclasses.dataclass
class LayerGraph:
    """A model as a flat list of calls.

    Attributes:
      model: the model it was read from.
      nodes: every call, in execution order.
      layers: {plan name: layer} in order of first call (InputLayers excluded).
      input_keys, output_keys: the model's inputs and outputs.
      input_specs: (name, shape, dtype) of each model input.
      inputs_struct, outputs_struct: how the model's inputs/outputs nest
        (dict / list / single tensor), with KerasTensors as leaves.
    """

    model: Any
    nodes: list
    layers: dict
    input_keys: tuple
    output_keys: tuple
    input_specs: tuple
    inputs_struct: Any
    outputs_struct: Any

    @property
    def layer_names(self) -> list[str]:
        return list(self.layers)

    def nodes_of(self, name: str) -> list:
        return [n for n in self.nodes if n.layer == name]

    def flat_inputs(self, inputs) -> list:
        """The model's inputs in `input_keys` order (dicts matched by input name)."""
        struct = self.inputs_struct
        names = [n for n, _, _ in self.input_specs]
        if isinstance(inputs, dict):
            if isinstance(struct, dict):
                missing = sorted(set(struct) - set(inputs))
                if missing:
                    raise ValueError(f"Missing inputs {missing}; the model takes "
                                     f"{sorted(struct)}. Received keys: {sorted(inputs)}")
                return keras.tree.flatten({k: inputs[k] for k in struct})
            missing = [n for n in names if n not in inputs]
            if missing:
                raise ValueError(f"Missing inputs {missing}; the model takes {names}. "
                                 f"Received keys: {sorted(inputs)}")
            return [inputs[n] for n in names]
        flat = keras.tree.flatten(inputs)
        if len(flat) != len(self.input_keys):
            raise ValueError(f"The model takes {len(self.input_keys)} input(s) {names}; "
                             f"received {len(flat)}.")
        return flat

    def pack_outputs(self, flat: Sequence):
        struct = self.outputs_struct
        if isinstance(struct, (list, tuple)) and len(struct) == 1:
            return flat[0]
        return keras.tree.pack_sequence_as(struct, list(flat))

    def run(self, inputs, *, training=None, on_node: Callable | None = None):
        """Runs the whole graph (no placement): for checks, costs and traces."""
        values = dict(zip(self.input_keys, self.flat_inputs(inputs)))
        for node in self.nodes:
            if on_node is None:
                node.call(values, training)
            else:
                on_node(node, lambda n=node: n.call(values, training))
        return self.pack_outputs([values[k] for k in self.output_keys])


def _spec(kt) -> tuple:
    return (tuple(kt.shape), str(kt.dtype))


def _call_inputs(sub, node: keras_graph.GraphNode) -> list:
    """The KerasTensors a nested model call feeds to the sub-model's inputs, in order."""
    extra = sorted(k for k in node.kwargs if k not in ("training", "mask"))
    masks = [m for m in keras.tree.flatten(node.kwargs.get("mask")) if m is not None]
    if not node.args or extra or masks:
        raise ValueError(
            f"Nested model {sub.name!r} is called with arguments tfdist cannot map onto its "
            f"inputs (keyword arguments {extra or list(node.kwargs)}). Call it as "
            f"{sub.name}(inputs) or {sub.name}(inputs, training=...).")
    given = node.args[0]
    struct = keras_graph.inputs_struct(sub)
    if isinstance(given, dict) and not isinstance(struct, dict):
        names = [kt.name for kt in sub.inputs]
        if set(names) <= set(given):
            return [given[n] for n in names]
    if isinstance(given, dict) and isinstance(struct, dict):
        if set(given) != set(struct):
            raise ValueError(
                f"Nested model {sub.name!r} takes inputs {sorted(struct)} but is called with "
                f"{sorted(given)}.")
        return keras.tree.flatten({k: given[k] for k in struct})
    flat = keras.tree.flatten(given)
    if len(flat) != len(sub.inputs):
        raise ValueError(f"Nested model {sub.name!r} takes {len(sub.inputs)} inputs but is "
                         f"called with {len(flat)}.")
    return flat


class _Flattener:
    def __init__(self):
        self.nodes: list[Node] = []
        self.layers: dict[str, Any] = {}
        self.name_of: dict[int, str] = {}  # id(layer) -> plan name
        self.scopes = 0

    def layer_name(self, layer, prefix: str) -> tuple[str, bool]:
        if id(layer) in self.name_of:
            return self.name_of[id(layer)], False
        name = layer.name if not prefix else f"{prefix}{layer.name}"
        base, i = name, 1
        while name in self.layers:  # two distinct layers with one name
            name, i = f"{base}_{i}", i + 1
        self.name_of[id(layer)] = name
        self.layers[name] = layer
        return name, True

    def inline(self, functional, in_keys: list, scope: tuple, prefix: str,
               training: bool | None) -> list:
        alias = {(scope, id(kt)): k for kt, k in zip(functional.inputs, in_keys)}

        def key(kt):
            own = (scope, id(kt))
            return alias.get(own, own)

        for gnode in keras_graph.graph_nodes(functional):
            op = gnode.operation
            if isinstance(op, keras.layers.InputLayer):
                continue
            sub = keras_graph.functional_of(op) if isinstance(op, keras.Model) else None
            if isinstance(op, keras.Sequential) and sub is None:
                raise ValueError(
                    f"Nested Sequential {op.name!r} was never built with an input shape, so "
                    "its graph is unknown. Give it keras.Input(shape=...) as its first layer.")
            if sub is not None:
                inner_training = gnode.kwargs.get("training", training)
                feeds = [key(kt) for kt in _call_inputs(sub, gnode)]
                self.scopes += 1
                outs = self.inline(sub, feeds, scope + (self.scopes,),
                                   f"{prefix}{op.name}/", inner_training)
                for kt, k in zip(gnode.outputs, outs):
                    alias[(scope, id(kt))] = k
                continue
            if isinstance(op, keras.layers.Layer):
                name, first = self.layer_name(op, prefix)
            else:
                name, first = None, False
            # None stays None whether a Keras version treats it as a leaf (3.11+: the
            # default) or as an empty structure (3.10 has no `none_is_leaf`).
            template = lambda s: keras.tree.map_structure(  # noqa: E731
                lambda x: _Ref(key(x)) if isinstance(x, keras.KerasTensor) else x, s)
            fixed = gnode.kwargs.get("training") if isinstance(
                gnode.kwargs.get("training"), bool) else training
            self.nodes.append(Node(
                index=len(self.nodes), operation=op, layer=name, first_call=first,
                args=template(gnode.args), kwargs=template(gnode.kwargs),
                input_keys=tuple(key(kt) for kt in gnode.inputs),
                output_keys=tuple((scope, id(kt)) for kt in gnode.outputs),
                output_specs=tuple(_spec(kt) for kt in gnode.outputs),
                training=fixed))
        return [key(kt) for kt in functional.outputs]


def flatten(model, *, input_shape: Sequence[int] | None = None) -> LayerGraph:
    """Reads a built model as a flat list of calls (see the module docstring).

    Args:
      model: a Sequential, Functional or (chain-like) subclassed keras.Model.
      input_shape: for a subclassed model never called symbolically, its input
        shape without the batch dimension.

    Raises:
      ValueError: not a keras.Model, not built, or a subclassed model whose
        layers in order do not reproduce its call().
    """
    if not isinstance(model, keras.Model):
        raise ValueError(
            "split_model needs a keras.Model (Sequential, Functional or a subclassed model "
            f"whose call() chains its layers). Received: {type(model).__name__} {model!r:.80}")
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built, so its weights do not exist yet. Build it "
            "first (call it on a batch, or give keras.Input / model.build(input_shape)).")
    functional = keras_graph.functional_of(model)
    flattener = _Flattener()
    if functional is not None:
        scope = ()
        in_keys = [(scope, id(kt)) for kt in functional.inputs]
        out_keys = flattener.inline(functional, in_keys, scope, "", None)
        inputs = functional.inputs
        struct_in = keras_graph.inputs_struct(functional)
        struct_out = keras_graph.outputs_struct(functional)
    else:
        shape, dtype = _chain_input_spec(model, input_shape)
        x = keras.Input(shape=shape, dtype=dtype)
        inputs = [x]
        key = ((), id(x))
        in_keys, prev = [key], key
        layers = [l for l in model.layers if not isinstance(l, keras.layers.InputLayer)]
        y = x
        for layer in layers:
            y = layer(y)
            out_key = ((), id(y))
            name, first = flattener.layer_name(layer, "")
            flattener.nodes.append(Node(
                index=len(flattener.nodes), operation=layer, layer=name, first_call=first,
                args=(_Ref(prev),), kwargs={}, input_keys=(prev,), output_keys=(out_key,),
                output_specs=(_spec(y),)))
            prev = out_key
        out_keys = [prev]
        struct_in, struct_out = [x], [y]
    graph = LayerGraph(
        model=model, nodes=flattener.nodes, layers=flattener.layers,
        input_keys=tuple(in_keys), output_keys=tuple(out_keys),
        input_specs=tuple((kt.name, tuple(kt.shape), str(kt.dtype)) for kt in inputs),
        inputs_struct=struct_in, outputs_struct=struct_out)
    if functional is None:
        _check_chain_matches(model, graph)
    return graph


def _chain_input_spec(model, input_shape):
    if input_shape is not None:
        return tuple(input_shape), "float32"
    first = next((l for l in model.layers if not isinstance(l, keras.layers.InputLayer)), None)
    if first is None:
        raise ValueError(f"Model {model.name!r} has no layers to split.")
    try:
        kt = first.input
        return tuple(kt.shape[1:]), kt.dtype
    except (AttributeError, ValueError):
        raise ValueError(
            f"Cannot tell the input shape of subclassed model {model.name!r}. Pass "
            "input_shape=(features...) (without the batch dimension) to split_model."
        ) from None


def _check_chain_matches(model, graph: LayerGraph) -> None:
    shape = graph.input_specs[0][1][1:]
    rng = np.random.default_rng(0)
    sample = rng.standard_normal((2,) + tuple(d or 3 for d in shape)).astype("float32")
    try:
        want = np.asarray(model(sample, training=False))
        got = np.asarray(graph.run(sample, training=False))
        same = want.shape == got.shape and np.allclose(want, got, atol=1e-5, rtol=1e-5)
    except Exception as e:  # noqa: BLE001 - a layer that cannot take the previous one's output
        raise ValueError(
            f"Subclassed model {model.name!r} cannot be split: its layers, applied in "
            f"model.layers order, fail ({type(e).__name__}: {e}). Only subclassed models "
            "whose call() is a chain of its layers can be traced; rewrite it as a "
            "Functional model to split it."
        ) from None
    if not same:
        raise ValueError(
            f"Subclassed model {model.name!r} cannot be split: applying its layers "
            f"{list(graph.layers)} one after another does not compute what its call() "
            "computes (it has branches, skips or extra ops). Rewrite it as a Functional "
            "model, whose graph tfdist can cut anywhere."
        )


# --- stages -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Stage:
    """One pipeline stage: consecutive calls on one device.

    Attributes:
      index: stage number.
      device: its device (replica 0).
      layer_names: layers whose variables live here (their first call is here).
      nodes: the calls it runs, in order.
      input_keys: values it reads from earlier stages or the model inputs.
      output_keys: values it produces for later stages or the model outputs.
    """

    index: int
    device: str
    layer_names: tuple[str, ...]
    nodes: list
    input_keys: tuple
    output_keys: tuple

    def run(self, values: dict, training=None) -> None:
        for node in self.nodes:
            node.call(values, training)


@dataclasses.dataclass
class Cut:
    """The tensors crossing the boundary after stage `after`."""

    after: int
    tensors: tuple[tuple[str, tuple, str], ...]  # (producer name, shape, dtype)

    def bytes_per_sample(self, *, sequence_length: int | None = None) -> int | None:
        """Bytes of one example's tensors crossing the cut.

        Dimensions unknown until run time (a text model's sequence length) take
        `sequence_length`; without it such a cut returns None (see `formula`).
        """
        total = 0
        for _, shape, dtype in self.tensors:
            dims = list(shape[1:])
            if any(d is None for d in dims):
                if sequence_length is None:
                    return None
                dims = [sequence_length if d is None else d for d in dims]
            total += int(math.prod(dims)) * np.dtype(dtype).itemsize
        return total

    def formula(self) -> str:
        """Bytes per example with unknown dimensions written as L: e.g. '256*L + 4'."""
        terms: dict[int, int] = {}
        for _, shape, dtype in self.tensors:
            dims = list(shape[1:])
            power = sum(d is None for d in dims)
            known = int(math.prod([d for d in dims if d is not None]))
            terms[power] = terms.get(power, 0) + known * np.dtype(dtype).itemsize
        parts = []
        for power in sorted(terms, reverse=True):
            coef = terms[power]
            var = "" if power == 0 else "*L" if power == 1 else f"*L^{power}"
            parts.append(f"{coef}{var}")
        return " + ".join(parts) if parts else "0"


def assign_stages(graph: LayerGraph, plan: plan_lib.SplitPlan) -> dict[int, int]:
    """Stage of each node: a layer's first call goes to its planned stage; other
    calls (a shared layer's later calls, keras ops) to the latest stage among
    the producers of their inputs.

    Raises:
      ValueError: a plan whose order runs against the graph (names the layers).
    """
    stage_of_layer: dict[str, int] = {}
    for s, (_, names) in enumerate(plan.stages):
        for n in names:
            stage_of_layer[n] = s
    producer: dict[Key, tuple[int, str]] = {k: (0, "input") for k in graph.input_keys}
    stage_of: dict[int, int] = {}
    for node in graph.nodes:
        feeds = [producer[k] for k in node.input_keys if k in producer]
        latest = max((s for s, _ in feeds), default=0)
        if node.first_call:
            s = stage_of_layer[node.layer]
            late = [(ps, pn) for ps, pn in feeds if ps > s]
            if late:
                ps, pn = late[0]
                raise ValueError(
                    f"The model cannot be cut as planned: layer {node.layer!r} (stage {s}) "
                    f"needs the output of {pn!r}, which the plan puts in a later stage "
                    f"({ps}). Keep layers in model order.")
        else:
            s = latest
        stage_of[node.index] = s
        for k in node.output_keys:
            producer[k] = (s, node.name)
    return stage_of


def cut_into_stages(graph: LayerGraph, plan: plan_lib.SplitPlan) -> tuple[list[Stage], list[Cut]]:
    """Cuts the flattened graph into the plan's stages."""
    stage_of = assign_stages(graph, plan)
    producer: dict[Key, tuple[int, str]] = {
        k: (-1, f"input {name}") for k, (name, _, _) in zip(graph.input_keys, graph.input_specs)}
    specs: dict[Key, tuple] = {k: (shape, dtype) for k, (_, shape, dtype)
                               in zip(graph.input_keys, graph.input_specs)}
    consumers: dict[Key, set[int]] = {}
    for node in graph.nodes:
        s = stage_of[node.index]
        for k, spec in zip(node.output_keys, node.output_specs):
            producer[k] = (s, node.name)
            specs[k] = spec
        for k in node.input_keys:
            consumers.setdefault(k, set()).add(s)
    final = set(graph.output_keys)
    stages: list[Stage] = []
    for s, (device, names) in enumerate(plan.stages):
        nodes = [n for n in graph.nodes if stage_of[n.index] == s]
        needed: list[Key] = []
        produced: list[Key] = []
        for n in nodes:
            for k in n.input_keys:
                if producer[k][0] != s and k not in needed:
                    needed.append(k)
            for k in n.output_keys:
                later = any(c > s for c in consumers.get(k, ()))
                if (later or k in final) and k not in produced:
                    produced.append(k)
        if not produced and s < plan.num_stages - 1:
            raise ValueError(
                f"Stage {s} ({', '.join(names)}) produces nothing later stages or the "
                "model's outputs use; the plan cannot cut the model there.")
        stages.append(Stage(index=s, device=device, layer_names=tuple(names), nodes=nodes,
                            input_keys=tuple(needed), output_keys=tuple(produced)))
    cuts = []
    for b in range(plan.num_stages - 1):
        crossing = [k for k, (p, _) in producer.items()
                    if p <= b and any(c > b for c in consumers.get(k, ()))]
        crossing += [k for k in final if producer[k][0] <= b and k not in crossing]
        cuts.append(Cut(after=b, tensors=tuple(
            (producer[k][1], specs[k][0], specs[k][1]) for k in crossing)))
    return stages, cuts
