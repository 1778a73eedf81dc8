"""The planner: recommendations checked against device memory, the `auto` preset, the CLI."""

import dataclasses
import json
import logging
import math
import os

import pytest

import tfdist
from tfdist import planning, strategies
from tfdist.planning import planner
from tests.support import run_python

GB = 10**9
GiB = 2**30


def _node(num_devices=8, memory="80GB", bandwidth="300GB/s", latency="5us", flops=None):
    return planning.Machine(
        device=planning.Device(kind="GPU", memory=planning.parse_bytes(memory), peak_flops=flops),
        num_devices=num_devices,
        link=planning.Link(bandwidth=planning.parse_bandwidth(bandwidth),
                           latency=planning.parse_duration(latency)))


def _stats(params, act=0, flops=None):
    return planning.ModelStats.from_param_count(int(params), activation_bytes_per_example=act,
                                                forward_flops_per_example=flops)


def test_one_billion_params_on_8x80gb_is_mirrored_with_the_numbers():
    plan = tfdist.plan(stats=_stats(1e9, act=10**6), global_batch_size=512, machine=_node())
    assert plan.recommended == "mirrored"
    mirrored = plan.candidate("mirrored")
    assert mirrored.per_replica_batch_size == 64
    # weights 4e9 + grads 4e9 + Adam 8e9 (+12 scalar bytes) + activations 64 x 1e6, and the
    # all-reduce's pack of the local gradients, 4e9
    assert mirrored.memory.exchange == 4 * 10**9
    assert mirrored.memory.total == 16 * 10**9 + 12 + 64 * 10**6 + 4 * 10**9
    assert mirrored.communication_bytes == pytest.approx(2 * 7 / 8 * 4e9)
    assert mirrored.communication_time == pytest.approx(14 * 5e-6 + 2 * 7 / 8 * 4e9 / 300e9)
    assert any("ring all-reduce sends 6.52 GiB per rank" in r for r in plan.reasons)
    assert plan.split is None


def test_model_whose_state_does_not_fit_gets_the_cheapest_sharding_variant_that_fits():
    plan = tfdist.plan(stats=_stats(7e9), global_batch_size=512, machine=_node())
    # W = 28 GB of weights; 7e9 x 16 bytes = 112 GB per replica + the all-reduce's pack (W)
    # does not fit 80 GB. Over 8 replicas ZeRO-1 (28 + 28 + 56/8 + W = 91 GB) and ZeRO-2
    # (28 + 28/8 + 56/8 + its packed gradients and all-to-all receive buffer, 2W = 94.5 GB) do
    # not either; ZeRO-3 without remat (28/8 + W gathered + 28/8 + 56/8 = 42 GB) fits and
    # moves the ring's bytes, ZeRO-3 with remat (14 GB) 1.5x them.
    assert not plan.candidate("mirrored").fits
    assert not plan.candidate_named("mirrored[shard=optimizer]").fits
    assert not plan.candidate_named("mirrored[shard=gradients]").fits
    assert (plan.recommended, plan.recommended_options) == (
        "mirrored", (("shard", "parameters"), ("shard_remat", False)))
    chosen = plan.recommended_candidate
    assert chosen.memory.total == 3_500_000_000 + 28 * 10**9 + 3_500_000_000 + 7 * 10**9 + 12
    assert chosen.communication_bytes == plan.candidate("mirrored").communication_bytes
    remat = plan.candidate_named("mirrored[shard=parameters]")
    assert remat.fits and remat.communication_bytes > chosen.communication_bytes
    assert any("Apply it with tfdist.make_strategy('mirrored', shard='parameters', "
               "shard_remat=False)" in r for r in plan.reasons)


