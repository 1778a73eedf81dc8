"""Training monitor: throughput, step time and device memory, per epoch.

    monitor = tfdist.callbacks.ThroughputMonitor(global_batch_size=256, log_dir="logs/run1")
    history = model.fit(dataset, epochs=3, callbacks=[monitor])
    history.history["samples_per_sec"]     # one value per epoch

The numbers are added to the epoch's `logs` (so `History`, the progress bar,
`CSVLogger` and Keras's own TensorBoard callback see them) and, with
`log_dir`, written as TensorBoard scalars under `tfdist/`. Memory comes from
`tf.config.experimental.get_memory_info`, which GPUs report. CPUs report it
only where TensorFlow's CPU allocator keeps statistics: where oneDNN is on
(by default on CPUs with AVX-512 VNNI/BF16, AVX-VNNI or AMX) or with
TF_CPU_ALLOCATOR_USE_BFC=1 set before TensorFlow starts; logical CPUs share
one allocator, so they show the same number. Devices that raise (e.g. the
CPU of an AMD EPYC without AVX-512) are skipped, with the reason in
`unreported_devices`.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

from tfdist import devices as devices_lib
from tfdist._tf import import_tensorflow

tf = import_tensorflow()
import keras  # noqa: E402  (after TensorFlow's quiet import)

MemoryInfoFn = Callable[[str], dict[str, int]]


class ThroughputMonitor(keras.callbacks.Callback):
    """Reports samples/s, step time and memory in use per device, each epoch.

    Logged per epoch (keys of `logs` and TensorBoard scalars `tfdist/<key>`):
      samples_per_sec: global_batch_size x steps / epoch wall time (the last
        batch of an epoch may be smaller, so this can overstate by one
        partial batch per epoch);
      step_time_ms: median wall time of one training step (with
        `steps_per_execution=k`, of a k-step call divided by k);
      memory_mb/<device>, peak_memory_mb/<device>: current and peak memory
        in use, for devices that report it, in MiB.

    Args:
      global_batch_size: examples per step over all replicas (> 0).
      log_dir: write TensorBoard scalars here (None: only `logs`).
      devices: device names to query for memory, e.g. ("GPU:0",); default:
        the model's distribution strategy's devices.
      memory_info: replaces `tf.config.experimental.get_memory_info` (tests).

    Raises:
      ValueError: a non-positive global batch.
    """

    def __init__(self, *, global_batch_size: int, log_dir: str | None = None,
                 devices: tuple[str, ...] | None = None,
                 memory_info: MemoryInfoFn | None = None):
        super().__init__()
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) \
                or global_batch_size < 1:
            raise ValueError(f"global_batch_size must be an integer >= 1. "
                             f"Received: global_batch_size={global_batch_size!r}")
        self.global_batch_size = global_batch_size
        self.log_dir = log_dir
        self._devices = None if devices is None else tuple(devices)
        self._memory_info = memory_info or tf.config.experimental.get_memory_info
        self._writer = None
        self.reporting_devices: tuple[str, ...] = ()
        self.unreported_devices: dict[str, str] = {}
        self.epochs: list[dict[str, float]] = []
        self._step_times: list[float] = []
        self._steps = 0
        self._batch_start = 0.0
        self._batch_first_step = 0
        self._epoch_start = 0.0

    # --- keras hooks ------------------------------------------------------------

    def on_train_begin(self, logs=None):
        devices = self._devices
        if devices is None:
            devices = _strategy_devices(getattr(self.model, "distribute_strategy", None)
                                        or tf.distribute.get_strategy())
        reporting, self.unreported_devices = [], {}
        for device in devices:
            name = devices_lib.short_device_name(device)
            try:
                self._memory_info(name)
            except (ValueError, tf.errors.OpError, RuntimeError) as error:
                self.unreported_devices[name] = str(error).splitlines()[0] if str(error) else \
                    type(error).__name__
            else:
                reporting.append(name)
        self.reporting_devices = tuple(reporting)
        if self.log_dir is not None and self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_epoch_begin(self, epoch, logs=None):
        self._step_times = []
        self._steps = 0
        self._epoch_start = time.perf_counter()

    def on_train_batch_begin(self, batch, logs=None):
        self._batch_first_step = batch
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        elapsed = time.perf_counter() - self._batch_start
        steps = max(1, batch - self._batch_first_step + 1)  # steps_per_execution > 1
        self._steps += steps
        self._step_times.append(elapsed / steps)

    def on_epoch_end(self, epoch, logs=None):
        wall = time.perf_counter() - self._epoch_start
        values: dict[str, float] = {}
        if self._steps and wall > 0:
            values["samples_per_sec"] = self._steps * self.global_batch_size / wall
            values["step_time_ms"] = statistics.median(self._step_times) * 1e3
        for device in self.reporting_devices:
            try:
                info = self._memory_info(device)
            except (ValueError, tf.errors.OpError, RuntimeError):
                continue
            values[f"memory_mb/{device}"] = info.get("current", 0) / 2**20
            values[f"peak_memory_mb/{device}"] = info.get("peak", 0) / 2**20
        if logs is not None:
            logs.update(values)
        self.epochs.append(dict(values))
        if self._writer is not None:
            with self._writer.as_default():
                for key, value in values.items():
                    _write_scalar(f"tfdist/{key}", value, step=epoch)
            self._writer.flush()

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _write_scalar(tag: str, value: float, *, step: int) -> None:
    """A TensorBoard scalar without needing the tensorboard package.

    `tf.summary.scalar` raises TBNotInstalledError when tensorboard is not
    installed (it is not a TensorFlow dependency); the raw `tf.summary.write`
    with the scalars plugin's metadata writes the same event.
    """
    metadata = tf.compat.v1.SummaryMetadata()
    metadata.plugin_data.plugin_name = "scalars"
    tf.summary.write(tag, tf.constant(value, tf.float32), step=step, metadata=metadata)


def _strategy_devices(strategy) -> tuple[str, ...]:
    """The devices a strategy computes on; the default strategy's is the first GPU, else CPU:0."""
    try:
        devices = tuple(strategy.extended.worker_devices)
    except (RuntimeError, AttributeError, NotImplementedError):
        devices = ()
    if devices:
        return devices
    gpus = tf.config.list_logical_devices("GPU")
    return (gpus[0].name if gpus else "CPU:0",)
