"""absl flags for tfdist: the only library module that touches absl.flags.

Preset flags are generated from the presets' options dataclasses, so every
option of every registered preset is a flag with the same name, type and
help text, and a new preset's options become flags without extra code:

    from absl import app
    import tfdist.flags

    tfdist.flags.define_flags()

    def main(argv):
        options = tfdist.flags.strategy_options_from_flags()
        strategy = tfdist.make_strategy(options)

Only flags given on the command line are passed to the chosen preset; a
flag given for an option the preset does not take is an error, not silently
ignored.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, get_args, get_origin

from absl import flags

from tfdist import config as config_lib
from tfdist import strategies

FLAGS = flags.FLAGS

# flag name -> (python type kind, presets that take it)
_PRESET_FLAGS: dict[str, set[str]] = {}


def _unwrap_optional(tp):
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _define_typed_flag(name: str, tp: Any, default: Any, help_text: str,
                       flag_values: flags.FlagValues, where: str) -> None:
    """Defines --name with the absl flag type matching the option's Python type `tp`."""
    tp = _unwrap_optional(tp)
    if get_origin(tp) is Literal:
        flags.DEFINE_enum(name, default, [str(a) for a in get_args(tp)], help_text,
                          flag_values=flag_values)
    elif tp is bool:
        flags.DEFINE_bool(name, default, help_text, flag_values=flag_values)
    elif tp is int:
        flags.DEFINE_integer(name, default, help_text, flag_values=flag_values)
    elif tp is float:
        flags.DEFINE_float(name, default, help_text, flag_values=flag_values)
    elif get_origin(tp) is tuple:
        flags.DEFINE_list(name, default, help_text, flag_values=flag_values)
    elif tp is str:
        flags.DEFINE_string(name, default, help_text, flag_values=flag_values)
    else:
        raise TypeError(f"No flag type for option {where}.{name}: {tp!r}")


def _define_option_flag(field: dataclasses.Field, hints: dict[str, Any], preset: str,
                        flag_values: flags.FlagValues) -> None:
    name = field.name
    help_text = field.metadata.get("help", f"Option '{name}' of the {preset} preset.")
    if name in flag_values:
        if name in _PRESET_FLAGS:
            _PRESET_FLAGS[name].add(preset)
        return
    # default None: absent means the preset's own default.
    _define_typed_flag(name, hints[name], None, help_text, flag_values, preset)
    _PRESET_FLAGS[name] = {preset}


def _define_dataclass_flags(options_cls: type, flag_values: flags.FlagValues) -> None:
    """One flag per field of `options_cls` (SplitOptions, StepOptions), with its default."""
    hints = typing.get_type_hints(options_cls)
    for field in dataclasses.fields(options_cls):
        if field.name not in flag_values:
            _define_typed_flag(field.name, hints[field.name], field.default,
                               field.metadata["help"], flag_values, options_cls.__name__)


def _dataclass_from_flags(options_cls: type, flag_values: flags.FlagValues) -> Any:
    try:
        return options_cls(**{f.name: flag_values[f.name].value
                              for f in dataclasses.fields(options_cls)})
    except ValueError as e:
        raise flags.ValidationError(str(e)) from None


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """Defines --strategy, --logical_devices and one flag per preset option.

    Safe to call twice (flags already defined are kept).
    """
    if "strategy" not in flag_values:
        flags.DEFINE_enum(
            "strategy", "mirrored", list(strategies.available_presets()),
            "Distribution preset: " + "; ".join(
                f"{p}: {strategies.get_preset(p).summary}" for p in strategies.available_presets()),
            flag_values=flag_values)
        flags.DEFINE_integer(
            "logical_devices", None,
            "Split this machine's CPU (or its first GPU with --logical_device_type=GPU) into N "
            "logical devices before TensorFlow starts, so multi-device presets run here.",
            lower_bound=1, flag_values=flag_values)
        flags.DEFINE_enum("logical_device_type", "CPU", ["CPU", "GPU"],
                          "Device type split by --logical_devices.", flag_values=flag_values)
    for preset in strategies.available_presets():
        options_cls = strategies.get_preset(preset).options
        hints = typing.get_type_hints(options_cls)
        for field in options_cls.option_fields():
            _define_option_flag(field, hints, preset, flag_values)


