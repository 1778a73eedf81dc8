"""Keras 3 fit/evaluate under the parameter_server preset (in-process cluster).

The cases live in tests/_ps_cluster_cases.py and run in a fresh pytest
process: an in-process cluster renames this process's devices to
/job:chief/..., after which MirroredStrategy collectives in the same process
fail ("unknown device"), so it must not share the suite's process.
"""

import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(300)
def test_in_process_cluster_cases():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", os.path.join(HERE, "_ps_cluster_cases.py"), "-q",
         "-p", "no:cacheprovider", "-o", "addopts=", "--timeout=240"],
        capture_output=True, text=True, timeout=280, cwd=os.path.dirname(HERE),
        env={**os.environ, "PYTHONPATH": os.path.dirname(HERE)})
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 6, proc.stdout[-3000:]
