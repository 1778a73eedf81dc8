"""Shared test set-up: one pytest process, 4 logical CPUs configured first.

TensorFlow's device layout can be set only once per process, so it is set
here, before any test module creates a tensor. Tests that need another
layout (or a fresh runtime) run their code in a subprocess.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import pytest  # noqa: E402

import tfdist  # noqa: E402

NUM_LOGICAL_CPUS = 4
tfdist.configure_logical_devices(NUM_LOGICAL_CPUS)


@pytest.fixture
def logical_cpus():
    return NUM_LOGICAL_CPUS
