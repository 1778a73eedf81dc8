"""Devices: logical devices, thread pools, and the one parser of device names.

Logical devices split one CPU (or GPU) into N so multi-device code runs
anywhere. TensorFlow only accepts this before its runtime initialises (the
first op, model or strategy); afterwards it raises a bare RuntimeError.
tfdist turns that into an error that says what to do.

Device names ("/cpu:0", "CPU:1", "/device:GPU:0",
"/job:worker/replica:0/task:1/device:GPU:0") are read here and nowhere else:
`check_device_name`, `parse_device_name`, `canonical_device`,
`short_device_name` and `task_index` need no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from tfdist._tf import import_tensorflow

DeviceType = Literal["CPU", "GPU"]

# "/cpu:0", "/gpu:1", "/device:CPU:0", "/job:worker/replica:0/task:1/device:GPU:0", "CPU:0".
_DEVICE_RE = re.compile(
    r"^(?:/job:(?P<job>[\w-]+)(?:/replica:(?P<replica>\d+))?(?:/task:(?P<task>\d+))?)?"
    r"(?:/?device:)?/?(?P<kind>cpu|gpu|tpu):(?P<index>\d+)$",
    re.IGNORECASE,
)


_TASK_RE = re.compile(r"^/job:[\w-]+(?:/replica:\d+)?/task:(\d+)(?:/|$)")


@dataclasses.dataclass(frozen=True)
class DeviceName:
    """A device name's parts: job, replica and task (None when absent), kind and index."""

    job: str | None
    replica: int | None
    task: int | None
    kind: str
    index: int


def check_device_name(device: str, *, what: str = "device") -> str:
    """Returns `device` (stripped) if it is a well-formed TensorFlow device name.

    Raises:
      ValueError: naming the received string and the expected form.
    """
    if not isinstance(device, str) or not _DEVICE_RE.match(device.strip()):
        raise ValueError(
            f"{what} must be a TensorFlow device name such as '/cpu:0' or "
            f"'/gpu:1' (or '/device:CPU:0'). Received: {what}={device!r}"
        )
    return device.strip()


def parse_device_name(device: str, *, what: str = "device") -> DeviceName:
    """'/job:worker/replica:0/task:1/device:GPU:0' -> DeviceName('worker', 0, 1, 'GPU', 0).

    Raises:
      ValueError: not a device name (see `check_device_name`).
    """
    match = _DEVICE_RE.match(check_device_name(device, what=what))
    number = lambda group: None if match.group(group) is None else int(match.group(group))  # noqa: E731
    return DeviceName(job=match.group("job"), replica=number("replica"), task=number("task"),
                      kind=match.group("kind").upper(), index=int(match.group("index")))


def canonical_device(device: str) -> str:
    """'/cpu:1', 'CPU:1', '/device:CPU:1' -> '/device:CPU:1'; a job prefix is kept.

    Raises:
      ValueError: not a device name.
    """
    device = check_device_name(device)
    match = re.search(r"(cpu|gpu|tpu):(\d+)$", device, re.IGNORECASE)
    prefix = device[: match.start()].rstrip("/")
    prefix = re.sub(r"/?device:?$", "", prefix, flags=re.IGNORECASE)
    return f"{prefix}/device:{match.group(1).upper()}:{int(match.group(2))}"


def short_device_name(device: str) -> str:
    """'/job:localhost/replica:0/task:0/device:GPU:1' -> 'GPU:1' (what get_memory_info takes).

    A string that is not a device name is returned as it is.
    """
    try:
        name = parse_device_name(device)
    except ValueError:
        return device
    return f"{name.kind}:{name.index}"


def task_index(device: str) -> int | None:
    """The task index in a device or task name ('/job:worker/replica:0/task:3[/...]' -> 3).

    A worker's name without a device part ('/job:worker/replica:0/task:3', what the
    parameter-server coordinator reports) counts; None when there is no task.
    """
    match = _TASK_RE.search(device) if isinstance(device, str) else None
    return None if match is None else int(match.group(1))


class RuntimeAlreadyInitializedError(RuntimeError):
    """Raised when devices or threads are configured after TensorFlow started."""


def _check_device_type(device_type: str) -> str:
    upper = str(device_type).upper()
    if upper not in ("CPU", "GPU"):
        raise ValueError(
            f"device_type must be 'CPU' or 'GPU'. Received: device_type={device_type!r}"
        )
    return upper


