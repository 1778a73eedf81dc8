"""The cost model's arithmetic, checked against values worked out by hand (no TensorFlow)."""


import pytest

from tfdist import planning
from tests.support import run_python

GB = 10**9


def _link(bandwidth=1e9, latency=0.0):
    return planning.Link(bandwidth=bandwidth, latency=latency)


# --- units ----------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("80GB", 80 * 10**9), ("16GiB", 16 * 2**30), ("512MB", 512 * 10**6), ("1.5 KiB", 1536),
    ("1024", 1024), (2048, 2048), ("2tb", 2 * 10**12), ("3B", 3),
])
def test_parse_bytes(text, expected):
    assert planning.parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["80XB", "GB", "", "-3GB", "0", 0, "abc", float("nan")])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match=r"memory must be .*Received: memory="):
        planning.parse_bytes(text)


@pytest.mark.parametrize("text, expected", [
    ("25Gbps", 25e9 / 8), ("25Gb/s", 25e9 / 8), ("10GB/s", 10e9), ("100Mbps", 100e6 / 8),
    ("300 GB/s", 300e9), ("1e9", 1e9), (5e8, 5e8), ("2GBps", 2e9), ("8 Gbit/s", 1e9),
])
def test_parse_bandwidth(text, expected):
    assert planning.parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["25G", "fast", "-1Gbps", "0GB/s", 0, "25Gbpss"])
def test_parse_bandwidth_rejects(text):
    with pytest.raises(ValueError, match=r"bandwidth must be .*Received: bandwidth="):
        planning.parse_bandwidth(text)


@pytest.mark.parametrize("text, expected", [
    ("5us", 5e-6), ("0.2ms", 2e-4), ("1e-5s", 1e-5), ("3", 3.0), (0, 0.0), ("10 ns", 1e-8),
])
def test_parse_duration(text, expected):
    assert planning.parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["5 minutes", "-1us", -0.5, "soon"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match=r"latency must be .*Received: latency="):
        planning.parse_duration(text)


def test_format():
    assert planning.format_bytes(1536) == "1.50 KiB"
    assert planning.format_bytes(12) == "12 B"
    assert planning.format_bytes(3 * 2**30) == "3.00 GiB"
    assert planning.format_seconds(0.0123) == "12.30 ms"
    assert planning.format_seconds(4.5e-5) == "45.0 us"
    assert planning.format_seconds(2) == "2.00 s"


# --- specs ------------------------------------------------------------------------


def test_link_validation():
    assert _link(2e9).seconds_per_byte == 0.5e-9
    with pytest.raises(ValueError, match=r"bandwidth must be a number > 0\. Received: bandwidth=0"):
        planning.Link(bandwidth=0)
    with pytest.raises(ValueError,
                       match=r"bandwidth must be a number > 0\. Received: bandwidth=-5"):
        planning.Link(bandwidth=-5)
    with pytest.raises(ValueError, match=r"bandwidth is required\. Received: bandwidth=None"):
        planning.Link(bandwidth=None)
    with pytest.raises(ValueError, match=r"latency must be a number >= 0\. Received: latency=-1"):
        planning.Link(bandwidth=1, latency=-1)
    with pytest.raises(ValueError,
                       match=r"bandwidth must be a number > 0\. Received: bandwidth='1'"):
        planning.Link(bandwidth="1")
    with pytest.raises(TypeError):
        planning.Link()  # bandwidth is required: missing entirely


