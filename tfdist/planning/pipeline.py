"""Pipelines: the bubble of S stages with M micro-batches, and the balanced cut into stages.

- bubble (S-1)/(M+S-1), ideal speed-up S*M/(M+S-1) (GPipe; 1F1B has the same
  bubble), the fewest micro-batches for a bubble target: the one formula
  tfdist.split, the planner and the reports use;
- `balance_contiguous`: the one contiguous-stage partitioner (split's
  `plan_balanced` and the planner both cut with it);
- `layer_costs`: what each layer of a model costs for balancing (parameter
  bytes, traced forward FLOPs, or measured forward time).

    >>> pipeline_bubble(stages=4, micro_batches=12)
    0.2
"""

from __future__ import annotations

import math
import time
from typing import Literal, Sequence

from tfdist.planning.units import check_positive


def _check_pipeline(stages: int, micro_batches: int) -> None:
    check_positive("stages", stages, integer=True)
    check_positive("micro_batches", micro_batches, integer=True)


def pipeline_bubble(*, stages: int, micro_batches: int) -> float:
    """Idle fraction of a synchronous (GPipe) pipeline: (S-1)/(M+S-1)."""
    _check_pipeline(stages, micro_batches)
    return (stages - 1) / (micro_batches + stages - 1)


def pipeline_speedup(*, stages: int, micro_batches: int) -> float:
    """Ideal speed-up of S balanced stages over one device: S*M/(M+S-1)."""
    _check_pipeline(stages, micro_batches)
    return stages * micro_batches / (micro_batches + stages - 1)


def micro_batches_for_bubble(stages: int, max_bubble: float) -> int:
    """Fewest micro-batches M with (S-1)/(M+S-1) <= max_bubble."""
    check_positive("stages", stages, integer=True)
    if not 0 < max_bubble < 1:
        raise ValueError(f"max_bubble must be in (0, 1). Received: max_bubble={max_bubble!r}")
    if stages == 1:
        return 1
    return max(1, math.ceil((stages - 1) * (1 - max_bubble) / max_bubble - 1e-9))


# --- the balanced cut ------------------------------------------------------------