def configure_logical_devices(
    num_devices: int,
    *,
    device_type: DeviceType = "CPU",
    memory_limit_mb: int | None = None,
) -> list[str]:
    """Splits the first physical CPU (or GPU) into `num_devices` logical ones.

    Call it first thing in the process: before any TensorFlow op, Keras model
    or strategy. Calling it again with the same count is a no-op.

    Args:
      num_devices: how many logical devices to create (>= 1).
      device_type: "CPU" (default) or "GPU".
      memory_limit_mb: per logical GPU memory (required by TensorFlow for
        GPUs; default 1024 MB each). Ignored for CPUs.

    Returns:
      The logical device names, e.g. ["/device:CPU:0", "/device:CPU:1"].

    Raises:
      ValueError: num_devices < 1, or no physical device of that type.
      RuntimeAlreadyInitializedError: TensorFlow's runtime already started
        with a different device layout.

    Example:
      >>> import tfdist
      >>> tfdist.configure_logical_devices(2)
      ['/device:CPU:0', '/device:CPU:1']
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(
            f"logical_devices must be an integer >= 1. Received: logical_devices={num_devices!r}"
        )
    device_type = _check_device_type(device_type)
    tf = import_tensorflow()
    physical = tf.config.list_physical_devices(device_type)
    if not physical:
        raise ValueError(
            f"This machine has no physical {device_type}, so it cannot be split into "
            f"{num_devices} logical {device_type}s. Use device_type='CPU'."
        )
    if device_type == "GPU":
        limit = 1024 if memory_limit_mb is None else memory_limit_mb
        wanted = [tf.config.LogicalDeviceConfiguration(memory_limit=limit)] * num_devices
    else:
        wanted = [tf.config.LogicalDeviceConfiguration()] * num_devices
    # The names are derived, not listed: listing logical devices would start
    # the runtime, and multi-worker collectives must be configured before that.
    names = [f"/device:{device_type}:{i}" for i in range(num_devices)]
    current = tf.config.get_logical_device_configuration(physical[0])
    if current is not None and len(current) == num_devices:
        return names
    try:
        tf.config.set_logical_device_configuration(physical[0], wanted)
    except RuntimeError:
        have = len(tf.config.list_logical_devices(device_type))
        if have == num_devices:  # already running with the layout asked for
            return logical_device_names(device_type)
        raise RuntimeAlreadyInitializedError(
            f"Cannot split {device_type}:0 into {num_devices} logical devices: TensorFlow's "
            f"runtime is already running in this process with {have} logical "
            f"{device_type} device(s). Call tfdist.configure_logical_devices({num_devices}) "
            "(or pass --logical_devices) before creating any TensorFlow tensor, Keras model "
            "or strategy, or restart the process (in a notebook: restart the kernel)."
        ) from None
    return names


def logical_device_names(device_type: DeviceType = "CPU") -> list[str]:
    """Names of this process's logical devices of one type (starts the runtime)."""
    tf = import_tensorflow()
    return [d.name for d in tf.config.list_logical_devices(_check_device_type(device_type))]


def configure_threads(*, intra_op: int | None = None, inter_op: int | None = None) -> None:
    """Sets TensorFlow's thread pools; like logical devices, only before start-up.

    Raises:
      ValueError: a negative thread count.
      RuntimeAlreadyInitializedError: the runtime already uses another value.
    """
    tf = import_tensorflow()
    for name, value, setter, getter in (
        ("intra_op", intra_op, tf.config.threading.set_intra_op_parallelism_threads,
         tf.config.threading.get_intra_op_parallelism_threads),
        ("inter_op", inter_op, tf.config.threading.set_inter_op_parallelism_threads,
         tf.config.threading.get_inter_op_parallelism_threads),
    ):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} threads must be an integer >= 0 (0 = TensorFlow picks). "
                             f"Received: {name}={value!r}")
        if getter() == value:
            continue
        try:
            setter(value)
        except RuntimeError:
            raise RuntimeAlreadyInitializedError(
                f"Cannot set {name} threads to {value}: TensorFlow's runtime already started "
                f"with {getter()}. Set threads before creating any tensor, model or strategy."
            ) from None


def resolve_devices(devices=None, num_devices: int | None = None) -> tuple[str, ...]:
    """Validates device names against this process's logical devices.

    Args:
      devices: explicit names ("/cpu:1", "/gpu:0", ...), or None.
      num_devices: take the first N (GPUs if the machine has any, else CPUs).

    Returns:
      Canonical device names ("/device:CPU:1"). With neither argument: all
      GPUs, else all logical CPUs.

    Raises:
      ValueError: a device that does not exist here, or more asked than exist.
    """
    gpus = logical_device_names("GPU")
    cpus = logical_device_names("CPU")
    if devices is None:
        pool = gpus or cpus
        if num_devices is None:
            return tuple(pool)
        if num_devices > len(pool):
            kind = "GPU" if gpus else "CPU"
            raise ValueError(
                f"num_devices={num_devices} but this process has only {len(pool)} "
                f"logical {kind} device(s): {', '.join(pool)}. "
                + (f"Call tfdist.configure_logical_devices({num_devices}) first "
                   f"(flag --logical_devices={num_devices}), or ask for fewer devices."
                   if kind == "CPU" else "Ask for fewer devices.")
            )
        return tuple(pool[:num_devices])
    available = {_kind_and_index(name): name for name in gpus + cpus}
    resolved = []
    for device in devices:
        try:
            canonical = _kind_and_index(device)
        except ValueError:
            canonical = None
        if canonical not in available:
            raise ValueError(
                f"Device {device!r} does not exist in this process. Available: "
                f"{', '.join(available.values())}. To get more CPU devices, call "
                "tfdist.configure_logical_devices(N) first (flag --logical_devices=N)."
            )
        resolved.append(available[canonical])
    return tuple(resolved)


def _kind_and_index(name: str) -> tuple[str, int]:
    parsed = parse_device_name(name)
    return parsed.kind, parsed.index