def test_device_machine_cluster_validation():
    gpu = planning.Device(memory=80 * GB)
    assert gpu.kind == "GPU"
    with pytest.raises(ValueError,
                       match=r"kind must be 'CPU', 'GPU' or 'TPU'\. Received: kind='NPU'"):
        planning.Device(kind="NPU", memory=1)
    with pytest.raises(ValueError, match=r"memory must be a number > 0\. Received: memory=0"):
        planning.Device(memory=0)
    with pytest.raises(ValueError, match=r"peak_flops must be a number > 0"):
        planning.Device(memory=1, peak_flops=-1.0)
    with pytest.raises(ValueError, match=r"num_devices must be an integer > 0\. "
                                         r"Received: num_devices=0"):
        planning.Machine(device=gpu, num_devices=0, link=_link())
    with pytest.raises(ValueError, match=r"num_devices must be an integer > 0\. "
                                         r"Received: num_devices=2\.0"):
        planning.Machine(device=gpu, num_devices=2.0, link=_link())
    with pytest.raises(ValueError, match=r"device must be a tfdist\.planning\.Device"):
        planning.Machine(device="A100", link=_link())
    with pytest.raises(ValueError, match=r"link must be a tfdist\.planning\.Link"):
        planning.Machine(device=gpu, link=25e9)
    node = planning.Machine(device=gpu, num_devices=8, link=_link(300e9))
    with pytest.raises(ValueError, match=r"A cluster of 4 machines needs the network between "
                                         r"them.*Received: network=None"):
        planning.HardwareCluster(machine=node, num_machines=4)
    with pytest.raises(ValueError, match=r"num_machines must be an integer > 0"):
        planning.HardwareCluster(machine=node, num_machines=0)
    cluster = planning.HardwareCluster(machine=node, num_machines=4, network=_link(3e9))
    assert cluster.num_devices == 32
    assert cluster.slowest_link.bandwidth == 3e9
    assert planning.as_cluster(node).num_devices == 8
    assert planning.as_cluster(node).slowest_link.bandwidth == 300e9
    with pytest.raises(ValueError, match=r"machine must be a tfdist\.planning\.Machine or "
                                         r"tfdist\.planning\.HardwareCluster\. Received: str"):
        planning.as_cluster("dgx")
    with pytest.raises(dataclasses_frozen()):
        node.num_devices = 4


def dataclasses_frozen():
    import dataclasses

    return dataclasses.FrozenInstanceError


# --- optimizers --------------------------------------------------------------------


@pytest.mark.parametrize("name, kwargs, slots, scalar", [
    ("sgd", {}, 0, 12), ("sgd", {"momentum": 0.9}, 1, 12), ("momentum", {}, 1, 12),
    ("adam", {}, 2, 12), ("AdamW", {}, 2, 12), ("adam", {"amsgrad": True}, 3, 12),
    ("rmsprop", {}, 1, 12), ("rmsprop", {"momentum": 0.9, "centered": True}, 3, 12),
    ("adagrad", {}, 1, 12), ("nadam", {}, 2, 16), ("lion", {}, 1, 12),
    ("adam", {"use_ema": True}, 3, 12), ("adam", {"gradient_accumulation_steps": 4}, 3, 12),
    ("adam", {"schedule": True}, 2, 8),
])
def test_optimizer_state(name, kwargs, slots, scalar):
    state = planning.optimizer_state(name, **kwargs)
    assert (state.slots_per_variable, state.scalar_bytes) == (slots, scalar)


def test_unknown_optimizer_lists_known_ones():
    with pytest.raises(ValueError, match=r"Unknown optimizer 'shampoo'\. Known: adadelta, "
                                         r"adagrad, adam, .*OptimizerState\(name=\.\.\."):
        planning.optimizer_state("shampoo")
    with pytest.raises(ValueError, match=r"Cannot read the optimizer's configuration"):
        planning.optimizer_state(object())


# --- model stats and memory ------------------------------------------------------------


