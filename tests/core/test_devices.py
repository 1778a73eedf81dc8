"""Logical devices and the quiet start, each in a fresh process."""

import pytest

from tests.support import run_python


def test_late_configuration_says_to_call_it_first():
    result = run_python("-c", """
import tfdist, tensorflow as tf
tf.constant(1.0)  # starts the runtime with 1 CPU
try:
    tfdist.configure_logical_devices(2)
except tfdist.RuntimeAlreadyInitializedError as e:
    print("ERROR:", e)
print(tfdist.configure_logical_devices(1))
""")
    assert result.returncode == 0, result.stderr
    assert ("ERROR: Cannot split CPU:0 into 2 logical devices: TensorFlow's runtime is already "
            "running in this process with 1 logical CPU device(s). Call "
            "tfdist.configure_logical_devices(2)") in result.stdout
    assert "['/device:CPU:0']" in result.stdout  # same count again is a no-op


def test_configure_is_idempotent_and_starts_quietly():
    result = run_python("-c", """
import tfdist
print(tfdist.configure_logical_devices(3))
print(tfdist.configure_logical_devices(3))
""")
    assert result.returncode == 0
    assert result.stdout.count("'/device:CPU:2']") == 2
    assert result.stderr == "", result.stderr  # no oneDNN / cpu_feature_guard / CUDA lines


def test_the_usual_env_var_brings_startup_logs_back():
    result = run_python("-c", "import tfdist; tfdist.configure_logical_devices(1)",
                        env={"TF_CPP_MIN_LOG_LEVEL": "0"})
    assert result.returncode == 0
    # Which lines depends on the CPU and GPU (the oneDNN notice and cpu_feature_guard
    # only where the CPU has the instructions, CUDA probing without a GPU): any of them.
    from tfdist.launch.output import STARTUP_LINES

    assert any(STARTUP_LINES.match(line) for line in result.stderr.splitlines()), result.stderr


@pytest.mark.parametrize("value, fragment", [
    (0, "logical_devices must be an integer >= 1. Received: logical_devices=0"),
    (2.5, "Received: logical_devices=2.5"),
])
def test_bad_counts_are_rejected(value, fragment):
    import tfdist

    with pytest.raises(ValueError) as e:
        tfdist.configure_logical_devices(value)
    assert fragment in str(e.value)


def test_bad_device_type_is_rejected():
    import tfdist

    with pytest.raises(ValueError, match="device_type must be 'CPU' or 'GPU'. Received: "
                                         "device_type='TPU'"):
        tfdist.configure_logical_devices(2, device_type="TPU")


def test_configuring_does_not_start_the_runtime():
    # Multi-worker collectives must be configured before the runtime starts.
    result = run_python("-c", """
import tfdist, tensorflow as tf
from tensorflow.python.eager import context
print(tfdist.configure_logical_devices(2))
print("initialized:", context.context()._initialized)
""")
    assert result.returncode == 0, result.stderr
    assert "['/device:CPU:0', '/device:CPU:1']" in result.stdout
    assert "initialized: False" in result.stdout


def test_every_public_name_loads_quietly():
    # Any tfdist module that imports keras at the top must import TensorFlow
    # through tfdist._tf first, or TensorFlow's start-up lines leak.
    result = run_python("-c", "import tfdist\nfor name in tfdist.__all__: getattr(tfdist, name)")
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr
