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
- `tf.Operation._add_control_input`, `_add_control_inputs` and
  `_remove_all_control_inputs` (TensorFlow's own auto control dependencies
  use them on function graphs before they are finalised);
- backward ops are named under `gradient_tape/` (`_gradient_function` in
  tensorflow/python/eager/backprop.py); the tape's sums of several gradients
  of one tensor (`AddN`) are not, and are only walked through, never delayed.

It only edits the graph tfdist's own `CommSync` is tracing, for strategies
tfdist made with `bucket_bytes` and `bucket_priority=True` (the default); with
`bucket_priority=False` nothing is edited. A control dependency that would
close a cycle is never added (an ancestor walk per gradient op, then a
topological sort of the whole graph as a last check, which takes the call's
edits back out), so the graph stays executable whatever the model.
"""

from __future__ import annotations

import logging
from typing import Iterable

TAPE_SCOPE = "gradient_tape/"
# How far back from a bucket's tensors to look for the backward ops that made
# them (Keras's scaling of the gradients, casts, identities in between).
_MAX_HOPS = 8
_WARNED = False
# The tf.Operation methods the edits use (TensorFlow's own auto control dependencies do).
_PRIVATE = ("_add_control_input", "_add_control_inputs", "_remove_all_control_inputs")


def supported() -> bool:
    """Whether this TensorFlow has the private methods the edits need."""
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    return all(callable(getattr(tf.Operation, name, None)) for name in _PRIVATE)


def _backward(op) -> bool:
    return TAPE_SCOPE in op.name


def producers(tensors: Iterable) -> list:
    """The backward ops (named under gradient_tape/) nearest to each of `tensors`: walking
    back through other ops (Keras's scaling, casts, the tape's AddN of a shared weight's
    gradients) at most _MAX_HOPS deep, and no deeper than the first level that has one, so
    a gradient scaled by something computed from every gradient (a global norm a custom
    train_step clips by) still names only its own; [] in eager mode."""
    found: dict = {}
    for tensor in tensors:
        if getattr(tensor, "graph", None) is None or not hasattr(tensor, "op"):
            continue
        level, seen = [tensor.op], set()
        for _ in range(_MAX_HOPS):
            seen.update(level)
            backward = [op for op in level if _backward(op)]
            if backward:
                found.update(dict.fromkeys(backward))
                break
            level = [t.op for op in level for t in op.inputs if t.op not in seen]
            if not level:
                break
    return list(found)


class _Ancestry:
    """Who is an ancestor of whom among the ops made at or after `first_id`, through data
    and control edges, as control inputs are added (`add`).

    Each op's ancestors are a bitset (a Python int) over those ops, computed once in a
    topological order; an added edge p -> e is applied when a query reaches e. Ops older
    than `first_id` are left out: `prioritise` picks it so that no path out of a sibling
    passes one.
    """

    def __init__(self, graph, first_id: int):
        ops = [op for op in graph.get_operations()
               if op._id >= first_id]  # pylint: disable=protected-access
        self._bit = {op: 1 << i for i, op in enumerate(ops)}
        parents = {op: [p for p in _parents(op) if p in self._bit] for op in ops}
        self._static: dict = {}
        for op in _topological(parents):
            above = 0
            for parent in parents[op]:
                above |= self._static[parent] | self._bit[parent]
            self._static[op] = above
        self._added: list = []  # (producer, sibling)

    def above(self, op) -> int:
        """The bitset of `op`'s ancestors, the added edges included."""
        found = self._static.get(op, 0)
        pending = list(self._added)
        while pending:
            left = []
            for producer, sibling in pending:
                if sibling is op or found & self._bit[sibling]:
                    found |= self._bit[producer] | self._static.get(producer, 0)
                else:
                    left.append((producer, sibling))
            if len(left) == len(pending):
                break
            pending = left
        return found

    def among(self, candidate, above: int) -> bool:
        """Whether `candidate` is in the bitset `above` (from `above()`)."""
        return bool(above & self._bit.get(candidate, 0))

    def add(self, producer, sibling) -> None:
        self._added.append((producer, sibling))


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


def _parents(op) -> list:
    """The ops `op` reads (data edges) and waits for (control edges)."""
    return [t.op for t in op.inputs] + list(op.control_inputs)