def test_model_too_big_for_one_device_gets_a_checked_split(monkeypatch):
    monkeypatch.setattr(planner, "VARIANTS", ())  # an installation without sharding
    plan = tfdist.plan(stats=_stats(7e9), global_batch_size=512, machine=_node())
    assert plan.recommended == "split"
    assert not plan.candidate("mirrored").fits and not plan.candidate("default").fits
    split = plan.split
    # 7e9 x 16 bytes = 112 GB: two stages of 56 GB fit in 80 GB, one does not.
    assert split.stages == 2 and split.data_parallel_groups == 4
    assert split.stage_memory.total == 56 * 10**9 + 12
    assert split.stage_memory.total <= 80 * GB
    assert split.micro_batches == 4 and split.bubble == pytest.approx(0.2)
    assert split.ideal_speedup == pytest.approx(1.6)
    assert plan.candidate("split").fits
    assert any("No data-parallel replica fits one device" in r for r in plan.reasons)


def test_nothing_fits_recommends_nothing_and_says_why():
    plan = tfdist.plan(stats=_stats(7e10), global_batch_size=512, machine=_node())
    assert plan.recommended is None and plan.split is None
    assert any("Even split over all 8 devices the model does not fit" in r and
               "2.00 bytes/parameter at stage 3" in r for r in plan.reasons)


@pytest.mark.parametrize("params", [1e6, 1e8, 1e9, 4e9, 6e9, 1.5e10, 3e10, 1e11])
@pytest.mark.parametrize("memory", ["16GB", "80GB"])
@pytest.mark.parametrize("machines", [1, 2])
def test_never_recommends_what_it_has_not_checked(params, memory, machines):
    node = _node(memory=memory)
    hardware = node if machines == 1 else planning.HardwareCluster(
        machine=node, num_machines=machines, network=planning.Link(bandwidth=3e9))
    plan = tfdist.plan(stats=_stats(params, act=10**5), global_batch_size=256, machine=hardware)
    device_memory = planning.parse_bytes(memory)
    if plan.recommended is None:
        assert not any(c.fits for c in plan.candidates)
        return
    chosen = plan.recommended_candidate
    assert chosen.memory is not None and chosen.memory.total <= device_memory
    assert chosen.registered
    if plan.recommended == "split":
        assert plan.split.stage_memory.total <= device_memory
        # and one stage fewer would not have fit
        fewer = planning.replica_memory(
            plan.stats, optimizer=plan.optimizer,
            per_replica_batch_size=256 // plan.split.data_parallel_groups,
            stages=plan.split.stages - 1)
        assert fewer.total > device_memory or plan.split.stages == 2


def test_split_uses_the_real_layers_of_a_keras_model(monkeypatch):
    monkeypatch.setattr(planner, "VARIANTS", ())  # an installation without sharding
    keras = pytest.importorskip("keras")
    model = keras.Sequential([keras.Input((256,))] + [
        keras.layers.Dense(256, name=f"d{i}") for i in range(8)])
    stats = planning.model_stats(model)
    per_layer = (256 * 256 + 256) * 4 * 4  # weights, grads, 2 Adam slots
    tiny = planning.Machine(device=planning.Device(kind="CPU", memory=int(per_layer * 2.5)),
                            num_devices=4, link=planning.Link(bandwidth=1e9))
    plan = tfdist.plan(stats=stats, global_batch_size=4, machine=tiny)
    assert plan.recommended == "split"
    assert plan.split.stages == 4 and plan.split.stage_boundaries == (0, 2, 4, 6)
    assert plan.split.stage_memory.parameters == 2 * (256 * 256 + 256) * 4
    assert plan.split.stage_memory.total <= tiny.device.memory
    assert any("pipeline stages starting at layers [0, 2, 4, 6]" in r for r in plan.reasons)


def test_cluster_prefers_multi_worker_and_explains_parameter_servers():
    cluster = planning.HardwareCluster(machine=_node(), num_machines=4,
                                       network=planning.Link(bandwidth=planning.parse_bandwidth("25Gbps"),
                                                             latency=1e-5))
    plan = tfdist.plan(stats=_stats(1e8), global_batch_size=512, machine=cluster, num_ps=2)
    assert plan.recommended == "multi_worker_mirrored"
    mwms = plan.candidate("multi_worker_mirrored")
    assert mwms.num_replicas == 32 and mwms.per_replica_batch_size == 16
    assert mwms.communication_time == pytest.approx(62 * 1e-5 + 2 * 31 / 32 * 4e8 / 3.125e9)
    ps = plan.candidate("parameter_server")
    assert ps.communication_bytes == 2 * 4 * 4e8 / 2
    assert any(r.startswith("parameter_server also fits") for r in plan.reasons)


