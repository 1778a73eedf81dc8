"""Sharding's pure parts (no strategy needed): layout, options, flags, the cost formula.

The compat checks run the fixes' shape checks against the installed Keras
and TensorFlow without installing anything; the canary runs in a fresh
process. Training end to end: tests/sharding/test_training.py.
"""

import pytest

from tfdist import config as config_lib
from tfdist import planning
from tfdist.sharding import layout as layout_lib


@pytest.mark.parametrize("shape, shards, size, padded", [
    ((10,), 4, 3, 12), ((8, 4), 4, 8, 32), ((3,), 4, 1, 4), ((7, 3), 1, 21, 21)])
def test_layout_cuts_equal_padded_shards(shape, shards, size, padded):
    layout = layout_lib.ShardLayout(shape, shards)
    assert (layout.shard_size, layout.padded_size) == (size, padded)
    assert layout.shard_range(0) == (0, size)
    assert layout.shard_range(shards - 1) == ((shards - 1) * size, padded)
    with pytest.raises(ValueError, match=r"rank must be in \[0, "):
        layout.shard_range(shards)


def test_small_variables_stay_replicated():
    assert layout_lib.is_sharded((128, 128), 4, min_bytes=65536)      # 64 KiB: sharded
    assert not layout_lib.is_sharded((128, 127), 4, min_bytes=65536)  # just below
    assert layout_lib.is_sharded((1,), 4, min_bytes=0)                # 0: everything
    assert layout_lib.sharded_elements([10, 3], 4) == 3 + 1


def test_options_default_to_no_sharding_and_validate():
    for cls in (config_lib.MirroredOptions, config_lib.MultiWorkerMirroredOptions):
        options = cls()
        assert (options.shard, options.offload) == ("none", "none")
        assert options.shard_min_bytes == config_lib.DEFAULT_SHARD_MIN_BYTES
        assert cls(shard="parameters", offload="optimizer").offload == "optimizer"
    with pytest.raises(ValueError, match=r"shard must be one of none, optimizer, gradients, "
                                         r"parameters. Received: shard='zero3'"):
        config_lib.MirroredOptions(shard="zero3")
    with pytest.raises(ValueError, match=r"needs sharding. Received: shard='none', "
                                         r"offload='optimizer'. Add shard="):
        config_lib.MirroredOptions(offload="optimizer")
    with pytest.raises(ValueError, match=r"offload must be one of none, optimizer"):
        config_lib.MultiWorkerMirroredOptions(shard="optimizer", offload="cpu")
    with pytest.raises(ValueError, match=r"shard_min_bytes must be an integer >= 0 .* "
                                         r"Received: shard_min_bytes=-1"):
        config_lib.MirroredOptions(shard="optimizer", shard_min_bytes=-1)
    assert config_lib.MirroredOptions().shard_remat is True
    assert not config_lib.MirroredOptions(shard="parameters", shard_remat=False).shard_remat
    with pytest.raises(ValueError, match=r"only applies to shard='parameters' .* Received: "
                                         r"shard='gradients', shard_remat=False. Fix: "):
        config_lib.MultiWorkerMirroredOptions(shard="gradients", shard_remat=False)
    with pytest.raises(ValueError, match=r"shard_remat must be True or False. Received: "
                                         r"shard_remat='no'"):
        config_lib.MirroredOptions(shard="parameters", shard_remat="no")


@pytest.mark.parametrize("preset, why", [
    ("parameter_server", "asynchronous workers"), ("default", "one replica"),
    ("one_device", "one replica"), ("auto", "name the preset")])
def test_shard_on_a_preset_without_synchronous_replicas_is_refused(preset, why):
    from tfdist import strategies

    with pytest.raises(ValueError) as error:
        strategies.make_options(preset, shard="optimizer")
    text = str(error.value)
    assert f"Unknown option(s) for preset '{preset}': shard." in text
    assert "only mirrored, multi_worker_mirrored take it" in text and why in text
    assert "Use --strategy=mirrored" in text


def test_shard_flags_come_from_the_options():
    from absl import flags

    import tfdist.flags

    values = flags.FlagValues()
    tfdist.flags.define_flags(values)
    assert values["shard"].parser.enum_values == ["none", "optimizer", "gradients",
                                                  "parameters"]
    assert values["offload"].parser.enum_values == ["none", "optimizer"]
    values(["prog", "--strategy=mirrored", "--shard=gradients", "--shard_min_bytes=0"])
    options = tfdist.flags.strategy_options_from_flags(values)
    assert (options.shard, options.shard_min_bytes) == ("gradients", 0)
    values = flags.FlagValues()
    tfdist.flags.define_flags(values)
    values(["prog", "--strategy=mirrored", "--shard=parameters", "--noshard_remat"])
    assert tfdist.flags.strategy_options_from_flags(values).shard_remat is False
    values = flags.FlagValues()
    tfdist.flags.define_flags(values)
    values(["prog", "--strategy=parameter_server", "--shard=optimizer"])
    with pytest.raises(flags.ValidationError,
                       match=r"--shard is an option of .*mirrored.*not of "
                             r"--strategy=parameter_server"):
        tfdist.flags.strategy_options_from_flags(values)


