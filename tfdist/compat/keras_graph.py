"""Reading a Keras 3 Functional graph node by node, and moving a variable to a device.

tfdist.split runs a model's own layers stage by stage on several devices. For
that it needs what `Functional._run_through_graph` uses to execute a graph
(the nodes in topological order and each node's call arguments) and the one
step Keras uses to create a variable's TensorFlow storage
(`Variable._initialize`, keras/src/backend/tensorflow/core.py). Neither has a
public API; both are read here, behind small named functions, and checked for
the shape tfdist relies on so that a Keras version that changed them fails
with a clear message instead of a wrong split (tests/compat/test_placed_training.py).

Verified on the versions in `tfdist.compat.TESTED`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfdist._tf import import_tensorflow

import_tensorflow()  # quietly, before keras imports TensorFlow itself

import keras  # noqa: E402


class KerasInternalsChanged(RuntimeError):
    """This Keras version no longer has the private structure tfdist reads."""


def _require(obj: Any, attributes: tuple[str, ...], what: str) -> None:
    missing = [a for a in attributes if not hasattr(obj, a)]
    if missing:
        raise KerasInternalsChanged(
            f"{what} has no {', '.join(missing)} in Keras {keras.__version__}; "
            "tfdist.compat.keras_graph needs updating for this version "
            "(see tests/compat/test_placed_training.py).")


def is_functional(model: Any) -> bool:
    """True for a model built from `keras.Input`s (subclasses of it included)."""
    return not isinstance(model, keras.Sequential) and any(
        c.__name__ == "Functional" for c in type(model).__mro__)


def functional_of(model: Any):
    """The Functional graph a model runs, or None (subclassed, or an unbuilt Sequential).

    A Sequential with a known input shape runs a Functional it builds itself
    (`Sequential._functional`).
    """
    if is_functional(model):
        return model
    if isinstance(model, keras.Sequential):
        _require(model, ("_functional",), "keras.Sequential")
        return model._functional
    return None


@dataclasses.dataclass(frozen=True)
class GraphNode:
    """One call of an operation in a Functional graph.

    Attributes:
      operation: the layer (or keras op such as `x + y`) called.
      args, kwargs: the call's arguments; KerasTensors stand for the values.
      inputs: the KerasTensors among the arguments, in flattened order.
      outputs: the KerasTensors the call produced, flattened.
    """

    operation: Any
    args: tuple
    kwargs: dict
    inputs: tuple
    outputs: tuple


def graph_nodes(functional) -> list[GraphNode]:
    """The nodes of a Functional graph in execution order (as Keras runs them)."""
    _require(functional, ("_nodes_by_depth",), "Functional")
    nodes_by_depth = functional._nodes_by_depth
    out = []
    for depth in sorted(nodes_by_depth, reverse=True):
        for node in nodes_by_depth[depth]:
            _require(node, ("operation", "arguments", "outputs", "is_input"), "keras Node")
            if not node.operation or node.is_input:
                continue
            arguments = node.arguments
            _require(arguments, ("args", "kwargs", "keras_tensors"), "keras SymbolicArguments")
            out.append(GraphNode(operation=node.operation, args=tuple(arguments.args),
                                 kwargs=dict(arguments.kwargs),
                                 inputs=tuple(arguments.keras_tensors),
                                 outputs=tuple(node.outputs)))
    return out


def inputs_struct(functional):
    """The structure (tensor, list or dict of KerasTensors) the model was built on."""
    _require(functional, ("_inputs_struct",), "Functional")
    return functional._inputs_struct


def outputs_struct(functional):
    _require(functional, ("_outputs_struct",), "Functional")
    return functional._outputs_struct


def call_context_args(operation) -> frozenset:
    """The call-context arguments (e.g. `training`) a layer's call accepts."""
    return frozenset(getattr(operation, "_call_context_args", ()) or ())


def move_variable(variable, device: str, *, strategy=None) -> None:
    """Re-creates a Keras variable's TensorFlow storage on `device`, keeping its value.

    The Keras variable object stays the same (layers, optimizers and
    checkpoints keep referring to it); only the `tf.Variable` behind it is new,
    created the way Keras creates it (`Variable._initialize`). Under a
    `strategy`, the new storage is that strategy's (mirrored) variable.
    """
    tf = import_tensorflow()
    _require(variable, ("_initialize", "_value"), "keras Variable")
    old = variable._value
    if old is None:
        raise KerasInternalsChanged(f"Variable {variable.path} has no value to move")
    with tf.init_scope():
        value = old.read_value() if hasattr(old, "read_value") else tf.identity(old)
        # Under a strategy its scope decides the devices (one copy per replica).
        place = strategy.scope() if strategy is not None else tf.device(device)
        with place:
            variable._value = None
            variable._initialize(lambda: tf.identity(value))


def call_losses(layer) -> list:
    """Losses `add_loss` recorded during the last call of `layer` and its sub-layers."""
    _require(layer, ("_get_own_losses", "_flatten_layers"), "keras Layer")
    losses = list(layer._get_own_losses())
    for sub in layer._flatten_layers(include_self=False):
        losses.extend(sub._get_own_losses())
    return losses


def regularization_losses(layer) -> list:
    """The weight regularizers' penalties of `layer`'s trainable weights."""
    _require(layer, ("_get_regularization_losses",), "keras Layer")
    return list(layer._get_regularization_losses())