def test_peak_flops_make_it_pick_the_fastest_step():
    # Tiny compute, huge gradients over a slow link: one device wins.
    slow = _node(num_devices=4, bandwidth="1GB/s", flops=1e14)
    plan = tfdist.plan(stats=_stats(1e8, flops=1e3), global_batch_size=64, machine=slow)
    assert plan.recommended == "default"
    assert "estimated step" in plan.reasons[1]
    # Heavy compute, same link: data parallelism wins.
    plan = tfdist.plan(stats=_stats(1e6, flops=1e11), global_batch_size=64, machine=slow)
    assert plan.recommended == "mirrored"
    assert plan.candidate("mirrored").step_time < plan.candidate("default").step_time


def test_indivisible_batch_is_not_a_candidate_that_fits():
    plan = tfdist.plan(stats=_stats(1e6), global_batch_size=100, machine=_node())
    mirrored = plan.candidate("mirrored")
    assert mirrored.per_replica_batch_size is None and not mirrored.fits
    assert "global batch 100 does not divide over 8 replicas" in mirrored.note
    assert plan.recommended == "default"


def test_plan_as_dict_is_json():
    plan = tfdist.plan(stats=_stats(7e10), global_batch_size=512, machine=_node())
    data = json.loads(json.dumps(plan.as_dict()))
    # 7e10 parameters: only ZeRO-3 over 8 (1.12 TB / 8 + the largest layer) comes close.
    assert data["recommended"] is None and data["split"] is None
    assert {c["preset"] for c in data["candidates"]} == {"default", "mirrored"}
    plan = tfdist.plan(stats=_stats(7e9), global_batch_size=512, machine=_node())
    data = json.loads(json.dumps(plan.as_dict()))
    assert data["recommended"] == "mirrored"
    assert data["recommended_options"] == {"shard": "parameters", "shard_remat": False}


@pytest.mark.parametrize("kwargs, message", [
    ({}, r"plan\(\) needs a model"),
    ({"stats": _stats(10), "global_batch_size": 0}, r"global_batch_size must be an integer >= 1\. "
                                                    r"Received: global_batch_size=0"),
    ({"stats": _stats(10), "machine": "dgx"}, r"machine must be a tfdist\.planning\.Machine"),
    ({"stats": _stats(10), "optimizer": "shampoo"}, r"Unknown optimizer 'shampoo'"),
    ({"stats": _stats(10), "num_ps": 0}, r"num_ps must be an integer > 0"),
])
def test_plan_rejects_bad_input(kwargs, message):
    kwargs = {"global_batch_size": 8, "machine": _node(), **kwargs}
    with pytest.raises(ValueError, match=message):
        tfdist.plan(**kwargs)


def test_this_machine_is_a_cpu_with_the_ram():
    machine = planner.this_machine()
    assert machine.device.kind == "CPU" and machine.num_devices == 1
    assert machine.device.memory == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# --- auto ----------------------------------------------------------------------------


def _tf_config(**cluster):
    roles = {role: [f"127.0.0.1:{20000 + 10 * i + j}" for j in range(n)]
             for i, (role, n) in enumerate(cluster.items())}
    task = "chief" if "chief" in roles else "worker"
    return {"TF_CONFIG": json.dumps({"cluster": roles, "task": {"type": task, "index": 0}})}


