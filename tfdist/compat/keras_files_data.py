"""What in a tf.data pipeline keeps a resumed run from seeing the batches an uninterrupted one sees.

`tfdist.BackupAndRestore.dataset(ds)` resumes by skipping the batches already
trained on, which is exact only when every fresh iterator of `ds` yields the
same sequence. The pipeline's graph (`Dataset._as_serialized_graph`, private:
TensorFlow has no public way to inspect a pipeline) says when it cannot:

- a shuffle with `reshuffle_each_iteration=True` (the default): each pass's
  order depends on how many iterators the dataset object has made, and Keras
  makes a throw-away one for the symbolic build;
- a shuffle without a seed (no `seed=` and no `tf.random.set_seed`): every
  process shuffles differently;
- `tf.data.experimental.shuffle_and_repeat`: reshuffles on every repetition;
- parallel map/interleave/batch with `deterministic=False`: elements come in
  completion order.
"""

from __future__ import annotations

import logging

from tfdist._tf import import_tensorflow

logger = logging.getLogger("tfdist")

_SHUFFLE_OPS = ("ShuffleDataset", "ShuffleDatasetV2", "ShuffleDatasetV3")
_SHUFFLE_AND_REPEAT_OPS = ("ShuffleAndRepeatDataset", "ShuffleAndRepeatDatasetV2")


def _graph_def(dataset):
    tf = import_tensorflow()
    serialized = dataset._as_serialized_graph()
    return tf.compat.v1.GraphDef.FromString(serialized.numpy())


def _const_int(nodes: dict, name: str) -> int | None:
    node = nodes.get(name.split(":")[0].lstrip("^"))
    if node is None or node.op != "Const":
        return None
    values = list(node.attr["value"].tensor.int64_val)
    return int(values[0]) if len(values) == 1 else None


def _node_reasons(node, nodes: dict) -> list[str]:
    reasons = []
    if node.op in _SHUFFLE_OPS:
        if node.op == "ShuffleDatasetV2" or node.attr["reshuffle_each_iteration"].b:
            reasons.append("a shuffle with reshuffle_each_iteration=True (the default): the "
                           "order depends on how many iterators the dataset made")
        # Inputs: dataset, buffer_size, seed, seed2[, seed_generator]. Both seeds 0
        # means "no seed": a different order in every process.
        if len(node.input) >= 4 and nodes:
            seeds = (_const_int(nodes, node.input[2]), _const_int(nodes, node.input[3]))
            if seeds == (0, 0):
                reasons.append("a shuffle without a seed: every process shuffles differently")
    elif node.op in _SHUFFLE_AND_REPEAT_OPS:
        reasons.append("shuffle_and_repeat: it reshuffles on every repetition")
    elif "deterministic" in node.attr and node.attr["deterministic"].s == b"false":
        reasons.append(f"{node.op} with deterministic=False: elements come in completion "
                       "order")
    return reasons


def inexact_resume_reasons(dataset) -> list[str]:
    """Why skipping batches of `dataset` would not resume it exactly ([] if nothing is seen).

    A pipeline whose graph cannot be serialized (e.g. `from_generator`) gives
    []: nothing can be said about it.
    """
    try:
        graph = _graph_def(dataset)
    except Exception as e:  # noqa: BLE001 - any failure means "cannot tell"
        logger.debug("cannot inspect the dataset's graph: %s", e)
        return []
    nodes = {node.name: node for node in graph.node}
    reasons: list[str] = []
    for node in graph.node:
        reasons += _node_reasons(node, nodes)
    for function in graph.library.function:
        for node in function.node_def:
            reasons += _node_reasons(node, {})
    return list(dict.fromkeys(reasons))
