"""A model's layer graph, rebuilt with every layer placed on its planned device.

Sequential and Functional models are rebuilt as a Functional graph of fresh
layers (same configs, same weights) whose variables are created under
`tf.device(planned device)`; the original model is not touched. Subclassed
models are accepted when their layers, applied one after another in
`model.layers` order, compute what the model computes (checked numerically).

The rebuilt graph is then cut into stages (maximal runs of layers on one
device) with public Keras API only: each stage is `keras.Model(inputs=<the
tensors entering the stage>, outputs=<the tensors leaving it>)` over the
shared layers. Tensors that skip a stage (residual connections crossing a
cut) are carried past it by the pipeline.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tfdist._tf import import_tensorflow
from tfdist.split import plan as plan_lib
from tfdist.split.tensor_parallel import ShardedDense, shard_attention

import_tensorflow()  # quietly, before keras imports TensorFlow itself

import keras  # noqa: E402


def source_layers(model) -> list:
    """The layers a plan names: model.layers without InputLayers."""
    return [l for l in model.layers if not isinstance(l, keras.layers.InputLayer)]


def layer_names(model) -> list[str]:
    return [l.name for l in source_layers(model)]


def _is_functional(model) -> bool:
    # keras.Model(inputs, outputs) returns a (non-exported) Functional instance.
    return not isinstance(model, keras.Sequential) and any(
        c.__name__ == "Functional" for c in type(model).__mro__)


def _clone_layer(layer, plan: plan_lib.Plan):
    tp = plan.tensor_parallel_of(layer.name)
    if tp is not None and not isinstance(layer, keras.layers.MultiHeadAttention):
        return ShardedDense.from_dense(layer, mode=tp.mode, devices=tp.devices,
                                       output_device=plan.device_of(layer.name))
    return layer.__class__.from_config(layer.get_config())


def _input_spec_for_chain(model, input_shape):
    if input_shape is not None:
        return tuple(input_shape), "float32"
    inputs = getattr(model, "inputs", None)
    if inputs:
        return tuple(inputs[0].shape[1:]), inputs[0].dtype
    first = source_layers(model)[0]
    try:
        kt = first.input
        return tuple(kt.shape[1:]), kt.dtype
    except (AttributeError, ValueError):
        raise ValueError(
            f"Cannot tell the input shape of subclassed model {model.name!r}. Pass "
            "input_shape=(features...) (without the batch dimension) to split_model."
        ) from None


def placed_functional(model, plan: plan_lib.Plan, *, input_shape=None):
    """A Functional model of fresh layers, each built on its planned device.

    Returns:
      (functional_model, {layer name: new layer}).
    """
    tf = import_tensorflow()
    originals = source_layers(model)
    plan_lib.validate_against(plan, [l.name for l in originals])
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built, so its weights do not exist yet. Build it "
            "first (call it on a batch, or give keras.Input / model.build(input_shape))."
        )

    planned = dict(plan.assignments)

    def call_placed(layer, *args, **kwargs):
        if layer.name not in planned:  # a weightless graph op (x + y): placed at run time
            return layer(*args, **kwargs)
        with tf.device(planned[layer.name]):
            return layer(*args, **kwargs)

    if _is_functional(model):
        functional = keras.models.clone_model(
            model, clone_function=lambda l: _clone_layer(l, plan), call_function=call_placed)
    else:
        shape, dtype = _input_spec_for_chain(model, input_shape)
        x = inputs = keras.Input(shape=shape, dtype=dtype)
        for layer in originals:
            x = call_placed(_clone_layer(layer, plan), x)
        functional = keras.Model(inputs, x, name=f"{model.name}_chain")
    new = {l.name: l for l in source_layers(functional)}
    for layer in originals:
        new[layer.name].set_weights(layer.get_weights())
    for name, tp in plan.tensor_parallel:
        if isinstance(new[name], keras.layers.MultiHeadAttention):
            if tp.mode != "column":
                raise ValueError(
                    f"MultiHeadAttention {name!r} is split by heads: give mode 'column' "
                    "(query/key/value column-parallel, output projection row-parallel). "
                    f"Received: mode={tp.mode!r}")
            shard_attention(new[name], devices=tp.devices, output_device=plan.device_of(name))
    if not _is_functional(model) and not isinstance(model, keras.Sequential):
        _check_chain_matches(model, functional)
    return functional, new


def _check_chain_matches(model, functional) -> None:
    shape = functional.inputs[0].shape[1:]
    rng = np.random.default_rng(0)
    sample = rng.standard_normal((2,) + tuple(shape)).astype("float32")
    try:
        want = np.asarray(model(sample, training=False))
        got = np.asarray(functional(sample, training=False))
        same = want.shape == got.shape and np.allclose(want, got, atol=1e-5, rtol=1e-5)
    except Exception as e:  # a layer that cannot take the previous one's output
        raise ValueError(
            f"Subclassed model {model.name!r} cannot be split: its layers, applied in "
            f"model.layers order, fail ({type(e).__name__}: {e}). Only subclassed models "
            "whose call() is a chain of its layers can be traced; rewrite it as a "
            "Functional model to split it."
        ) from None
    if not same:
        raise ValueError(
            f"Subclassed model {model.name!r} cannot be split: applying its layers "
            f"{[l.name for l in source_layers(model)]} one after another does not compute "
            "what its call() computes (it has branches, skips or extra ops). Rewrite it as "
            "a Functional model, whose graph tfdist can cut anywhere."
        )


@dataclasses.dataclass
class Stage:
    """One pipeline stage: a sub-model over some consecutive layers on one device."""

    index: int
    device: str
    layer_names: tuple[str, ...]
    model: object  # keras.Model
    input_ids: tuple[int, ...]   # ids of the KerasTensors it consumes
    output_ids: tuple[int, ...]  # ids of the KerasTensors it produces for later use


@dataclasses.dataclass
class Cut:
    """The tensors crossing the boundary after stage `after`."""

    after: int
    tensors: tuple[tuple[str, tuple, str], ...]  # (producer layer name, shape, dtype)

    def bytes_per_sample(self) -> int:
        total = 0
        for _, shape, dtype in self.tensors:
            total += int(np.prod([d for d in shape[1:]] or [1])) * np.dtype(dtype).itemsize
        return total


def _single_node(layer, attr):
    try:
        return keras.tree.flatten(getattr(layer, attr))
    except (AttributeError, ValueError) as e:
        raise ValueError(
            f"Layer {layer.name!r} is called more than once in the model ({e}). Splitting "
            "needs each layer called once; give each call its own layer."
        ) from None


def _graph_operations(functional) -> list:
    """Layers and weightless ops (keras.ops calls such as `x + y`) in topological order."""
    ops = getattr(functional, "operations", None)
    if ops is None:
        return source_layers(functional)
    return [op for op in ops if not isinstance(op, keras.layers.InputLayer)]


def cut_into_stages(functional, plan: plan_lib.Plan) -> tuple[list[Stage], list[Cut]]:
    """Cuts the placed Functional graph into the plan's stages.

    Graph ops that are not layers (`x + y` on Keras tensors) run in the
    stage of the layer before them.
    """
    layers = _graph_operations(functional)
    stage_of_layer: dict[str, int] = {}
    for s, (_, names) in enumerate(plan.stages):
        for n in names:
            stage_of_layer[n] = s
    current = 0
    for layer in layers:
        if layer.name in stage_of_layer:
            current = stage_of_layer[layer.name]
        else:
            stage_of_layer[layer.name] = current
    stage_names: list[list[str]] = [[] for _ in plan.stages]
    for layer in layers:
        stage_names[stage_of_layer[layer.name]].append(layer.name)
    producer: dict[int, tuple[int, str]] = {id(t): (-1, "input") for t in functional.inputs}
    tensors: dict[int, object] = {id(t): t for t in functional.inputs}
    consumers: dict[int, set[int]] = {}
    ins_of: dict[str, list] = {}
    outs_of: dict[str, list] = {}
    for layer in layers:
        ins_of[layer.name] = _single_node(layer, "input")
        outs_of[layer.name] = _single_node(layer, "output")
        for t in outs_of[layer.name]:
            producer[id(t)] = (stage_of_layer[layer.name], layer.name)
            tensors[id(t)] = t
    for layer in layers:
        s = stage_of_layer[layer.name]
        for t in ins_of[layer.name]:
            if id(t) not in producer:
                raise ValueError(f"Layer {layer.name!r} consumes a tensor no layer produces.")
            if producer[id(t)][0] > s:
                raise ValueError(
                    f"The model cannot be cut as planned: layer {layer.name!r} (stage {s}) "
                    f"needs the output of {producer[id(t)][1]!r}, which the plan puts in a "
                    f"later stage ({producer[id(t)][0]}). Keep layers in model order."
                )
            consumers.setdefault(id(t), set()).add(s)
    final = {id(t) for t in functional.outputs}
    num_stages = plan.num_stages
    stages: list[Stage] = []
    for s, (device, _) in enumerate(plan.stages):
        names = stage_names[s]
        needed: list[int] = []
        produced: list[int] = []
        for n in names:
            for t in ins_of[n]:
                if producer[id(t)][0] != s and id(t) not in needed:
                    needed.append(id(t))
            for t in outs_of[n]:
                later = any(c > s for c in consumers.get(id(t), ()))
                if (later or id(t) in final) and id(t) not in produced:
                    produced.append(id(t))
        if not produced:
            raise ValueError(
                f"Stage {s} ({', '.join(names)}) produces nothing later stages or the "
                "model's outputs use; the plan cannot cut the model there."
            )
        sub = keras.Model([tensors[i] for i in needed], [tensors[i] for i in produced],
                          name=f"stage_{s}")
        stages.append(Stage(index=s, device=device, layer_names=tuple(names), model=sub,
                            input_ids=tuple(needed), output_ids=tuple(produced)))
    cuts = []
    for b in range(num_stages - 1):
        crossing = [i for i, (p, _) in producer.items()
                    if p <= b and any(c > b for c in consumers.get(i, ()))]
        cuts.append(Cut(after=b, tensors=tuple(
            (producer[i][1], tuple(tensors[i].shape), str(tensors[i].dtype)) for i in crossing)))
    return stages, cuts
