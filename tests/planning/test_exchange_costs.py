"""The gradient exchange's memory at the step's peak and its collectives, by hand and against
measured allocator peaks (no TensorFlow)."""

import pytest

from tfdist import planning

MLP = [(784, 1024), (1024,), (1024, 1024), (1024,), (1024, 512), (512,), (512, 10), (10,)]
MATRICES = [(784, 1024), (1024, 1024), (1024, 512), (512, 10)]
MIB = 2**20


# --- memory: the exchange's buffers -----------------------------------------------------------

def _bench_sharding_model():
    """experiments/bench_sharding's model: 4 x Dense(1024) on 1024 inputs and a Dense(16)."""
    layers = tuple(planning.LayerStats(
        name=f"d{i}", class_name="Dense", output_shape=(width,), num_params=1024 * width + width,
        activation_elements=width, forward_flops=2.0 * 1024 * width)
        for i, width in enumerate((1024, 1024, 1024, 1024, 16)))
    params = sum(layer.num_params for layer in layers)
    return planning.ModelStats(
        num_params=params, trainable_bytes=4 * params,
        activation_bytes_per_example=4 * sum(layer.activation_elements for layer in layers),
        layers=layers)


# `python -m experiments.sharding_breakdown --rounds=1 --steps=2` under tfslot --exclusive
# (2026-11-26 22:57 UTC, load average 2.6 before, 1.1 after): the allocator's peak over one step
# minus what was allocated when it began, whole process, both replicas (MiB). Half of it is one
# replica's: its gradients, the exchange's buffers, gathered weights and activations.
MEASURED_STEP_MIB = {"mirrored": 68.1, "mirrored[shard=optimizer]": 65.8,
                     "mirrored[shard=gradients]": 88.7,
                     "mirrored[shard=parameters,shard_remat=False]": 47.9,
                     "mirrored[shard=parameters]": 27.0}


def test_exchange_bytes_by_stage():
    w = 1000
    assert planning.exchange_bytes(w, num_replicas=1, stage=2) == 0
    assert [planning.exchange_bytes(w, num_replicas=4, stage=s) for s in range(4)] == [
        w, w, 2 * w, 0]
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3. Received: stage=5"):
        planning.exchange_bytes(w, num_replicas=2, stage=5)
    with pytest.raises(ValueError, match="num_replicas"):
        planning.exchange_bytes(w, num_replicas=0)


def test_step_memory_against_the_measured_allocator_peaks():
    stats = _bench_sharding_model()
    machine = planning.Machine(device=planning.Device(kind="CPU", memory=2**40), num_devices=2,
                               link=planning.Link(bandwidth=1e9))
    plan = planning.plan(stats=stats, global_batch_size=256, machine=machine, optimizer="adam")
    w = stats.trainable_bytes
    for name, measured in MEASURED_STEP_MIB.items():
        m = plan.candidate_named(name).memory
        at_rest = w // 2 if "parameters" in name else w  # stage 3 keeps only the shards
        step = m.total - at_rest - m.optimizer - m.non_trainable
        assert step / MIB == pytest.approx(measured / 2, rel=0.10), name
    # So, as measured (169 and 131 MB peaks in docs/sharding.md), ZeRO-3 without remat needs
    # less than ZeRO-2: the planner takes it where ZeRO-2 does not fit.
    kept = plan.candidate_named("mirrored[shard=parameters,shard_remat=False]")
    zero2 = plan.candidate_named("mirrored[shard=gradients]")
    assert kept.memory.total < zero2.memory.total
    tight = planning.Machine(device=planning.Device(kind="CPU", memory=kept.memory.total),
                             num_devices=2, link=planning.Link(bandwidth=1e9))
    chosen = planning.plan(stats=stats, global_batch_size=256, machine=tight, optimizer="adam")
    assert chosen.recommended_options == (("shard", "parameters"), ("shard_remat", False))


# --- collectives: buckets -----------------------------------------------------------------------