def strategy_options_from_flags(flag_values: flags.FlagValues = FLAGS
                                ) -> config_lib.PresetOptions:
    """The chosen preset's options, built from the flags given on the command line.

    Raises:
      flags.ValidationError: a flag for an option the chosen preset does not
        take, or an option value the preset rejects (with the fix).
    """
    preset = flag_values.strategy
    options_cls = strategies.get_preset(preset).options
    own = set(options_cls.option_names())
    given: dict[str, Any] = {}
    for name, presets in _PRESET_FLAGS.items():
        if not flag_values[name].present:
            continue
        if name not in own:
            raise flags.ValidationError(
                f"--{name} is an option of {', '.join(sorted(presets))}, not of "
                f"--strategy={preset}. Drop --{name} or pick one of those presets.")
        value = flag_values[name].value
        given[name] = tuple(value) if isinstance(value, list) else value
    try:
        return options_cls.from_kwargs(**given)
    except ValueError as e:
        raise flags.ValidationError(str(e)) from None


def apply_device_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """Configures logical devices from --logical_devices (call before any TF work)."""
    if flag_values.logical_devices is not None:
        from tfdist import devices

        devices.configure_logical_devices(flag_values.logical_devices,
                                          device_type=flag_values.logical_device_type)


def apply_verbosity(flag_values: flags.FlagValues = FLAGS) -> None:
    """Brings TensorFlow's C++ start-up logs back when --verbosity >= 1.

    Call first in main(), before anything imports TensorFlow (tfdist loads it
    lazily, so parsing flags does not).
    """
    import os

    if flag_values["verbosity"].value >= 1:
        os.environ["TFDIST_VERBOSE"] = "1"


def define_training_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """Defines the generic training flags shared by tfdist's entry points."""
    if "global_batch_size" in flag_values:
        return
    flags.DEFINE_integer(
        "global_batch_size", 64,
        "Examples per step over all replicas; each replica gets global_batch_size / replicas.",
        lower_bound=1, flag_values=flag_values)
    flags.DEFINE_integer("epochs", 20, "Training epochs.", lower_bound=1,
                         flag_values=flag_values)
    flags.DEFINE_integer("steps_per_epoch", None,
                         "Steps per epoch (default: one pass over the training set).",
                         lower_bound=1, flag_values=flag_values)
    flags.DEFINE_float("learning_rate", 1e-3, "Adam learning rate.", lower_bound=0.0,
                       flag_values=flag_values)
    flags.DEFINE_integer("seed", 0, "Seed for weights, data order and dropout.",
                         flag_values=flag_values)
    flags.DEFINE_string("model_dir", None,
                        "Directory for TensorBoard logs (logs/) and the saved model "
                        "(model.keras). Default: write nothing.", flag_values=flag_values)
    flags.DEFINE_string("metrics_out", None,
                        "Write a JSON summary of the run (preset, replicas, batch, history, "
                        "held-out accuracy, samples/s, wall time) to this file.",
                        flag_values=flag_values)


# --- model splitting ------------------------------------------------------------------------
def define_split_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """Defines --split, --stages, --micro_batches, --split_balance, --sequence_parallel.

    Safe to call twice.
    """
    _define_dataclass_flags(config_lib.SplitOptions, flag_values)


def split_options_from_flags(flag_values: flags.FlagValues = FLAGS) -> config_lib.SplitOptions:
    """SplitOptions from the split flags.

    Raises:
      flags.ValidationError: an invalid combination, with the fix.
    """
    return _dataclass_from_flags(config_lib.SplitOptions, flag_values)


# --- per-step knobs (mixed precision, steps_per_execution, XLA) ------------------------------
def define_step_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """Defines --mixed_precision, --loss_scale, --steps_per_execution, --jit_compile.

    Generated from `tfdist.StepOptions`; safe to call twice.
    """
    _define_dataclass_flags(config_lib.StepOptions, flag_values)


def step_options_from_flags(flag_values: flags.FlagValues = FLAGS) -> config_lib.StepOptions:
    """StepOptions from the step flags.

    Raises:
      flags.ValidationError: an invalid value or combination, with the fix.
    """
    return _dataclass_from_flags(config_lib.StepOptions, flag_values)
