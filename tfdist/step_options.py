"""Per-step knobs under any preset: mixed precision, steps_per_execution, XLA.

    options = tfdist.StepOptions(mixed_precision="mixed_bfloat16", steps_per_execution=8)
    tfdist.step_options.check(options, strategy)
    with strategy.scope(), tfdist.step_options.dtype_policy(options):
        model = build_model()
    model.compile(tfdist.step_options.optimizer(keras.optimizers.Adam(), options), loss,
                  **tfdist.step_options.compile_arguments(options))

Model Garden's flags --dtype, --loss_scale, --enable_xla and --steps_per_loop,
as one validated options object. What TensorFlow + Keras 3.15 cannot run is
refused before training with the reason, instead of failing inside the first
step with a graph error (see `check`). `steps_per_execution > 1` with several
replicas needs tfdist.compat.keras_multi_step (keras-team/keras#19246), which
`make_strategy` installs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from tfdist import config as config_lib

# Combinations TensorFlow cannot run, by strategy type.
_SYNC_XLA = (
    "jit_compile=True with several synchronous replicas on CPUs fails at the first step "
    "(MirroredStrategy: InvalidArgumentError; MultiWorkerMirroredStrategy: "
    "UnimplementedError): XLA cannot compile the replicas' collective all-reduce on the CPU")


def check(options: config_lib.StepOptions, strategy: Any) -> None:
    """Raises ValueError for a knob `strategy` cannot run, naming the fix.

    Checked against TensorFlow 2.21 + Keras 3.15 (tests/core/test_step_options.py and
    tests/comm/test_compression.py trains each combination under mirrored, multi_worker_mirrored and
    parameter_server).
    """
    if options.jit_compile and not xla_can_compile(strategy):
        raise ValueError(
            f"{_SYNC_XLA}. Received: jit_compile=True on "
            f"{', '.join(strategy.extended.worker_devices)}. Drop jit_compile, or use "
            "parameter_server, where XLA compiles each worker's step.")


def xla_can_compile(strategy: Any) -> bool:
    """False where XLA cannot compile a training step: several synchronous replicas on CPUs.

    MirroredStrategy over CPUs fails at the first step with "Trying to access
    resource ... located in device CPU:1 from device CPU:0";
    MultiWorkerMirroredStrategy on CPUs with "Collectives are not yet
    implemented for CPU devices when compiling with XLA". On GPUs, and with one
    replica, XLA compiles the step.
    """
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    synchronous = isinstance(strategy, (tf.distribute.MirroredStrategy,
                                        tf.distribute.MultiWorkerMirroredStrategy))
    if not synchronous or strategy.num_replicas_in_sync < 2:
        return True
    return all("GPU" in d.upper() for d in strategy.extended.worker_devices)


@contextlib.contextmanager
def dtype_policy(options: config_lib.StepOptions) -> Iterator[None]:
    """Builds models inside with the options' Keras dtype policy; restores the previous one."""
    import keras

    previous = keras.config.dtype_policy()
    if options.mixed_precision != "none":
        keras.config.set_dtype_policy(options.mixed_precision)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def optimizer(base: Any, options: config_lib.StepOptions) -> Any:
    """`base`, wrapped for dynamic loss scaling when mixed_float16 asks for it.

    Keras's `compile` wraps a mixed_float16 model's optimizer itself with the
    default scale; this wraps it first when `loss_scale` sets the initial scale.
    """
    if options.mixed_precision != "mixed_float16" or options.loss_scale is None:
        return base
    import keras

    return keras.optimizers.LossScaleOptimizer(base, initial_scale=float(options.loss_scale))


def compile_arguments(options: config_lib.StepOptions) -> dict[str, Any]:
    """Keyword arguments for `model.compile`: steps_per_execution and jit_compile."""
    return {"steps_per_execution": options.steps_per_execution,
            "jit_compile": options.jit_compile}