def _topological(parents: dict) -> list:
    """The ops (keys of `parents`: {op: its parents among them}) in an order where each
    comes after its parents (Kahn's algorithm); shorter than `parents` if they have a
    cycle."""
    readers: dict = {}
    for op, ps in parents.items():
        for parent in ps:
            readers.setdefault(parent, []).append(op)
    waiting = {op: len(ps) for op, ps in parents.items()}
    ready = [op for op, n in waiting.items() if n == 0]
    order = []
    while ready:
        op = ready.pop()
        order.append(op)
        for reader in readers.get(op, ()):
            waiting[reader] -= 1
            if waiting[reader] == 0:
                ready.append(reader)
    return order


def _acyclic(graph) -> bool:
    """Whether `graph`'s ops, through data and control edges, have a topological order."""
    parents = {op: _parents(op) for op in graph.get_operations()}
    return len(_topological(parents)) == len(parents)


def _warn(message: str) -> None:
    global _WARNED
    if not _WARNED:
        _WARNED = True
        logging.getLogger("tfdist").warning("bucket_priority: %s", message)


def prioritise(buckets: list[list]) -> int:
    """Makes each bucket's gradient ops run before their siblings in the backward pass.

    A sibling is a backward op that reads a tensor the gradient's own ops
    (`_own_ops`) read, and is not one of them: the layer's input gradient,
    which the layers below wait for. It gets a control input on the bucket's
    gradient ops, unless it is one of their ancestors (a cycle). The whole
    graph is then checked for a cycle once more; if there is one, this call's
    control inputs are taken back out and TensorFlow's order stays.

    Args:
      buckets: per bucket, in sending order, the gradient tensors it sends (graph
        tensors of the function being traced; eager tensors are left alone).

    Returns:
      The number of control dependencies added (0 when they were taken back).
    """
    if not supported():
        _warn("this TensorFlow lacks tf.Operation._add_control_input (or its siblings), so "
              "the backward pass keeps TensorFlow's own order (the buckets still work). Pass "
              "bucket_priority=False to silence this.")
        return 0
    made_by_bucket = [producers(tensors) for tensors in buckets]
    made_all = [op for made in made_by_bucket for op in made]
    if not made_all:
        return 0
    graph = made_all[0].graph
    # The oldest op of the tapes these gradients come from (each replica's tape has its own
    # name prefix): every op on a path out of one of their backward ops is newer, or is a
    # backward op of theirs given a control input here, so the ancestor walks below need
    # not look further back than it, or than the sibling they guard.
    tapes = tuple({op.name.split(TAPE_SCOPE, 1)[0] + TAPE_SCOPE for op in made_all})
    first_id = min(op._id for op in graph.get_operations()  # pylint: disable=protected-access
                   if op.name.startswith(tapes))
    plans = []
    for made in made_by_bucket:
        chains = {producer: _own_ops(producer) for producer in made}
        own = set().union(*chains.values())
        for producer, chain in chains.items():
            read = {t.ref(): t for op in chain for t in op.inputs
                    if t.op not in chain and _backward(t.op)}
            siblings = list(dict.fromkeys(
                sibling for tensor in read.values() for sibling in tensor.consumers()
                if sibling not in own and _backward(sibling)
                and producer not in sibling.control_inputs))
            if siblings:
                plans.append((producer, siblings))
    if not plans:
        return 0
    ancestry = _Ancestry(graph, min([first_id] + [s._id for _, siblings in plans  # pylint: disable=protected-access
                                                  for s in siblings]))
    originals: dict = {}
    added = 0
    for producer, siblings in plans:
        above = ancestry.above(producer)
        for sibling in siblings:
            if ancestry.among(sibling, above):
                continue
            originals.setdefault(sibling, list(sibling.control_inputs))
            sibling._add_control_input(producer)  # pylint: disable=protected-access
            ancestry.add(producer, sibling)
            added += 1
    if added and not _acyclic(graph):
        for sibling, inputs in originals.items():
            sibling._remove_all_control_inputs()  # pylint: disable=protected-access
            sibling._add_control_inputs(inputs)  # pylint: disable=protected-access
        _warn("ordering this model's backward pass for its buckets would close a cycle, so "
              "it keeps TensorFlow's own order (the buckets still work). Please report the "
              "model to tfdist.")
        return 0
    return added