def test_sharded_state_bytes_by_hand():
    # fp32, N = 4, min 100 bytes: 10 elements (40 B) stay whole; 100 and 1000 elements are
    # split into 25 and 250 per replica. s = 275*4 = 1100, w = 1100*4 = 4400, r = 40.
    adam = planning.OptimizerState(name="adam", slots_per_variable=2, scalar_bytes=12)
    sizes = [10, 100, 1000]

    def state(stage, offload=False):
        b = planning.sharded_state_bytes(sizes, stage=stage, num_shards=4, optimizer=adam,
                                         min_shard_bytes=100, offload=offload)
        return b.parameters, b.gradients, b.optimizer, b.offloaded

    assert state(0) == (4440, 4440, 2 * 4440 + 12, 0)
    assert state(1) == (4440, 4440, 2 * 1140 + 12, 0)
    assert state(2) == (4440, 1140, 2 * 1140 + 12, 0)
    assert state(3) == (1140, 1140, 2 * 1140 + 12, 0)
    assert state(2, offload=True) == (4440, 1140, 2 * 40 + 12, 2 * 1100)


@pytest.mark.parametrize("stage, per_param", [(0, 16), (1, 8 + 8 / 4), (2, 4 + 12 / 4),
                                              (3, 16 / 4)])
def test_fp32_adam_bytes_per_parameter(stage, per_param):
    adam = planning.OptimizerState(name="adam", slots_per_variable=2, scalar_bytes=0)
    total = planning.sharded_state_bytes([4000], stage=stage, num_shards=4, optimizer=adam).total
    assert total / 4000 == per_param


def test_sharded_state_bytes_rejects_bad_input():
    with pytest.raises(ValueError, match=r"stage must be 0, 1, 2 or 3. Received: stage=4"):
        planning.sharded_state_bytes([10], stage=4, num_shards=2)
    with pytest.raises(ValueError, match=r"num_shards must be"):
        planning.sharded_state_bytes([10], stage=1, num_shards=0)
    with pytest.raises(ValueError, match=r"needs stage >= 1. Received: stage=0, offload=True"):
        planning.sharded_state_bytes([10], stage=0, num_shards=2, offload=True)


def test_compat_fixes_match_this_keras_and_tensorflow():
    from tfdist.compat import _patch, sharding_collectives, sharding_variables

    sharding_collectives.check_supported()
    for fix in sharding_variables.FIXES:
        owner, attribute = fix.target()
        fix.check(getattr(owner, attribute))
        assert fix.name not in _patch.installed() or fix.name.startswith("sharding")
    with pytest.raises(_patch.CompatError):
        sharding_variables.SLOT_FIX.check(lambda self, reference_variable, name: None)


_CANARY = """
import tfdist
tfdist.configure_logical_devices(2)
tf = tfdist.import_tensorflow()
from tensorflow.python.ops import gen_collective_ops
from tfdist.compat import sharding_collectives as c
s = tfdist.make_strategy("mirrored", num_devices=2)
ops = c._collective_ops(s)

def step():
    launcher = ops._launchers[c.local_replica_id()]
    with tf.device(launcher._device):
        return gen_collective_ops.collective_reduce_scatter_v2(
            tf.ones([4]), group_size=2, group_key=launcher._group_key,
            instance_key=launcher._next_instance_key(),
            ordering_token=[launcher._get_ordering_token()], merge_op="Add", final_op="Id")

try:
    tf.function(lambda: s.run(step))()
    print("REDUCE_SCATTER_WORKS")
except Exception as e:
    print("REDUCE_SCATTER_FAILS", type(e).__name__, str(e).splitlines()[0])
"""


@pytest.mark.slow
def test_canary_tensorflow_has_no_cpu_reduce_scatter():
    # Why tfdist builds reduce-scatter from an all-to-all (tfdist.compat.sharding_collectives).
    # If this starts working, CollectiveReduceScatterV2 can replace the all-to-all.
    from tests.support import run_python

    result = run_python("-c", _CANARY, timeout=120)
    assert "REDUCE_SCATTER_FAILS" in result.stdout, result.stdout + result.stderr[-2000:]
    assert "did not find collective implementation" in result.stdout


def test_gatherable_layers_name_real_classes_and_match_by_class():
    # Which layers run under keras.remat at stage 3 (the others keep their gathered weights
    # until their backward pass). Every KerasHub name is a class of the installed KerasHub;
    # Gemma's own RMSNormalization (not Keras's) is matched, Keras's by class, a subclass too.
    import importlib

    import keras

    from tests import zoo
    from tfdist import sharding
    from tfdist.sharding import registry

    names = sharding.gatherable_layers()
    assert "keras.layers.RMSNormalization" in names
    assert "keras_hub.src.models.gemma.rms_normalization.RMSNormalization" in names
    assert registry.is_gatherable(keras.layers.Dense(2))

    class Scaled(keras.layers.Dense):
        pass

    class Impure(keras.layers.Layer):
        pass

    assert registry.is_gatherable(Scaled(2))
    assert not registry.is_gatherable(Impure())
    assert not registry.is_gatherable(keras.layers.BatchNormalization())
    with pytest.raises(ValueError, match=r"takes a layer class\. Received: .*Fix: pass"):
        sharding.register_gatherable_layer(Impure())
    if not zoo.AVAILABLE:
        pytest.skip(zoo.SKIP_REASON)
    for name in names:
        if name.startswith("keras_hub."):
            module, _, cls = name.rpartition(".")
            layer_class = getattr(importlib.import_module(module), cls)
            assert issubclass(layer_class, keras.layers.Layer), name
    from keras_hub.src.models.gemma.rms_normalization import RMSNormalization

    assert registry.is_gatherable(RMSNormalization())
    assert not issubclass(RMSNormalization, keras.layers.RMSNormalization)
