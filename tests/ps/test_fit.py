"""Keras 3 fit/evaluate under the parameter_server preset (in-process cluster).

The cases live in tests/ps/run_fit_cases.py and tests/ps/run_parity_cases.py
(users' programs) and run in one fresh pytest process, on one cluster: an
in-process cluster renames this process's devices to /job:chief/..., after
which MirroredStrategy collectives in the same process fail ("unknown
device"), so it must not share the suite's process; and the cases install
tfdist's compat fixes (and uninstall them for negative controls), which the
rest of the suite must not see.
"""

import os
import re
import subprocess
import sys

import pytest

from tests.support import REPO

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = os.path.join(HERE, "run_fit_cases.py")
# Users' programs under the preset (tests/ps/parity_programs.py), on the same cluster.
PARITY_CASES = os.path.join(HERE, "run_parity_cases.py")


def _case_count() -> int:
    count = 0
    for path in (CASES, PARITY_CASES):
        with open(path) as f:
            text = f.read()
        count += len(re.findall(r"^def test_", text, flags=re.M))
        # A parametrized case counts once per parameter.
        for names in re.findall(r"^@pytest\.mark\.parametrize\(\"\w+\", \[([^\]]*)\]", text,
                                flags=re.M):
            count += len(re.findall(r'"\w+"', names)) - 1
    return count


@pytest.mark.timeout(660)
def test_in_process_cluster_cases():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", CASES, PARITY_CASES, "-q", "-p", "no:cacheprovider", "-o",
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
