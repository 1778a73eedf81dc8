"""Each gradient bucket's own gradients first, then the rest of the backward pass.

Upstream: tensorflow/tensorflow#33274 ("overlap backward and optimization"):
TensorFlow has no per-bucket hook into the backward pass. tfdist's buckets
(`tfdist.comm.sync`) are separate collectives whose only inputs are their own
gradients, so TensorFlow's executor can start one while the backward pass
still runs. But a layer's backward pass makes two independent kinds of op from
the gradient of its output: the gradients of its weights (what the bucket
needs) and the gradient of its input (what the layers below need). The
executor runs whichever it reaches, and on a busy worker the weight gradients
finish late, interleaved with the layers below: on a worker pinned to one
core (docs/performance.md, "Buckets cut at layer boundaries"), the second
bucket of the conv model launched only 21-36 ms into a 44-51 ms backward pass.

`prioritise` adds control dependencies inside the traced train function: every
other backward op that reads what a bucket's gradient ops read (the layer's
input-gradient op, e.g. `Conv2DBackpropInput` beside `Conv2DBackpropFilter`)
waits for those gradient ops. A layer's weight gradients then come out before
the backward pass moves on, as in PyTorch's autograd, where one node computes
a layer's weight and input gradients together. Values are unchanged: only the
order of independent ops is constrained.

Private touch points, checked by `supported()` and by
tests/compat/test_backward_priority.py's canary:
- `tf.Operation._add_control_input` (TensorFlow's own auto control
  dependencies use it on function graphs before they are finalised);
- backward ops are named under `gradient_tape/` (`_gradient_function` in
  tensorflow/python/eager/backprop.py); the tape's sums of several gradients
  of one tensor (`AddN`) are not, and are only walked through, never delayed.

It only edits the graph tfdist's own `CommSync` is tracing, for strategies
tfdist made with `bucket_bytes` and `bucket_priority=True` (the default); with
`bucket_priority=False` nothing is edited. A control dependency that would
close a cycle is never added, so the graph stays executable whatever the
model.
"""

from __future__ import annotations

import logging
from typing import Iterable

TAPE_SCOPE = "gradient_tape/"
# How far back from a bucket's tensors to look for the backward ops that made
# them (Keras's scaling of the gradients, casts, identities in between).
_MAX_HOPS = 8
_WARNED = False


def supported() -> bool:
    """Whether this TensorFlow has the private method the edits need."""
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    return callable(getattr(tf.Operation, "_add_control_input", None))


def _backward(op) -> bool:
    return TAPE_SCOPE in op.name


def producers(tensors: Iterable) -> list:
    """The backward ops (named under gradient_tape/) nearest to `tensors`, walking back
    through at most _MAX_HOPS other ops (casts, Keras's scaling); [] in eager mode."""
    found: dict = {}
    frontier = [t.op for t in tensors if getattr(t, "graph", None) is not None
                and hasattr(t, "op")]
    seen: set = set()
    for _ in range(_MAX_HOPS):
        following = []
        for op in frontier:
            if op in seen:
                continue
            seen.add(op)
            if _backward(op):
                found[op] = None
            else:
                following.extend(t.op for t in op.inputs)
        frontier = following
    return list(found)


def _ancestors(op, first_id: int) -> set:
    """`op`'s ancestors through data and control edges, among ops made at or after
    `first_id` (every op on a path out of a backward op is: see `prioritise`)."""
    seen: set = set()
    stack = [op]
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen and parent._id >= first_id:  # pylint: disable=protected-access
                seen.add(parent)
                stack.append(parent)
    return seen


def _own_ops(producer) -> set:
    """`producer` and the backward ops that feed only it (e.g. the einsum whose output a
    Reshape turns into a weight gradient, or the Sum of a bias gradient): the ops that
    compute this gradient and nothing else."""
    own = {producer}
    stack = [producer]
    while stack:
        for tensor in stack.pop().inputs:
            op = tensor.op
            if op in own or not _backward(op):
                continue
            if all(reader in own for out in op.outputs for reader in out.consumers()):
                own.add(op)
                stack.append(op)
    return own


def prioritise(buckets: list[list]) -> int:
    """Makes each bucket's gradient ops run before their siblings in the backward pass.

    A sibling is a backward op that reads a tensor the gradient's own ops
    (`_own_ops`) read, and is not one of them: the layer's input gradient,
    which the layers below wait for. It gets a control input on the bucket's
    gradient ops, unless it is one of their ancestors (a cycle).

    Args:
      buckets: per bucket, in sending order, the gradient tensors it sends (graph
        tensors of the function being traced; eager tensors are left alone).

    Returns:
      The number of control dependencies added.
    """
    if not supported():
        global _WARNED
        if not _WARNED:
            _WARNED = True
            logging.getLogger("tfdist").warning(
                "bucket_priority: this TensorFlow has no tf.Operation._add_control_input, so "
                "the backward pass keeps TensorFlow's own order (the buckets still work). "
                "Pass bucket_priority=False to silence this.")
        return 0
    added = 0
    first_id = None
    for tensors in buckets:
        made = producers(tensors)
        if not made:
            continue
        if first_id is None:
            # Every op on a path out of a backward op was made after that op, or is a
            # backward op given a control input below: neither is older than the
            # oldest backward op, so the cycle check need not look further back.
            first_id = min(op._id for op in made[0].graph.get_operations()  # pylint: disable=protected-access
                           if _backward(op))
        chains = {producer: _own_ops(producer) for producer in made}
        own = set().union(*chains.values())
        for producer, chain in chains.items():
            above = _ancestors(producer, first_id)
            read = {t.ref(): t for op in chain for t in op.inputs
                    if t.op not in chain and _backward(t.op)}
            for tensor in read.values():
                for sibling in tensor.consumers():
                    if (sibling in own or sibling in above or not _backward(sibling)
                            or producer in sibling.control_inputs):
                        continue
                    sibling._add_control_input(producer)  # pylint: disable=protected-access
                    added += 1
    return added
