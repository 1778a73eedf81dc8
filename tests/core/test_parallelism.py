"""tfdist.Parallelism: the degrees, the combinations it refuses, its devices and its preset.

Validation needs no TensorFlow; `resolve()` and `preset_options()` read the
4 logical CPUs tests/conftest.py configures.
"""

import json

import pytest

import tfdist
from tfdist import config as config_lib
from tfdist import planning
from tfdist.parallelism import Parallelism
from tfdist.planning import planner


def test_degrees_multiply_and_describe_themselves():
    dims = Parallelism(replicas=2, stages=2, micro_batches=4)
    assert (dims.devices_per_replica, dims.num_devices, dims.splits_model) == (2, 4, True)
    assert str(dims) == "2 replicas x 2 stages (4 micro-batches, free schedule)"
    assert repr(dims) == "Parallelism(replicas=2, stages=2, micro_batches=4)"
    assert Parallelism(replicas=4, shard="gradients").preset == "mirrored"
    assert not Parallelism(replicas=4, shard="gradients").splits_model
    assert Parallelism(replicas=4, workers=2).preset == "multi_worker_mirrored"
    assert Parallelism().preset == "default" and Parallelism().num_devices == 1
    assert tfdist.Parallelism is Parallelism


@pytest.mark.parametrize("kwargs, message", [
    (dict(replicas=0), "replicas must be an integer >= 1. Received: replicas=0"),
    (dict(stages=True), "stages must be an integer >= 1. Received: stages=True"),
    (dict(shard="zero2"), "shard must be one of none, optimizer, gradients, parameters"),
    (dict(replicas=2, offload="optimizer"), "so it needs sharding"),
    (dict(schedule="interleaved"), "schedule must be one of free, gpipe, 1f1b"),
    (dict(shard="optimizer"), "replicas=1 has no other replica"),
    (dict(replicas=2, shard="optimizer", gradient_compression="bf16"),
     "cannot be combined with shard='optimizer'"),
    (dict(replicas=2, shard="optimizer", stages=2), "does not combine it with a model split"),
    (dict(sequence=2, stages=2), "this version runs one at a time"),
    (dict(stages=4, micro_batches=2, schedule="1f1b"), "Use micro_batches >= 4"),
    (dict(replicas=2, stages=2, micro_batches=2, schedule="1f1b"), "runs one pipeline"),
    (dict(replicas=3, workers=2), "do not divide over workers=2"),
    (dict(replicas=2, workers=2, stages=2), "does not split a model across workers"),
    (dict(stages=2, devices=["/cpu:0"]), "use 2 device(s), but devices lists 1"),
    (dict(stages=2, devices="/cpu:0"), "Received the string devices='/cpu:0'"),
    (dict(stages=2, devices=["/cpu:0", "/CPU:0"]), "repeated: ['/CPU:0']"),
])
def test_invalid_combinations_are_refused_when_made(kwargs, message):
    with pytest.raises(ValueError) as info:
        Parallelism(**kwargs)
    assert message in str(info.value), str(info.value)
    assert "Received" in str(info.value)


def test_preset_options_use_the_same_rules():
    # The presets' shard/offload/compression checks are the Parallelism's.
    with pytest.raises(ValueError, match="so it needs sharding"):
        config_lib.MirroredOptions(offload="optimizer")
    assert config_lib.SHARD_STAGES == ("none", "optimizer", "gradients", "parameters")


def test_devices_are_laid_out_replica_major():
    dims = Parallelism(replicas=2, stages=2, tensor=1).resolve()  # the first 4 CPUs
    cpus = tuple(f"/device:CPU:{i}" for i in range(4))
    assert dims.devices == cpus
    assert dims.replica_groups == (cpus[:2], cpus[2:])
    assert dims.stage_devices(1) == cpus[2:]
    tp = Parallelism(stages=2, tensor=2).resolve()
    assert tp.stage_devices(0) == (cpus[0], cpus[2]) and tp.tensor_devices(1) == cpus[2:]
    with pytest.raises(ValueError, match=r"configure_logical_devices\(8\)"):
        Parallelism(replicas=8).resolve()
    with pytest.raises(ValueError, match="call resolve"):
        Parallelism(replicas=2).replica_groups  # noqa: B018


def test_preset_options_name_the_devices_and_refuse_what_the_dims_hold():
    opts = Parallelism(replicas=2, shard="optimizer").preset_options(sync_batch_norm=True)
    assert (opts.preset, opts.num_devices, opts.shard, opts.sync_batch_norm) == (
        "mirrored", 2, "optimizer", True)
    split = Parallelism(replicas=2, stages=2).resolve().preset_options()
    assert split.devices == ("/device:CPU:0", "/device:CPU:2")
    assert Parallelism().preset_options().preset == "default"
    with pytest.raises(ValueError, match="num_devices: the Parallelism says this"):
        Parallelism(replicas=2).preset_options(num_devices=4)
    with pytest.raises(ValueError, match="options apply to data parallelism only"):
        Parallelism(replicas=2, stages=2).resolve().preset_options(sync_batch_norm=True)


def test_every_plan_candidate_carries_a_parallelism_that_matches_it():
    node = planning.Machine(device=planning.Device(kind="GPU", memory=80 * 10**9),
                            num_devices=8, link=planning.Link(bandwidth=300e9))
    cluster = planning.HardwareCluster(machine=node, num_machines=4,
                                       network=planning.Link(bandwidth=3.125e9, latency=1e-5))
    stats = planning.ModelStats.from_param_count(10**8)
    for machine in (node, cluster):
        rec = tfdist.plan(stats=stats, global_batch_size=512, machine=machine)
        for c in rec.candidates:
            if c.preset == "parameter_server":
                assert c.parallelism is None
                continue
            dims = c.parallelism
            assert dims is not None, c.name
            assert dims.replicas == c.num_replicas and dims.preset == c.preset, c.name
            assert tuple((k, getattr(dims, k)) for k, _ in c.options) == c.options, c.name
        assert rec.parallelism == rec.recommended_candidate.parallelism
        json.dumps(rec.as_dict())
    assert rec.recommended == "multi_worker_mirrored"
    assert rec.parallelism == Parallelism(replicas=32, workers=4)


def test_a_variant_outside_the_parallelism_is_refused():
    with pytest.raises(ValueError, match="A variant changes shard, offload"):
        planner.Variant(options=(("bucket_bytes", "1"),), summary="", state="none")
    with pytest.raises(ValueError, match="so it needs sharding"):
        planner.Variant(options=(("offload", "optimizer"),), summary="", state="none")