@pytest.mark.parametrize("environ, gpus, preset, reason", [
    ({}, 0, "default", "no TF_CONFIG cluster and no GPU: nothing to distribute over"),
    ({}, 1, "default", "no TF_CONFIG cluster and one GPU"),
    ({}, 4, "mirrored", "no TF_CONFIG cluster and 4 GPUs on this machine"),
    ({"TF_CONFIG": "{}"}, 0, "default", "no TF_CONFIG cluster"),
    (_tf_config(worker=2), 0, "multi_worker_mirrored", "TF_CONFIG describes 2 training tasks"),
    (_tf_config(chief=1, worker=1), 2, "multi_worker_mirrored", "2 training tasks and no ps"),
    (_tf_config(worker=1), 2, "mirrored", "TF_CONFIG has one training task and 2 GPUs"),
    (_tf_config(worker=1), 0, "default", "TF_CONFIG has one training task and no GPU"),
    (_tf_config(chief=1, worker=2, ps=2), 0, "parameter_server",
     "TF_CONFIG describes a cluster with 2 ps task(s) (chief=1 worker=2 ps=2)"),
])
def test_choose_preset(environ, gpus, preset, reason):
    chosen, why = strategies.choose_preset(environ=environ, num_gpus=gpus)
    assert chosen == preset
    assert reason in why


def test_choose_preset_rejects_a_broken_tf_config():
    with pytest.raises(ValueError, match="TF_CONFIG"):
        strategies.choose_preset(environ={"TF_CONFIG": "{not json"}, num_gpus=0)


