"""Running Python in a fresh process, for tests that need their own runtime."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(*args: str, timeout: float = 120, env: dict | None = None
               ) -> subprocess.CompletedProcess:
    """Runs `python ARGS` from the repository root with a bounded timeout."""
    full_env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full_env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    full_env.pop("TFDIST_QUIET_SET_LOG_LEVEL", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, *args], cwd=REPO, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone): for no-orphan checks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False
