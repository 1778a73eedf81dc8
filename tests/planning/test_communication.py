"""Bytes on the wire per compression method, and the planner's choice (no TensorFlow)."""

import pytest

from tfdist import planning
from tfdist.comm import powersgd
from tfdist.planning import communication

MLP = [(784, 1024), (1024,), (1024, 1024), (1024,), (1024, 512), (512,), (512, 10), (10,)]


def test_matrix_view_and_which_matrices_compress():
    assert powersgd.matrix_shape((3, 3, 16, 32)) == (144, 32)  # Conv2D: output dim last
    assert powersgd.matrix_shape((10,)) is None
    assert powersgd.compresses((784, 1024), 4)
    assert powersgd.compresses((512, 10), 4)  # (512+10)*4 numbers, 2.45x fewer
    assert not powersgd.compresses((20, 10), 4)  # (20+10)*4*2 > 200: sent whole
    assert not powersgd.compresses((1024,), 1)


def test_wire_bytes_worked_out_by_hand():
    numbers = sum(a * (b if b else 1) for a, b in ((784, 1024), (1024, 0), (1024, 1024),
                                                     (1024, 0), (1024, 512), (512, 0),
                                                     (512, 10), (10, 0)))
    assert planning.compressed_gradient_bytes(MLP) == 4 * numbers
    assert planning.compressed_gradient_bytes(MLP, compression="fp16") == 2 * numbers
    assert planning.compressed_gradient_bytes(MLP, compression="bf16") == 2 * numbers
    factors = (784 + 1024) * 4 + (1024 + 1024) * 4 + (1024 + 512) * 4 + (512 + 10) * 4
    whole = 1024 + 1024 + 512 + 10
    assert planning.compressed_gradient_bytes(MLP, compression="powersgd", rank=4) == 4 * (
        factors + whole)
    with pytest.raises(ValueError, match="compression must be one of none, fp16, bf16, "
                                         "powersgd. Received: compression='zip'"):
        planning.compressed_gradient_bytes(MLP, compression="zip")


def test_allreduce_time_counts_powersgd_two_rounds():
    link = planning.Link(bandwidth=1e9, latency=1e-3)
    plain = planning.compressed_allreduce_time(MLP, 2, link)
    assert plain == pytest.approx(
        planning.ring_allreduce_time(planning.compressed_gradient_bytes(MLP), 2, link))
    low = planning.compressed_allreduce_time(MLP, 2, link, compression="powersgd")
    k = planning.compressed_gradient_bytes(MLP, compression="powersgd")
    assert low == pytest.approx(2 * 2e-3 + k / 1e9)
    assert planning.compressed_allreduce_time(MLP, 1, link, compression="fp16") == 0.0


def test_rank_check_names_the_variable():
    powersgd.check_rank([("dense/kernel", (784, 1024)), ("dense/bias", (1024,))], 64)
    # A matrix smaller than the rank is sent whole: a KerasHub BERT's (2, hidden) segment
    # embedding and a 2-class head at rank 4 (these were refused: "Use powersgd_rank <= 2").
    bert = [("token_embedding/embeddings", (8192, 256)), ("segment_embedding/embeddings",
                                                           (2, 256)), ("logits/kernel", (256, 2))]
    powersgd.check_rank(bert, 4)
    assert not powersgd.compresses((2, 256), 4) and powersgd.wire_numbers((2, 256), 4) == 512
    assert powersgd.compresses((8192, 256), 4)
    # A rank above every matrix's smaller dimension would compress nothing.
    with pytest.raises(ValueError) as info:
        powersgd.check_rank([("a/kernel", (784, 24)), ("logits/kernel", (512, 10)),
                             ("a/bias", (24,))], 25)
    assert "powersgd_rank=25 is larger than the smaller dimension of every weight matrix " \
           "(the largest, variable 'a/kernel', has shape (784, 24)" in str(info.value)
    assert "Use powersgd_rank <= 24" in str(info.value)
    with pytest.raises(ValueError, match="Received: powersgd_rank=0"):
        powersgd.check_rank(bert, 0)


def test_recommend():
    slow = planning.Link(bandwidth=0.2e9, latency=1e-3)
    method, reason = communication.recommend(shapes=MLP, num_replicas=2, link=slow,
                                        compute_seconds=0.02)
    assert method == "powersgd", reason
    assert "instead of" in reason
    fast = planning.Link(bandwidth=100e9, latency=1e-6)
    assert communication.recommend(shapes=MLP, num_replicas=2, link=fast,
                              compute_seconds=0.5)[0] == "none"
    assert communication.recommend(shapes=MLP, num_replicas=1, link=slow,
                              compute_seconds=0.02)[0] == "none"
    rows = communication.candidates(shapes=MLP, num_replicas=2, link=slow, compute_seconds=0.02)
    assert [r.compression for r in rows] == ["none", "fp16", "bf16", "powersgd"]
    assert rows[1].wire_bytes * 2 == rows[0].wire_bytes


def test_candidates_from_gradient_bytes_only():
    slow = planning.Link(bandwidth=0.2e9, latency=1e-3)
    rows = communication.candidates(gradient_bytes=9_000_000, num_replicas=2, link=slow,
                               compute_seconds=0.02)
    assert [r.compression for r in rows] == ["none", "fp16", "bf16"]
    assert rows[0].wire_bytes == 9_000_000 and rows[1].wire_bytes == 4_500_000
    assert communication.recommend(gradient_bytes=9_000_000, num_replicas=2, link=slow,
                              compute_seconds=0.02)[0] in ("fp16", "bf16")
    with pytest.raises(ValueError, match="Pass shapes"):
        communication.candidates(num_replicas=2, link=slow, compute_seconds=0.02)