def test_buckets_without_powersgd_pay_the_latency_per_bucket():
    # CommSync.sum_dense at 1 MiB, last gradients first, each gradient its own layer (no
    # layers given): whole layers up to 1 MiB, a layer over it cut into ceil(bytes / 1 MiB)
    # near-equal spans of its own: [bias 40, (512,10) 20480, bias 2048], (1024,512) in 2 spans,
    # [bias 4096], (1024,1024) in 4, [bias 4096], (784,1024) in 4 of 802,816 bytes: 13.
    link = planning.Link(bandwidth=1e9, latency=1e-3)
    k = 4 * sum(n * m for n, m in MATRICES) + 4 * (1024 + 1024 + 512 + 10)
    for compression, per_number in (("none", 4), ("fp16", 2), ("bf16", 2)):
        # fp16/bf16 buckets are laid out by their float32 bytes: the same 13 buckets.
        seconds = planning.compressed_allreduce_time(MLP, 2, link, compression=compression,
                                                     bucket_bytes=1 << 20)
        assert seconds == pytest.approx(13 * 2e-3 + k * per_number / 4 / 1e9), compression
    assert planning.bucket_collectives(MLP, bucket_bytes=1 << 20) == 13
    # With the layers (kernel and bias of each Dense): [dense_3's 20,520 bytes], then each
    # layer over 1 MiB in spans of its own: dense_2 (2,099,200 bytes) 3, dense_1 5, dense 4.
    layers = ["dense", "dense", "dense_1", "dense_1", "dense_2", "dense_2", "dense_3", "dense_3"]
    assert planning.bucket_collectives(MLP, bucket_bytes=1 << 20, layers=layers) == 13
    assert planning.bucket_collectives(MLP, bucket_bytes=1 << 21, layers=layers) == 1 + 2 + 3 + 2
    assert planning.compressed_allreduce_time(
        MLP, 2, link, bucket_bytes=1 << 21, layers=layers) == pytest.approx(8 * 2e-3 + k / 1e9)
    with pytest.raises(ValueError, match="layers has 2 entries for 8 shapes"):
        planning.bucket_collectives(MLP, bucket_bytes=1 << 20, layers=["a", "b"])
    assert planning.bucket_collectives(MLP) == 1
    assert planning.compressed_allreduce_time(MLP, 2, link) == pytest.approx(2e-3 + k / 1e9)
    rows = {c.compression: c for c in planning.candidates(
        shapes=MLP, num_replicas=2, link=link, compute_seconds=0.0, bucket_bytes=1 << 20)}
    assert rows["none"].comm_seconds == pytest.approx(13 * 2e-3 + k / 1e9)
    rows = {c.compression: c for c in planning.candidates(
        shapes=MLP, num_replicas=2, link=link, compute_seconds=0.0, bucket_bytes=1 << 21,
        layers=layers)}
    assert rows["none"].comm_seconds == pytest.approx(8 * 2e-3 + k / 1e9)



# --- sparse (IndexedSlices) gradients ---------------------------------------------------------

def test_sparse_exchange_by_hand():
    g = planning.SparseGradient(variable="e", index=0, rows_per_example=12, row_bytes=32,
                                index_bytes=4, variable_bytes=32000)
    link = planning.Link(bandwidth=1e6, latency=1e-3)
    seconds, sent = planning.sparse_exchange([g], per_replica_batch_size=8, num_replicas=4,
                                             link=link)
    # All-gathers of the row count (4 bytes), the 96 rows (3072 bytes) and their ids (384).
    assert sent == 3 * (4 + 96 * 32 + 96 * 4)
    assert seconds == pytest.approx(3 * (3e-3 + (4 + 96 * 32 + 96 * 4) / 1e6))
    with pytest.raises(ValueError, match="rows_per_example"):
        planning.SparseGradient(variable="e", index=0, rows_per_example=0, row_bytes=32,
                                index_bytes=4, variable_bytes=32000)


def test_planner_all_gathers_an_embeddings_rows_instead_of_all_reducing_its_table():
    keras = pytest.importorskip("keras")
    ids = keras.Input((12,), dtype="int32")
    x = keras.layers.Embedding(20000, 16, name="tokens")(ids)
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(ids, keras.layers.Dense(4)(x))
    stats = planning.model_stats(model)
    dense = 4 * (16 * 4 + 4)
    link = planning.Link(bandwidth=1e9, latency=1e-5)
    machine = planning.Machine(device=planning.Device(kind="CPU", memory=2**34), num_devices=4,
                               link=link)
    plan = planning.plan(stats=stats, global_batch_size=32, machine=machine, optimizer="sgd")
    mirrored = plan.candidate("mirrored")
    # 8 examples per replica: 96 rows of 64 bytes and 96 int32 ids, all-gathered over 4; the
    # Dense layer's 272 bytes ring all-reduced. The table (1.28 MB) is not sent.
    gathered = 3 * (4 + 96 * 64 + 96 * 4)
    assert mirrored.communication_bytes == pytest.approx(2 * 3 / 4 * dense + gathered)
    # Costed as dense (the table all-reduced): 1.92 MB per rank, 96x more.
    assert mirrored.communication_bytes * 90 < planning.ring_allreduce_bytes_per_rank(
        stats.trainable_bytes, 4)
    # Compression leaves the rows as they are; ZeRO-2 densifies the table into its
    # reduce-scatter (the ring's bytes of every variable).
    bf16 = plan.candidate_named("mirrored[gradient_compression=bf16]")
    assert bf16.communication_bytes == pytest.approx(2 * 3 / 4 * dense / 2 + gathered)
    zero2 = plan.candidate_named("mirrored[shard=gradients]")
    assert zero2.communication_bytes == pytest.approx(2 * 3 / 4 * stats.trainable_bytes)
    assert stats.sparse_gradients == (planning.SparseGradient(
        variable="tokens/embeddings", index=0, rows_per_example=12, row_bytes=64,
        index_bytes=4, variable_bytes=20000 * 16 * 4),)
    assert stats.dense_gradient_bytes == dense
