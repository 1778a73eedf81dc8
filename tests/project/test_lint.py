"""`ruff check` passes over the repository (its rules: pyproject.toml's [tool.ruff])."""

import subprocess
import sys

from tests.support import REPO


def test_ruff_check_passes():
    try:
        proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                               "--output-format", "concise", "."],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    except FileNotFoundError as e:  # pragma: no cover - the interpreter itself is missing
        raise AssertionError(f"could not run ruff: {e}") from None
    assert "No module named ruff" not in proc.stderr, (
        "ruff is not installed: it is in the test extra (pip install -e '.[test]').")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
