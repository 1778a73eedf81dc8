"""The version range is stated once in spirit, in three places that must agree.

tfdist/compat/_versions.py (what tfdist refuses), setup.cfg (what pip
installs) and .ci/run (the oldest pair CI tests); and every test the oldest
pair stage names exists.
"""

import configparser
import os
import re

from tests.support import REPO
from tfdist.compat import _versions


def _next_minor(version: str) -> str:
    major, minor = version.split(".")[:2]
    return f"{major}.{int(minor) + 1}"


def test_setup_cfg_requires_exactly_the_supported_range():
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO, "setup.cfg"))
    requires = {re.split(r"[<>=~ ]", line.strip())[0]: line.strip()
                for line in config["options"]["install_requires"].splitlines()
                if line.strip() and not line.strip().startswith("#")}
    tf_low, tf_high = _versions.SUPPORTED["tensorflow"]
    keras_low, keras_high = _versions.SUPPORTED["keras"]
    assert requires["tensorflow"] == f"tensorflow>={tf_low},<{_next_minor(tf_high)}"
    assert requires["tensorboard"] == f"tensorboard>={tf_low},<{_next_minor(tf_high)}"
    assert requires["keras"] == f"keras>={keras_low},<{_next_minor(keras_high)}"
    assert "portpicker" not in requires  # never imported


def test_ci_oldest_pair_is_the_lower_bound_and_a_tested_pair():
    script = open(os.path.join(REPO, ".ci", "run")).read()
    tensorflow = re.search(r"^OLDEST_TENSORFLOW=(\S+)$", script, re.M).group(1)
    keras = re.search(r"^OLDEST_KERAS=(\S+)$", script, re.M).group(1)
    assert tensorflow.startswith(_versions.SUPPORTED["tensorflow"][0] + ".")
    assert keras.startswith(_versions.SUPPORTED["keras"][0] + ".")
    assert (tensorflow, keras) in _versions.TESTED_PAIRS


def test_every_oldest_pair_test_exists():
    with open(os.path.join(REPO, ".ci", "oldest_pair_tests.txt")) as f:
        entries = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert entries
    for entry in entries:
        path, _, name = entry.partition("::")
        assert os.path.isfile(os.path.join(REPO, path)), entry
        if name:
            source = open(os.path.join(REPO, path)).read()
            assert re.search(rf"^def {re.escape(name)}\(", source, re.M), entry
