"""Lookup tables in input pipelines under ParameterServerStrategy: per worker, inside tf.cond too.

Not yet reported upstream (tensorflow/tensorflow; Keras 3 has no
ParameterServerStrategy support at all, keras-team/keras#18624). Verified on
TF 2.21 / Keras 3.15, plain TensorFlow included.

A `tf.lookup.StaticHashTable` created under `ParameterServerStrategy.scope()`
becomes a `DistributedTable`: one copy per worker, created on each worker
(what TensorFlow's parameter_server_training tutorial relies on for its
StringLookup layers, and what KerasHub's guides get by building the
preprocessor under the scope). Inside a traced function its handle is a
*deferred capture* (`FuncGraph.capture_call_time_value`): a placeholder
that the ClusterCoordinator fills, per call, with the handle of the worker
running it. cond_v2 and while_v2 pass only a branch graph's ordinary
captures into the `If`/`While` op, so a lookup inside `tf.cond` or
`tf.while_loop` (KerasHub's byte-pair tokenizers for GPT-2, BART, RoBERTa:
the merge loop and the cache check) leaves its placeholder unfed:

    You must feed a value for placeholder tensor '.../cond/None_Lookup/Placeholder'
    with dtype resource

on the Dataset route and the dataset-function route alike.

The fixes place such a deferred capture on the nearest enclosing graph that
is not a control-flow branch (the dataset function or `tf.function`, whose
deferred captures TensorFlow does fill) and capture its placeholder into the
branch as an ordinary value:

* `table_handle`: `DistributedTable.resource_handle_call_time_value` marks
  the closure of a table made under a tfdist strategy (and of no other);
* `control_flow_capture`: `FuncGraph.capture_call_time_value` called on a
  control-flow branch graph with such a marked closure (directly, or as a
  nested function's deferred capture re-deferred into the branch) does the
  above; every other call runs TensorFlow's own code.
"""

from __future__ import annotations

from typing import Any, Callable

from tfdist.compat import _owner, _patch

UPSTREAM_ISSUE = "not yet reported to tensorflow/tensorflow (related: keras-team/keras#18624)"


class _WorkerTableHandle:
    """The call-time closure of a tfdist strategy's DistributedTable (a marked callable)."""

    def __init__(self, closure: Callable[[], Any]):
        self._closure = closure

    def __call__(self):
        return self._closure()


def _distributed_table_class():
    return _patch.upstream("tensorflow.python.distribute.ps_values.DistributedTable")


def _func_graph_class():
    return _patch.upstream("tensorflow.python.framework.func_graph.FuncGraph")


def _owned_table(table) -> bool:
    coordinator = getattr(table, "_coordinator", None)
    return _owner.owns(getattr(coordinator, "strategy", None))


def _check_table_handle(original) -> None:
    _patch.require_signature(original, what="tensorflow DistributedTable."
                             "resource_handle_call_time_value")
    _patch.require_attributes(_distributed_table_class(), "resource_handle",
                              "_maybe_build_distributed_table",
                              what="tensorflow DistributedTable")


def _make_table_handle(original):
    def applies(self):
        return _owned_table(self)

    @_patch.passthrough(original, applies)
    def resource_handle_call_time_value(self):
        closure, spec = original(self)
        return _WorkerTableHandle(closure), spec

    return resource_handle_call_time_value


TABLE_HANDLE = _patch.Fix(
    name="ps_tables.table_handle",
    issue=UPSTREAM_ISSUE,
    target=lambda: (_distributed_table_class(), "resource_handle_call_time_value"),
    check=_check_table_handle,
    make=_make_table_handle,
)


def _is_control_flow_graph(graph) -> bool:
    from tensorflow.python.ops import control_flow_v2_func_graphs

    return isinstance(graph, control_flow_v2_func_graphs.ControlFlowFuncGraph)


def _check_capture(original) -> None:
    _patch.require_signature(original, "closure", "spec", "key", "default_value", "placeholder",
                             what="tensorflow FuncGraph.capture_call_time_value")
    _patch.require_attributes(_func_graph_class(), "capture", "outer_graph", "as_default",
                              what="tensorflow FuncGraph")
    from tensorflow.python.ops import control_flow_v2_func_graphs

    _patch.require_attributes(control_flow_v2_func_graphs, "ControlFlowFuncGraph",
                              what="tensorflow control_flow_v2_func_graphs")


def _make_capture(original):
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()

    def applies(self, closure, spec, key=None, default_value=None, placeholder=None):
        return (isinstance(closure, _WorkerTableHandle) and placeholder is None
                and _is_control_flow_graph(self))

    @_patch.passthrough(original, applies)
    def capture_call_time_value(self, closure, spec, key=None, default_value=None,
                                placeholder=None):
        outer = self
        while _is_control_flow_graph(outer):
            outer = outer.outer_graph
        with outer.as_default():
            deferred = outer.capture_call_time_value(closure, spec, key=key,
                                                     default_value=default_value)
        return tf.nest.map_structure(self.capture, deferred)

    return capture_call_time_value


CONTROL_FLOW_CAPTURE = _patch.Fix(
    name="ps_tables.control_flow_capture",
    issue=UPSTREAM_ISSUE,
    target=lambda: (_func_graph_class(), "capture_call_time_value"),
    check=_check_capture,
    make=_make_capture,
)

FIXES = (TABLE_HANDLE, CONTROL_FLOW_CAPTURE)


def install() -> tuple[str, ...]:
    """Installs both fixes (idempotent); returns the names installed by this call."""
    return _patch.install_all(FIXES)


def names() -> tuple[str, ...]:
    return tuple(fix.name for fix in FIXES)