def balance_contiguous(costs: Sequence[float], weights: Sequence[float]) -> list[int]:
    """Splits costs into len(weights) contiguous non-empty parts minimising max(part/weight).

    The one contiguous-stage partitioner of tfdist: `plan_balanced` (costs:
    parameter bytes, FLOPs or time) and the planner (costs: bytes per layer)
    both cut with it. Exact dynamic programme, O(K * N^2) comparisons done N
    at a time with numpy; N is the number of layers. Ties go to the later
    cut, so early stages are not overloaded.

    Returns:
      The stage index of each item.
    """
    import numpy as np

    n, k = len(costs), len(weights)
    if k > n:
        raise ValueError(
            f"Cannot split {n} layer(s) into {k} stages: every stage needs at least one "
            f"layer. Received: num_stages={k}. Use num_stages <= {n}."
        )
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=float))])
    if k * n * n > 4_000_000:  # hundreds of layers: the same optimum, found faster
        return _balance_by_bisection(prefix, [float(w) for w in weights])
    inf = float("inf")
    # best[s, i]: minimal bottleneck placing the first i items on the first s stages
    best = np.full((k + 1, n + 1), inf)
    cut = np.zeros((k + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for s in range(1, k + 1):
        w = float(weights[s - 1])
        for i in range(s, n - (k - s) + 1):
            j = np.arange(s - 1, i)
            values = np.maximum(best[s - 1, j], (prefix[i] - prefix[j]) / w)
            low = values.min()
            if low == inf:
                continue
            ties = np.nonzero(values <= low + 1e-12 * max(1.0, abs(low)))[0]
            best[s, i], cut[s, i] = low, j[ties[-1]]
    stages = [0] * n
    i = n
    for s in range(k, 0, -1):
        j = int(cut[s, i])
        for t in range(j, i):
            stages[t] = s - 1
        i = j
    return stages


def _greedy(prefix, weights, limit: float) -> list[int] | None:
    """Cut points giving every stage at most `limit` (cost/weight), taking as much as
    possible per stage while leaving an item for each later stage; None if impossible."""
    n, k = len(prefix) - 1, len(weights)
    starts, i = [], 0
    for s, w in enumerate(weights):
        starts.append(i)
        room = n - (k - s - 1)  # items left for the later stages
        j = i + 1
        if (prefix[j] - prefix[i]) / w > limit:
            return None
        while j < room and (prefix[j + 1] - prefix[i]) / w <= limit:
            j += 1
        i = j
    return starts if i == n else None


def _balance_by_bisection(prefix, weights) -> list[int]:
    """The minimal bottleneck by bisection on its value (feasibility is monotone and
    checked greedily in O(N)); exact up to float resolution."""
    low, high = 0.0, float(prefix[-1]) / min(weights) + 1.0
    for _ in range(200):
        mid = (low + high) / 2
        if _greedy(prefix, weights, mid) is None:
            low = mid
        else:
            high = mid
        if high - low <= 1e-12 * max(1.0, high):
            break
    starts = _greedy(prefix, weights, high)
    n = len(prefix) - 1
    stages = [0] * n
    for s, start in enumerate(starts):
        end = starts[s + 1] if s + 1 < len(starts) else n
        stages[start:end] = [s] * (end - start)
    return stages


# --- what each layer costs --------------------------------------------------------

BalanceBy = Literal["params", "flops", "time"]
BALANCE_BY: tuple[str, ...] = ("params", "flops", "time")


def layer_graph(model_or_graph, input_shape=None):
    """The model's tfdist.split.graph.LayerGraph (a LayerGraph is returned as it is)."""
    from tfdist.split import graph

    if isinstance(model_or_graph, graph.LayerGraph):
        return model_or_graph
    return graph.flatten(model_or_graph, input_shape=input_shape)


def param_bytes(graph) -> list[int]:
    """Bytes of each layer's variables; a variable shared by two layers counts once."""
    import numpy as np

    seen: set[int] = set()
    out = []
    for layer in graph.layers.values():
        total = 0
        for w in layer.weights:
            if id(w) in seen:
                continue
            seen.add(id(w))
            total += int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize
        out.append(total)
    return out


def _per_layer(graph, per_node: dict[int, float]) -> list[float]:
    """Sums per-call numbers into the plan's layers; a keras op (x + y) or a
    shared layer's later call counts for the layer whose call came before it."""
    totals = {name: 0.0 for name in graph.layers}
    current = next(iter(graph.layers), None)
    for node in graph.nodes:
        if node.layer is not None and node.first_call:
            current = node.layer
        if current is not None:
            totals[current] += per_node.get(node.index, 0.0)
    return [totals[name] for name in graph.layers]


def forward_flops(graph, input_shapes=None) -> list[float]:
    """Per-example forward FLOPs of each layer, from the traced graph (tfdist.planning.flops)."""
    from tfdist.planning import flops

    costs = flops.trace_costs(graph, input_shapes)
    return _per_layer(graph, {c.node: c.flops for c in costs})


def measured_seconds(graph, *, batch_size: int = 32, repeats: int = 5,
                     input_shapes=None) -> list[float]:
    """Median wall time of each layer's calls on random inputs (eager, one device)."""
    import numpy as np

    from tfdist.planning import flops
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    specs = flops.input_specs(graph, input_shapes, batch_size=batch_size)
    rng = np.random.default_rng(0)
    inputs = [np.zeros(s.shape, s.dtype.as_numpy_dtype) if s.dtype.is_integer or s.dtype.is_bool
              else rng.standard_normal(s.shape).astype(s.dtype.as_numpy_dtype) for s in specs]
    samples: dict[int, list[float]] = {}

    def timed(node, run):
        start = time.perf_counter()
        run()
        samples.setdefault(node.index, []).append(time.perf_counter() - start)

    flat = [tf.constant(x) for x in inputs]
    graph.run(flat, training=False)  # warm-up: builds and traces kernels
    for _ in range(repeats):
        graph.run(flat, training=False, on_node=timed)
    return _per_layer(graph, {i: float(np.median(t)) for i, t in samples.items()})


def layer_costs(model, by: BalanceBy, *, input_shapes=None) -> list[float]:
    """One cost per layer of the plan (execution order, nested models flattened)."""
    if by not in BALANCE_BY:
        raise ValueError(f"by must be one of {BALANCE_BY}. Received: by={by!r}")
    graph = layer_graph(model)
    if by == "params":
        return [float(b) for b in param_bytes(graph)]
    if by == "flops":
        return forward_flops(graph, input_shapes)
    return measured_seconds(graph, input_shapes=input_shapes)