def test_auto_on_this_machine_is_default_and_logs_why(caplog, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with caplog.at_level(logging.WARNING, logger="tfdist"):
        strategy = tfdist.make_strategy("auto")
    import tensorflow as tf

    assert strategy is tf.distribute.get_strategy()
    records = [r for r in caplog.records if "auto chose" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.WARNING  # seen by default
    assert records[0].getMessage() == ("auto chose preset 'default' because no TF_CONFIG "
                                       "cluster and no GPU: nothing to distribute over.")


def test_auto_says_what_it_chose_without_any_logging_setup():
    result = run_python("-c", "import tfdist; tfdist.make_strategy('auto')", timeout=100,
                        env={"TF_CONFIG": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [l for l in result.stderr.splitlines() if "auto chose" in l]
    assert lines == ["auto chose preset 'default' because no TF_CONFIG cluster and no GPU: "
                     "nothing to distribute over."], result.stderr[-2000:]


@pytest.mark.parametrize("roles, preset", [
    ({"worker": 2}, "multi_worker_mirrored"),
    ({"chief": 1, "worker": 1, "ps": 1}, "parameter_server"),
])
def test_auto_refuses_a_preset_that_is_not_registered(monkeypatch, roles, preset):
    # As in an installation without that preset (building a registered one here
    # would try to join the cluster in TF_CONFIG).
    monkeypatch.delitem(strategies._REGISTRY, preset, raising=False)
    monkeypatch.setenv("TF_CONFIG", _tf_config(**roles)["TF_CONFIG"])
    with pytest.raises(ValueError, match=rf"Preset 'auto' chose '{preset}' because TF_CONFIG "
                                         rf".*but preset '{preset}' is not registered in this "
                                         r"installation \(available: default, .*auto"):
        tfdist.make_strategy("auto")


def test_auto_takes_only_its_own_options():
    with pytest.raises(ValueError, match=r"Unknown option\(s\) for preset 'auto': num_devices\. "
                                         r"Valid options: slurm_port\."):
        tfdist.make_strategy("auto", num_devices=2)


# --- CLI -------------------------------------------------------------------------------


def _cli(*args, env=None):
    return run_python("-m", "tfdist.cli", "plan", *args, timeout=120, env=env)


def test_cli_text_for_8_gpus():
    result = _cli("--params=7e9", "--devices=8", "--device_memory=80GB", "--bandwidth=300GB/s",
                  "--latency=5us", "--global_batch_size=512")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "hardware: 1 machine(s) x 8 GPU(s), 74.51 GiB each" in out
    assert "recommended: mirrored, shard='parameters', shard_remat=False" in out
    assert "mirrored[shard=parameters,shard_remat=False]" in out and "39.12 GiB" in out
    assert "mirrored" in out and "130.39 GiB" in out  # the unsharded replica, ruled out
    assert "mirrored[shard=gradients]" in out and "88.01 GiB" in out  # ZeRO-2's buffers


def test_cli_json_cluster_and_exit_status_when_nothing_fits(tmp_path):
    spec = tmp_path / "cluster.json"
    spec.write_text(json.dumps({"machines": 2, "devices": 4, "device_memory": "16GB",
                                "bandwidth": "100GB/s", "network_bandwidth": "25Gbps"}))
    result = _cli("--params=350M", f"--cluster={spec}", "--format=json")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # quiet: `tfdist plan ... 2>&1 | jq` reads JSON
    data = json.loads(result.stdout)
    assert data["recommended"] == "multi_worker_mirrored"
    assert data["cluster"]["network"]["bandwidth"] == 25e9 / 8
    result = _cli("--params=1e12", "--devices=2", "--device_memory=1GB", "--bandwidth=1GB/s")
    assert result.returncode == 1
    assert "recommended: nothing fits" in result.stdout


def test_cli_reads_an_example_model():
    result = _cli("--model=mlp", "--input_shape=8,8,1", "--num_classes=10", "--devices=2",
                  "--device_memory=1GB", "--bandwidth=10GB/s", "--format=json")
    assert result.returncode == 0, result.stderr
    # Quiet although the model imports keras: no TensorFlow start-up lines on stderr, so
    # `tfdist plan --model=... --format=json 2>&1 | jq` reads JSON.
    assert result.stderr == "", result.stderr
    data = json.loads(result.stdout)
    # build_mlp: 64 -> 256 -> 128 -> 10, weights and biases
    assert data["model"]["num_params"] == 64 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10
    assert data["recommended"] == "mirrored"


USER_MODELS = """
import keras

def gpt():
    ids = keras.Input((None,), dtype="int32", name="token_ids")
    x = keras.layers.Embedding(100, 16)(ids)
    x = x + keras.layers.MultiHeadAttention(2, 8)(x, x)
    return keras.Model(ids, keras.layers.Dense(100)(x))
"""


def test_cli_takes_the_users_own_models(tmp_path):
    (tmp_path / "user_models.py").write_text(USER_MODELS)
    hardware = ["--devices=2", "--device_memory=1GB", "--bandwidth=10GB/s", "--format=json"]
    env = {"PYTHONPATH": str(tmp_path)}
    text = _cli("--model=user_models:gpt", *hardware, env=env)
    assert text.returncode == 2 and "Pass input_shapes={'token_ids': (128,)}" in text.stderr
    short = _cli("--model=user_models:gpt", "--input_shape=token_ids:8", *hardware, env=env)
    long = _cli("--model=user_models:gpt", "--input_shape=16", *hardware, env=env)
    assert short.returncode == 0 and long.returncode == 0, short.stderr + long.stderr
    assert short.stderr == "", short.stderr  # the user's module imports keras first
    f_short = json.loads(short.stdout)["model"]["forward_flops_per_example"]
    f_long = json.loads(long.stdout)["model"]["forward_flops_per_example"]
    assert 2.0 < f_long / f_short < 2.3  # 16 tokens: twice the position-wise work, more attention
    saved = tmp_path / "m.keras"
    run_python("-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import user_models; "
                     f"user_models.gpt().save({str(saved)!r})", timeout=100)
    from_file = _cli(f"--model={saved}", "--input_shape=token_ids:8", *hardware)
    assert from_file.returncode == 0, from_file.stderr
    assert json.loads(from_file.stdout)["model"]["forward_flops_per_example"] == f_short
    app = _cli("--model=MobileNetV3Small", "--input_shape=32,32,3", "--num_classes=4", *hardware)
    assert app.returncode == 0, app.stderr
    assert json.loads(app.stdout)["model"]["num_params"] > 400_000


@pytest.mark.parametrize("args, message", [
    (["--params=1e6", "--cluster={\"machines\": 2, devices}"],
     "--cluster is not valid JSON (Expecting property name enclosed in double quotes"),
    (["--params=1e6", '--cluster={"devices": 2, "memory": "8GB"}'],
     "Unknown key(s) in the cluster description: memory."),
    (["--params=1e6", '--cluster={"devices": 2}'], "The cluster description needs device_memory"),
    (["--params=1e6", "--devices=2", "--device_memory=80XB", "--bandwidth=1GB/s"],
     "device_memory must be a size such as 80GB"),
    (["--params=1e6", "--devices=2", "--device_memory=8GB"],
     "2 devices per machine need the bandwidth between them"),
    (["--params=1e6", "--devices=2", "--device_memory=8GB", "--bandwidth=-1Gbps"],
     "bandwidth must be a rate such as 25Gbps"),
    (["--params=1e6", "--machines=2", "--device_memory=8GB"], "2 machines need network_bandwidth"),
    (["--params=1e6", "--devices=4"], "--device_memory is required when describing other hardware"),
    (["--params=lots", "--devices=1", "--device_memory=1GB"],
     "params must be a positive number such as 7e9"),
    ([], "Pass exactly one of --model=NAME (from models/) or --params=N."),
    (["--model=resnet"], "Unknown model 'resnet'. Give an example model (mlp, cnn, transformer)"),
    (["--params=1e6", "--devices=2", "--device_memory=1e400GB", "--bandwidth=1GB/s"],
     "device_memory must be a finite number such as 80GB; '1e400GB' is too large"),
    (["--params=1e400"], "params must be a finite number"),
    (["--model=missing.keras"], "--model=missing.keras: no such file"),
    (["--model=os:getcwd"], "--model=os:getcwd gave str, not a keras.Model"),
    (["--model=no_such_module_x:build"], "cannot import module 'no_such_module_x'"),
    (["--model=mlp", "--input_shape=ids:0"], "input_shape per input must be name:dims"),
    (["--params=10", "--input_shape=8"], "--input_shape goes with --model"),
    (["--model=mlp", "--input_shape=28,x"], "input_shape must be positive integers"),
    (["--model=mlp", "--params=10"], "Pass exactly one of --model=NAME"),
])
def test_cli_bad_input_is_a_clear_error(args, message):
    result = _cli(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


# --- variants: sharding, offload, gradient compression ------------------------------------


def _four_gpus(memory="32GB"):
    return planning.Machine(device=planning.Device(memory=planning.parse_bytes(memory)),
                            num_devices=4, link=planning.Link(bandwidth=100e9))


def test_variants_are_costed_and_only_available_ones_recommended(monkeypatch):
    """A 2B-parameter Adam model: the replica (8 GB of weights, 8 of gradients, 16 of slots
    and 8 of the all-reduce's pack) does not fit 32 GB, but with the optimizer slots sharded
    over 4 it does (28 GB)."""
    stats = planning.ModelStats.from_param_count(2 * 10**9)
    monkeypatch.setattr(planner, "variant_available", lambda preset, variant: False)
    plan = tfdist.plan(stats=stats, global_batch_size=64, machine=_four_gpus())
    zero1 = plan.candidate_named("mirrored[shard=optimizer]")
    assert zero1.fits and not zero1.registered
    assert zero1.memory.optimizer == math.ceil(2 * stats.trainable_bytes / 4) + 12
    assert plan.recommended == "split"  # the sharding option is not installed here
    assert any("Would fit with mirrored[shard=optimizer]" in r for r in plan.reasons)
    # Once the preset accepts the option, the cheapest variant that fits is recommended.
    monkeypatch.setattr(planner, "variant_available",
                        lambda preset, variant: dict(variant.options).get("shard") is not None)
    plan = tfdist.plan(stats=stats, global_batch_size=64, machine=_four_gpus())
    # ZeRO-2 fits too, with the plain ring's traffic; ZeRO-1 adds an all-gather (1.5x).
    assert (plan.recommended, plan.recommended_options) == ("mirrored",
                                                            (("shard", "gradients"),))
    assert "tfdist.make_strategy('mirrored', shard='gradients')" in plan.reasons[-1]
    plain = plan.candidate("mirrored").communication_bytes
    assert zero1.communication_bytes == 1.5 * plain
    assert plan.candidate_named("mirrored[shard=gradients]").communication_bytes == plain
    zero3 = plan.candidate_named("mirrored[shard=parameters]")
    assert zero3.communication_bytes == 1.5 * plain
    assert zero3.memory.parameters < zero1.memory.parameters
    offload = plan.candidate_named("mirrored[shard=gradients,offload=optimizer]")
    assert offload.memory.optimizer == 12  # only the scalars stay on the device
    bf16 = plan.candidate_named("mirrored[gradient_compression=bf16]")
    assert bf16.communication_bytes == plan.candidate("mirrored").communication_bytes / 2


def test_variant_availability_reads_the_installed_presets():
    for variant in planner.VARIANTS:
        assert not planner.variant_available("default", variant)
    available = {v.options: planner.variant_available("mirrored", v) for v in planner.VARIANTS}
    from tfdist import config

    fields = {f.name for f in dataclasses.fields(config.MirroredOptions)}
    for options, ok in available.items():
        if ok:
            assert {k for k, _ in options} <= fields


def test_sequence_parallel_is_recommended_when_activations_do_not_fit():
    """A transformer whose weights fit but whose activations for one long sequence do not
    (the batch cannot shrink further over replicas): cutting the sequence over 4 devices
    divides them by 4."""
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    ids = keras.Input((256,), dtype="int32")
    x = keras.layers.Embedding(100, 64)(ids)
    for _ in range(2):
        x = x + keras.layers.MultiHeadAttention(4, 16)(x, x)
        x = keras.layers.LayerNormalization()(x)
    model = keras.Model(ids, keras.layers.Dense(100)(x))
    stats = planning.model_stats(model)
    need = planning.replica_memory(stats, per_replica_batch_size=1, optimizer="adam")
    memory = int(need.state + need.activations / 3)  # fits only with activations / 4
    machine = planning.Machine(device=planning.Device(memory=memory), num_devices=4,
                               link=planning.Link(bandwidth=100e9))
    plan = tfdist.plan(stats=stats, global_batch_size=1, machine=machine)
    assert (plan.recommended, plan.recommended_options) == ("default",
                                                            (("sequence_parallel", "4"),))
    sp = plan.candidate_named("default[sequence_parallel=4]")
    assert sp.memory.activations == math.ceil(need.activations / 4)
    assert "tfdist.split.sequence_parallel(model" in plan.reasons[-1]


def test_compression_is_recommended_only_where_the_exchange_dominates_the_step():
    # 1e8 parameters (400 MB of fp32 gradients) on 4 devices with a 1 GB/s link: the ring
    # moves 2 x 3/4 x 400 MB = 600 MB per rank (0.6 s), more than the replica's compute.
    slow = _node(num_devices=4, bandwidth="1GB/s", flops=1e14)
    plan = tfdist.plan(stats=_stats(1e8, flops=5e11), global_batch_size=64, machine=slow)
    plain = plan.candidate("mirrored")
    assert plain.communication_time > plain.compute_time
    assert plain.step_time < plan.candidate("default").step_time
    method = dict(plan.recommended_options).get("gradient_compression")
    assert plan.recommended == "mirrored" and method in ("bf16", "fp16")
    chosen = plan.recommended_candidate
    assert chosen.communication_bytes == plain.communication_bytes / 2
    assert chosen.step_time < plain.step_time
    assert any(f"gradient_compression={method!r}" in r and "Compress the gradients" in r
               for r in plan.reasons)
    # Compute-bound (the same model with 1e11 FLOPs per example): plain all-reduce.
    plan = tfdist.plan(stats=_stats(1e8, flops=1e11), global_batch_size=64,
                       machine=_node(num_devices=4, flops=1e14))
    assert plan.recommended == "mirrored" and plan.recommended_options == ()
    # No compute estimate (no device peak): the share is unknown, nothing is compressed.
    plan = tfdist.plan(stats=_stats(1e8), global_batch_size=64,
                       machine=_node(num_devices=4, bandwidth="1GB/s"))
    assert plan.recommended == "mirrored" and plan.recommended_options == ()
