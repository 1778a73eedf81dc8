"""Pure option validation: no TensorFlow runtime needed."""

import pytest

from tfdist import config, strategies


def test_per_replica_batch_matches_the_seeds_example():
    assert config.per_replica_batch_size(512, 8) == 64
    assert config.per_replica_batch_size(64, 1) == 64


@pytest.mark.parametrize("global_batch, replicas, fragment", [
    (63, 2, "Received: global_batch_size=63. Use 62 or 64."),
    (3, 4, "Received: global_batch_size=3. Use 4 or 4."),
    (0, 2, "global_batch_size must be an integer >= 1. Received: global_batch_size=0"),
    (64, 0, "num_replicas must be an integer >= 1. Received: num_replicas=0"),
])
def test_per_replica_batch_rejects_bad_input(global_batch, replicas, fragment):
    with pytest.raises(ValueError) as e:
        config.per_replica_batch_size(global_batch, replicas)
    assert fragment in str(e.value)


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"Unknown preset 'mirroed'. Valid presets: default, "
                                         r"one_device, mirrored"):
        strategies.make_options("mirroed")


def test_unknown_option_lists_the_presets_options():
    with pytest.raises(ValueError, match="Unknown option.*'mirrored': num_gpus. Valid options: "
                                         "devices, num_devices, cross_device_ops"):
        strategies.make_options("mirrored", num_gpus=2)
    with pytest.raises(ValueError, match="Valid options: \\(none\\)"):
        strategies.make_options("default", devices=("/cpu:0",))


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(num_devices=0), "num_devices must be an integer >= 1. Received: num_devices=0"),
    (dict(num_devices=True), "Received: num_devices=True"),
    (dict(devices=()), "devices must name at least one device"),
    (dict(devices=("/cpu:0", "/cpu:0")), "lists a device more than once"),
    (dict(devices=("cpu0",)), "Received: devices entry='cpu0'"),
    (dict(devices=("/cpu:0",), num_devices=1), "either devices or num_devices, not both"),
    (dict(cross_device_ops="allreduce"), "cross_device_ops must be one of auto, ring"),
])
def test_mirrored_options_reject_bad_values(kwargs, fragment):
    with pytest.raises(ValueError) as e:
        config.MirroredOptions(**kwargs)
    assert fragment in str(e.value)


def test_mirrored_options_accept_device_spellings():
    opts = config.MirroredOptions(
        devices="/cpu:0,/device:CPU:1,/job:localhost/replica:0/task:0/device:CPU:2")
    assert len(opts.devices) == 3
    assert config.OneDeviceOptions(device="/gpu:0").device == "/gpu:0"


def test_options_are_frozen():
    opts = config.MirroredOptions(num_devices=2)
    with pytest.raises(AttributeError):
        opts.num_devices = 4


def test_registry_rows_describe_needs():
    for name in strategies.available_presets():
        preset = strategies.get_preset(name)
        assert preset.summary and preset.needs and preset.options.preset == name