def test_memory_per_replica_by_hand():
    # 1M float32 parameters, Adam, 1 KB of activations per example, batch 64.
    stats = planning.ModelStats.from_param_count(10**6, activation_bytes_per_example=1000)
    memory = planning.replica_memory(stats, per_replica_batch_size=64, optimizer="adam")
    assert memory.parameters == 4 * 10**6
    assert memory.gradients == 4 * 10**6
    assert memory.optimizer == 8 * 10**6 + 12
    assert memory.activations == 64_000
    assert memory.total == 16 * 10**6 + 12 + 64_000
    assert memory.state == 16 * 10**6 + 12
    assert memory.as_dict()["total"] == memory.total
    sgd = planning.replica_memory(stats, per_replica_batch_size=64, optimizer="sgd")
    assert sgd.optimizer == 12 and sgd.total == 8 * 10**6 + 12 + 64_000


def test_sharded_state_and_stages_divide():
    stats = planning.ModelStats.from_param_count(8 * 10**6, activation_bytes_per_example=800)
    sharded = planning.replica_memory(stats, per_replica_batch_size=10, optimizer="adam",
                                      state_shards=8)
    assert sharded.parameters == 32 * 10**6
    assert sharded.gradients == 4 * 10**6
    assert sharded.optimizer == 8 * 10**6 + 12
    staged = planning.replica_memory(stats, per_replica_batch_size=10, optimizer="adam", stages=4)
    assert staged.parameters == 8 * 10**6 and staged.activations == 2000


