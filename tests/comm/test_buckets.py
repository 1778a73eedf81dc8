"""tfdist.comm.buckets: the bucket layout of the exchange, cut at layer boundaries
(no TensorFlow)."""

import math
import random

import pytest

from tfdist.comm import buckets
from tfdist.comm.buckets import Segment

# bench_comm's conv model: 4x Conv2D(32, 3) on (32, 32, 16) inputs, then Dense(10) after pooling;
# Keras's variable order (kernel, bias per layer), reversed: the order the exchange sends.
CONV = [("conv2d", (3, 3, 16, 32)), ("conv2d", (32,)), ("conv2d_1", (3, 3, 32, 32)),
        ("conv2d_1", (32,)), ("conv2d_2", (3, 3, 32, 32)), ("conv2d_2", (32,)),
        ("conv2d_3", (3, 3, 32, 32)), ("conv2d_3", (32,)), ("dense", (32, 10)), ("dense", (10,))]
SENT = list(reversed(CONV))


def _bytes(bucket, elements) -> int:
    return sum(4 * ((elements[s.item] if s.stop is None else s.stop) - s.start) for s in bucket)


def _layers_in(bucket) -> set:
    return {SENT[s.item][0] for s in bucket}


def test_a_bucket_takes_whole_layers_not_the_first_gradient_of_the_layer_below():
    # The measured case (docs/performance.md): 40000-byte buckets on the conv model. Without
    # layers (each gradient its own layer, as tfdist filled buckets before) the first bucket
    # takes dense, conv2d_3 and the 128-byte bias of conv2d_2, which comes out of the backward
    # pass with conv2d_2's kernel gradient: its collective waits for one more layer.
    elements = [math.prod(shape) for _, shape in SENT]
    layers = [layer for layer, _ in SENT]
    before = buckets.layout(elements, 40000)
    assert _layers_in(before[0]) == {"dense", "conv2d_3", "conv2d_2"}  # the negative control
    after = buckets.layout(elements, 40000, layers=layers)
    assert [sorted(_layers_in(b)) for b in after] == [
        ["conv2d_3", "dense"], ["conv2d_2"], ["conv2d_1"], ["conv2d"]]
    assert _bytes(after[0], elements) == 38312
    assert all(s.stop is None and s.start == 0 for b in after for s in b)  # nothing cut


def test_a_layer_over_the_limit_is_cut_into_near_equal_spans_of_its_own():
    # 16 KiB: dense fits (1320 bytes); conv2d_3 (36,992 bytes) is cut into 3 spans of about
    # 12,330 bytes, the last taking the kernel's end and the bias; conv2d_2 starts anew.
    elements = [math.prod(shape) for _, shape in SENT]
    layers = [layer for layer, _ in SENT]
    got = buckets.layout(elements, 16384, layers=layers)
    assert [sorted(_layers_in(b)) for b in got[:5]] == [
        ["dense"], ["conv2d_3"], ["conv2d_3"], ["conv2d_3"], ["conv2d_2"]]
    spans = got[1:4]
    assert [_bytes(b, elements) for b in spans] == [12328, 12332, 12332]
    # bias first (sending order), then the kernel in order, its end next to the bias.
    assert spans[0] == [Segment(2, 0, None), Segment(3, 0, 3050)]
    assert spans[2] == [Segment(3, 6133, 9216)]
    assert len(got) == 1 + 3 * 3 + 2  # conv2d (18,560 bytes) in 2 spans


def test_split_false_keeps_gradients_whole_and_a_large_layer_in_one_bucket():
    elements = [math.prod(shape) for _, shape in SENT]
    layers = [layer for layer, _ in SENT]
    got = buckets.layout(elements, 16384, layers=layers, split=False)
    assert [sorted(_layers_in(b)) for b in got] == [
        ["dense"], ["conv2d_3"], ["conv2d_2"], ["conv2d_1"], ["conv2d"]]
    assert all(s.stop is None for b in got for s in b)


def test_no_limit_is_one_bucket_and_no_gradients_none():
    assert buckets.layout([3, 4], 0) == [[Segment(0), Segment(1)]]
    assert buckets.layout([], 100) == []


def test_every_element_once_in_order_for_random_layouts():
    rng = random.Random(7)
    for _ in range(3000):
        n = rng.randint(1, 8)
        elements = [rng.choice([0, 1, 3, 10, 100, 1000]) for _ in range(n)]  # 0: unknown size
        layers = rng.choice([None, [rng.choice([None, "a", "b"]) for _ in range(n)]])
        limit = rng.choice([0, 4, 16, 100, 1000, 5000])
        for split in (True, False):
            got = buckets.layout(elements, limit, layers=layers, split=split)
            assert all(got)
            assert [s.item for b in got for s in b] == sorted(s.item for b in got for s in b)
            for i in range(n):
                mine = [s for b in got for s in b if s.item == i]
                if mine == [Segment(i)]:
                    continue
                assert split and elements[i], (elements, layers, limit)
                ends = [(s.start, elements[i] if s.stop is None else s.stop) for s in mine]
                assert ends[0][0] == 0 and ends[-1][1] == elements[i]
                assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ends, ends[1:]))
            if limit and split:  # within the limit, give or take one element's cut
                assert all(_bytes(b, [e or 0 for e in elements]) <= limit + 4 for b in got)


def test_layers_must_match_the_gradients():
    with pytest.raises(ValueError, match="layers has 1 entries for 2 gradients"):
        buckets.layout([1, 2], 8, layers=["a"])


def test_layer_of_a_keras_variable_is_its_path_without_the_name():
    class Variable:
        def __init__(self, path):
            self.path = path

    assert buckets.layer_of(Variable("sequential/conv2d_3/kernel")) == "sequential/conv2d_3"
    assert buckets.layer_of(Variable("kernel")) is None
    assert buckets.layer_of(object()) is None
