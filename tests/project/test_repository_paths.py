"""Docstrings, comments and docs name only files that exist, and test ids that exist.

A path is a token that starts at one of the repository's top-level folders
(`tfdist/`, `tests/`, `docs/`, ...) and ends in a file extension or a `/`:
`tests/ps/test_fit.py`, `docs/compat.md`, `tfdist/compat/`. A pytest id
(`tests/x/test_y.py::test_z`) must name a function defined in that file.
Globs and placeholders (`experiments/bench_*.py`, `tests/<area>/`) are not
paths. Upstream paths (`keras/src/models/model.py`) start elsewhere.
"""

from __future__ import annotations

import os
import re

from tests.support import REPO

ROOTS = ("tfdist", "tests", "docs", "experiments", "models", "scripts", "notebooks", ".ci")
EXTENSIONS = (".py", ".md", ".txt", ".cfg", ".toml", ".ipynb", ".json", ".yaml", ".sh")
SCANNED = (".py", ".md", ".txt", ".cfg", ".toml", ".ipynb")
TOP_LEVEL_FILES = ("README.md", "setup.cfg", "pyproject.toml", ".ci/run")

_PATH = re.compile(r"(?<![\w/.-])((?:%s)/[\w./-]*)(::\w+)?" % "|".join(map(re.escape, ROOTS)))


def named_paths(text: str) -> list[tuple[int, str, str]]:
    """(line number, path, test name or '') for every repository path `text` names."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in _PATH.finditer(line):
            path, test = match.group(1), (match.group(2) or "")[2:]
            following = line[match.end(1):match.end(1) + 1]
            if following in ("*", "<", "{"):
                continue  # a glob or a placeholder
            path = path.rstrip(".")
            if not (path.endswith(EXTENSIONS) or path.endswith("/")):
                continue  # a name such as a TensorBoard tag ("tfdist/step_time_ms")
            found.append((number, path, test))
    return found


def missing(root: str, text: str) -> list[str]:
    """The paths (and test ids) `text` names that do not exist under `root`."""
    wrong = []
    for number, path, test in named_paths(text):
        full = os.path.join(root, path)
        if not os.path.exists(full):
            wrong.append(f"line {number}: {path}")
        elif test and os.path.isfile(full):
            with open(full, encoding="utf-8") as f:
                if not re.search(rf"^def {re.escape(test)}\(", f.read(), re.M):
                    wrong.append(f"line {number}: {path}::{test} (no such test)")
    return wrong


def _scanned_files() -> list[str]:
    files = [os.path.join(REPO, name) for name in TOP_LEVEL_FILES]
    for top in ROOTS:
        for folder, dirs, names in os.walk(os.path.join(REPO, top)):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__pycache__"))]
            files += [os.path.join(folder, n) for n in names if n.endswith(SCANNED)]
    me = os.path.abspath(__file__)  # its examples of wrong paths are wrong on purpose
    return [f for f in files if os.path.isfile(f) and os.path.abspath(f) != me]


def test_the_scanner_finds_a_missing_file_and_a_missing_test():
    text = ("See tests/ps/test_fit.py and tfdist/compat/, not tests/test_gone.py\n"
            "nor tests/ps/test_fit.py::test_gone, nor docs/gone.md.\n"
            "Not paths: experiments/bench_*.py, tests/<area>/, tfdist/step_time_ms,\n"
            "keras/src/models/model.py, tests/ps/test_fit.py::test_in_process_cluster_cases.\n")
    assert missing(REPO, text) == ["line 1: tests/test_gone.py",
                                   "line 2: tests/ps/test_fit.py::test_gone (no such test)",
                                   "line 2: docs/gone.md"]


def test_every_named_file_exists():
    wrong = {}
    for path in _scanned_files():
        with open(path, encoding="utf-8") as f:
            problems = missing(REPO, f.read())
        if problems:
            wrong[os.path.relpath(path, REPO)] = problems
    assert not wrong, "files name repository paths that do not exist: " + "\n".join(
        f"{name}: {', '.join(problems)}" for name, problems in sorted(wrong.items()))