def test_global_batch_512_over_8_is_64_each():
    stats = planning.ModelStats.from_param_count(100, activation_bytes_per_example=4)
    assert planning.replica_memory(stats, per_replica_batch_size=512 // 8).activations == 256


@pytest.mark.parametrize("kwargs, message", [
    ({"per_replica_batch_size": 0}, r"per_replica_batch_size must be an integer > 0\. "
                                    r"Received: per_replica_batch_size=0"),
    ({"per_replica_batch_size": 4, "state_shards": 0}, r"state_shards must be an integer > 0"),
    ({"per_replica_batch_size": 4, "stages": -1}, r"stages must be an integer > 0"),
])
def test_replica_memory_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        planning.replica_memory(planning.ModelStats.from_param_count(10), **kwargs)


def test_model_stats_validation():
    with pytest.raises(ValueError,
                       match=r"num_params must be an integer > 0\. Received: num_params=0"):
        planning.ModelStats.from_param_count(0)
    with pytest.raises(ValueError,
                       match=r"num_params must be an integer > 0\. Received: num_params=1\.5"):
        planning.ModelStats.from_param_count(1.5)
    with pytest.raises(ValueError, match=r"activation_bytes_per_example must be an integer >= 0"):
        planning.ModelStats(num_params=1, trainable_bytes=4, activation_bytes_per_example=-1)
    stats = planning.ModelStats.from_param_count(10, forward_flops_per_example=100.0)
    assert stats.gradient_bytes == 40
    assert stats.train_flops_per_example == 300.0
    assert planning.ModelStats.from_param_count(10).forward_flops_per_example == 0.0


def test_model_stats_rejects_non_models():
    with pytest.raises(ValueError, match=r"model must be a keras\.Model\. Received: dict"):
        planning.model_stats({})


@pytest.mark.parametrize("n, stage, expected", [
    (8, 0, 16.0), (8, 1, 4 + 1.5), (8, 2, 2 + 14 / 8), (8, 3, 2.0), (1, 3, 16.0), (64, 3, 0.25),
])
def test_zero_bytes_per_param(n, stage, expected):
    assert planning.zero_bytes_per_param(n, stage) == pytest.approx(expected)


def test_zero_rejects_bad_stage():
    with pytest.raises(ValueError, match=r"stage must be 0, 1, 2 or 3\. Received: stage=4"):
        planning.zero_bytes_per_param(8, 4)


# --- communication ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_ring_vs_central_reducer(n):
    k = 100 * 10**6
    assert planning.ring_allreduce_bytes_per_rank(k, n) == pytest.approx(2 * (n - 1) / n * k)
    assert planning.central_reducer_bytes(k, n) == pytest.approx(2 * (n - 1) * k)
    # The ring's per-rank traffic stays under 2K however many replicas there are;
    # the reducer's grows linearly.
    assert planning.ring_allreduce_bytes_per_rank(k, n) < 2 * k
    assert planning.central_reducer_bytes(k, n) / planning.ring_allreduce_bytes_per_rank(k, n) \
        == pytest.approx(n)


def test_one_replica_communicates_nothing():
    assert planning.ring_allreduce_bytes_per_rank(10**6, 1) == 0
    assert planning.ring_allreduce_time(10**6, 1, _link(latency=1.0)) == 0
    assert planning.central_reducer_time(10**6, 1, _link(latency=1.0)) == 0


def test_alpha_beta_times_by_hand():
    link = planning.Link(bandwidth=1e9, latency=1e-5)  # beta = 1 ns/byte
    k = 10**8
    # T_ring = 2(N-1)a + 2(N-1)/N K b = 2*3*1e-5 + 1.5e8 * 1e-9
    assert planning.ring_allreduce_time(k, 4, link) == pytest.approx(6e-5 + 0.15)
    assert planning.central_reducer_time(k, 4, link) == pytest.approx(6e-5 + 0.6)
    # PS: 4 workers, 2 servers: 2*4*K/2 = 4e8 bytes through each server.
    assert planning.parameter_server_bytes(k, num_workers=4, num_ps=2) == 4e8
    assert planning.parameter_server_time(k, num_workers=4, num_ps=2, link=link) == \
        pytest.approx(8e-5 + 0.4)


@pytest.mark.parametrize("call, message", [
    (lambda: planning.ring_allreduce_bytes_per_rank(-1, 2),
     r"gradient_bytes must be a number >= 0"),
    (lambda: planning.ring_allreduce_bytes_per_rank(1, 0),
     r"num_replicas must be an integer > 0\. Received: num_replicas=0"),
    (lambda: planning.central_reducer_bytes(1, 2.5), r"num_replicas must be an integer > 0"),
    (lambda: planning.parameter_server_bytes(1, num_workers=2, num_ps=0), r"num_ps must be an "
                                                                       r"integer > 0"),
])
def test_communication_rejects(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_fit_alpha_beta_recovers_the_link():
    true = planning.Link(bandwidth=2e9, latency=3e-5)
    sizes = [2**k for k in range(10, 27, 2)]
    points = [(k, planning.ring_allreduce_time(k, 2, true)) for k in sizes]
    fitted = planning.fit_alpha_beta(points, 2)
    assert fitted.bandwidth == pytest.approx(2e9, rel=1e-9)
    assert fitted.latency == pytest.approx(3e-5, rel=1e-6)


def test_relative_fit_weighs_small_messages_like_large_ones():
    # Exact line through the small sizes, one large size 50% slower than the line.
    true = planning.Link(bandwidth=1e9, latency=1e-4)
    points = [(k, planning.ring_allreduce_time(k, 2, true)) for k in (1e6, 2e6, 4e6)]
    points.append((1e9, 1.5 * planning.ring_allreduce_time(1e9, 2, true)))
    relative = planning.fit_alpha_beta(points, 2)
    absolute = planning.fit_alpha_beta(points, 2, relative=False)

    def worst_small(link):
        return max(abs(planning.ring_allreduce_time(k, 2, link) - t) / t for k, t in points[:3])

    # The absolute fit follows the one large message and misses the rest by > 40%.
    assert worst_small(relative) < 0.15 and worst_small(absolute) > 0.4


def test_fit_alpha_beta_clamps_negative_latency():
    fitted = planning.fit_alpha_beta([(1000, 0.5e-6), (2000, 1.5e-6)], 2)
    assert fitted.latency == 0.0 and fitted.bandwidth > 0


@pytest.mark.parametrize("points, n, message", [
    ([(1000, 1e-3)], 2, r"needs measurements at two or more message sizes"),
    ([(1000, 1e-3), (1000, 2e-3)], 2, r"two or more message sizes"),
    ([(1000, 2e-3), (2000, 1e-3)], 2, r"do not grow with message size"),
    ([(1000, 1e-3), (2000, 2e-3)], 1, r"needs >= 2 replicas\. Received: num_replicas=1"),
    ([(1000, 0.0), (2000, 2e-3)], 2, r"Measured times must be > 0"),
])
def test_fit_alpha_beta_rejects(points, n, message):
    with pytest.raises(ValueError, match=message):
        planning.fit_alpha_beta(points, n)


# --- pipelines ---------------------------------------------------------------------------


@pytest.mark.parametrize("s, m, bubble, speedup", [
    (1, 1, 0.0, 1.0), (4, 1, 0.75, 1.0), (4, 12, 0.2, 3.2), (2, 2, 1 / 3, 4 / 3),
    (8, 32, 7 / 39, 256 / 39),
])
def test_pipeline(s, m, bubble, speedup):
    assert planning.pipeline_bubble(stages=s, micro_batches=m) == pytest.approx(bubble)
    assert planning.pipeline_speedup(stages=s, micro_batches=m) == pytest.approx(speedup)
    # speed-up = S * (1 - bubble)
    assert planning.pipeline_speedup(stages=s, micro_batches=m) == pytest.approx(s * (1 - bubble))


@pytest.mark.parametrize("s, target, m", [(4, 0.2, 12), (2, 0.2, 4), (1, 0.1, 1), (8, 0.5, 7)])
def test_micro_batches_for_bubble(s, target, m):
    assert planning.micro_batches_for_bubble(s, target) == m
    assert planning.pipeline_bubble(stages=s, micro_batches=m) <= target + 1e-12
    if m > 1:
        assert planning.pipeline_bubble(stages=s, micro_batches=m - 1) > target


def test_pipeline_rejects():
    with pytest.raises(ValueError, match=r"micro_batches must be an integer > 0\. "
                                         r"Received: micro_batches=0"):
        planning.pipeline_bubble(stages=2, micro_batches=0)
    with pytest.raises(ValueError, match=r"stages must be an integer > 0"):
        planning.pipeline_speedup(stages=0, micro_batches=2)
    with pytest.raises(ValueError,
                       match=r"max_bubble must be in \(0, 1\)\. Received: max_bubble=1"):
        planning.micro_batches_for_bubble(2, 1)


def test_arithmetic_imports_no_tensorflow():
    code = ("import sys, tfdist.planning.planner, tfdist.planning.communication; "
            "from tfdist import planning; "
            "planning.ring_allreduce_time(1e6, 4, planning.Link(bandwidth=1e9)); "
            "print('tensorflow' in sys.modules, 'keras' in sys.modules)")
    result = run_python("-c", code, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_relative_traffic_of_sharding_and_compression():
    # ZeRO-1: all-reduce (2 halves) + all-gather of the updated shards (1 half).
    assert planning.relative_traffic(stage=1) == 1.5
    assert planning.relative_traffic(stage=2) == 1.0  # reduce-scatter + all-gather: the all-reduce
    assert planning.relative_traffic(stage=3) == 1.5  # weights gathered in forward and backward
    assert planning.relative_traffic(compression="bf16") == 0.5
    assert planning.relative_traffic(stage=2, compression="fp16") == 0.5
    # The same ratio as the bytes the compressed all-reduce sends.
    shapes = [(784, 512), (512,)]
    assert planning.relative_traffic(compression="fp16") == (
        planning.compressed_gradient_bytes(shapes, compression="fp16")
        / planning.compressed_gradient_bytes(shapes))
    with pytest.raises(ValueError, match=r"stage must be 0, 1, 2 or 3. Received: stage=4"):
        planning.relative_traffic(stage=4)
    with pytest.raises(ValueError, match=r"powersgd's bytes depend on the shapes"):
        planning.relative_traffic(compression="powersgd")
