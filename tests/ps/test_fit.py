"""Keras 3 fit/evaluate under the parameter_server preset (in-process cluster).

The cases live in tests/ps/run_fit_cases.py and run in a fresh pytest
process: an in-process cluster renames this process's devices to
/job:chief/..., after which MirroredStrategy collectives in the same process
fail ("unknown device"), so it must not share the suite's process; and the
cases install tfdist's compat fixes (and uninstall them for negative
controls), which the rest of the suite must not see.
"""

import os
import re
import subprocess
import sys

import pytest

from tests.support import REPO

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = os.path.join(HERE, "run_fit_cases.py")


def _case_count() -> int:
    with open(CASES) as f:
        return len(re.findall(r"^def test_", f.read(), flags=re.M))


@pytest.mark.timeout(660)
def test_in_process_cluster_cases():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", CASES, "-q", "-p", "no:cacheprovider", "-o",
         "addopts=", "--timeout=600", "-rs"],
        capture_output=True, text=True, timeout=640, cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    skipped = re.search(r"(\d+) skipped", proc.stdout)
    total = int(passed.group(1)) if passed else 0
    total += int(skipped.group(1)) if skipped else 0
    assert total == _case_count(), proc.stdout[-3000:]
    # Only an optional dependency may skip (KerasHub), and it says why.
    for line in proc.stdout.splitlines():
        if line.startswith("SKIPPED"):
            assert "optional test dependency" in line, line
