"""Flags are generated from the presets' options and validated per preset."""

import pytest
from absl import flags

from tfdist import config
from tfdist import flags as tfdist_flags


@pytest.fixture
def flag_values():
    values = flags.FlagValues()
    tfdist_flags.define_flags(values)
    tfdist_flags.define_training_flags(values)
    return values


def test_every_preset_option_is_a_flag(flag_values):
    from tfdist import strategies

    for name in strategies.available_presets():
        for option in strategies.get_preset(name).options.option_names():
            assert option in flag_values, option


def test_flags_build_the_chosen_presets_options(flag_values):
    flag_values(["prog", "--strategy=mirrored", "--devices=/cpu:0,/cpu:1",
                 "--cross_device_ops=reduction_to_one_device"])
    options = tfdist_flags.strategy_options_from_flags(flag_values)
    assert options == config.MirroredOptions(devices=("/cpu:0", "/cpu:1"),
                                             cross_device_ops="reduction_to_one_device")


def test_defaults_come_from_the_preset(flag_values):
    flag_values(["prog"])
    assert tfdist_flags.strategy_options_from_flags(flag_values) == config.MirroredOptions()
    assert flag_values.global_batch_size == 64


def test_option_of_another_preset_is_an_error(flag_values):
    flag_values(["prog", "--strategy=one_device", "--num_devices=2"])
    with pytest.raises(flags.ValidationError, match="--num_devices is an option of mirrored, "
                                                    "not of --strategy=one_device"):
        tfdist_flags.strategy_options_from_flags(flag_values)


def test_bad_option_value_is_a_flag_error(flag_values):
    flag_values(["prog", "--devices=/cpu:0,/cpu:0"])
    with pytest.raises(flags.ValidationError, match="more than once"):
        tfdist_flags.strategy_options_from_flags(flag_values)


@pytest.mark.parametrize("argv", [["--strategy=mirroed"], ["--cross_device_ops=fast"],
                                  ["--logical_devices=0"], ["--global_batch_size=0"]])
def test_bad_values_fail_at_parse_time(flag_values, argv):
    with pytest.raises(flags.IllegalFlagValueError):
        flag_values(["prog", *argv])
