"""Which gradients go into which all-reduce: the bucket layout, cut at layer boundaries.

One function, `layout`, decides it for both the exchange (`tfdist.comm.sync.CommSync`) and the
cost model (`tfdist.planning.communication.bucket_collectives`), so the planner counts the
collectives the exchange runs.

The gradients come in sending order, last layers first (the order the backward pass produces
them). A bucket is one collective (two with PowerSGD), and it starts when the last of its
inputs exists. So a
bucket holds whole layers: a layer's gradients come out of the backward pass together (a
convolution's kernel and bias gradients from one fused kernel), and a bucket that took the
first gradient of the next layer down would wait for that whole layer. That was measured:
with 40000-byte buckets on the conv model the first bucket took the dense layer, the last
convolution and the 128-byte bias of the convolution below, and its collective started
50-64 ms into the backward pass instead of 28-42 ms (docs/performance.md).

- A layer that fits joins the current bucket if the bucket stays within `bucket_bytes`, and
  starts a new bucket otherwise.
- A layer larger than `bucket_bytes` gets buckets of its own: its gradients, taken as one
  run of numbers in order, are cut into ceil(bytes / bucket_bytes) near-equal spans at
  element boundaries (a span may take the end of the kernel and the bias; a gradient of
  unknown size is never cut). With `split=False` (PowerSGD factorises whole matrices) the
  layer is one bucket instead: its bias then goes in the same collectives as the factors of
  its kernel.
- Without layer names every gradient is its own layer.
"""

from __future__ import annotations

from typing import Hashable, NamedTuple, Sequence


class Segment(NamedTuple):
    """Elements [start, stop) of gradient `item`, flattened; stop None: the whole gradient."""

    item: int
    start: int = 0
    stop: int | None = None


def layout(elements: Sequence[int], bucket_bytes: int, *,
           layers: Sequence[Hashable] | None = None,
           bytes_per_element: int | Sequence[int] = 4,
           split: bool = True) -> list[list[Segment]]:
    """The buckets of an exchange, each a list of segments of the gradients.

    Args:
      elements: each gradient's number of elements, in sending order (last
        layers first); 0 where unknown (such a gradient is never cut and
        counts no bytes).
      bucket_bytes: the most bytes per bucket (0: one bucket for everything).
      layers: each gradient's layer (any hashable; None for all, or for one
        gradient: that gradient is its own layer). Consecutive gradients of the
        same layer form one layer.
      bytes_per_element: bytes of one element, one for all or one per gradient.
      split: whether a layer over `bucket_bytes` is cut into spans (False: it
        is one bucket).

    Returns:
      Buckets in sending order. Every element of every gradient is in exactly
      one segment; a gradient's segments are in order.
    """
    count = len(elements)
    if not count:
        return []
    if not bucket_bytes:
        return [[Segment(i) for i in range(count)]]
    sizes = ([bytes_per_element] * count if isinstance(bytes_per_element, int)
             else list(bytes_per_element))
    nbytes = [int(elements[i]) * sizes[i] for i in range(count)]
    buckets: list[list[Segment]] = []
    current: list[Segment] = []
    used = 0

    def close() -> None:
        nonlocal current, used
        if current:
            buckets.append(current)
        current, used = [], 0

    for unit in _layers(count, layers):
        total = sum(nbytes[i] for i in unit)
        if total <= bucket_bytes:
            if used + total > bucket_bytes:
                close()
            current += [Segment(i) for i in unit]
            used += total
            continue
        close()
        buckets += (_spans(unit, elements, sizes, total, -(-total // bucket_bytes)) if split
                    else [[Segment(i) for i in unit]])
    close()
    return buckets


def _layers(count: int, layers: Sequence[Hashable] | None) -> list[list[int]]:
    """Runs of consecutive indices with the same layer."""
    if layers is None:
        return [[i] for i in range(count)]
    if len(layers) != count:
        raise ValueError(f"layers has {len(layers)} entries for {count} gradients; pass one "
                         "layer per gradient, in the same order.")
    runs: list[list[int]] = []
    for i, layer in enumerate(layers):
        if runs and layer is not None and layers[runs[-1][-1]] == layer:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _spans(unit: list[int], elements: Sequence[int], sizes: Sequence[int], total: int,
           pieces: int) -> list[list[Segment]]:
    """`unit`'s gradients as one run of bytes, cut into `pieces` near-equal spans.

    Each cut falls at the element boundary at or before k * total / pieces.
    """
    cuts = [total * k // pieces for k in range(1, pieces)]
    spans: list[list[Segment]] = [[]]
    offset = 0  # bytes before gradient i in the run
    for i in unit:
        if not elements[i]:  # unknown size: whole, where it falls
            spans[-1].append(Segment(i))
            continue
        end = offset + elements[i] * sizes[i]
        start = 0
        while cuts and cuts[0] < end:
            cut = max(start, (cuts.pop(0) - offset) // sizes[i])
            if cut > start:
                spans[-1].append(Segment(i, start, cut))
                start = cut
            spans.append([])
        if start < elements[i]:
            spans[-1].append(Segment(i, start, None if start == 0 else elements[i]))
        offset = end
    return [span for span in spans if span]


def layer_of(variable) -> str | None:
    """The layer a Keras variable belongs to: its path without the last name.

    `sequential/conv2d_3/kernel` -> `sequential/conv2d_3`. None for a
    variable without a path (it is then its own layer).
    """
    path = getattr(variable, "path", None)
    if not isinstance(path, str) or "/" not in path:
        return None
    return path.rsplit("/", 1)[0]
