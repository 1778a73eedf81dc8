"""The command every task runs: checked, and `python` resolved, before anything starts.

`tfdist launch -- python train.py` runs `train.py` with **the launcher's own
interpreter** (`sys.executable`), like `accelerate launch`: a bare `python`,
`python3` or `python3.X` of our version would otherwise be the first one on
PATH, which is not the venv's when tfdist runs from a venv that is not
activated (the tasks then die with `No module named 'tensorflow'`). Give a
path (`/usr/bin/python3`) to run another interpreter.

Everything that would fail at exec time fails here with the fix instead: a
missing program or script, a directory, a file without execute permission, a
text file with no `#!` line (`Exec format error`), a `#!` line naming an
interpreter that does not exist.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from typing import Mapping, Sequence

_PY_OPTIONS_WITH_VALUE = ("-W", "-X", "-Q")
# Mach-O magic numbers (macOS binaries), which, like ELF, need no #! line.
_MACH_O = (b"\xca\xfe\xba\xbe", b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe")


def python_names() -> tuple[str, ...]:
    """Bare program names that mean "this Python": python, python3, python3.11."""
    major, minor = sys.version_info[:2]
    return ("python", f"python{major}", f"python{major}.{minor}")


@dataclasses.dataclass(frozen=True)
class Program:
    """A checked command: `argv[0]` is an absolute path."""

    argv: tuple[str, ...]
    # What we changed, for the launcher's first line (None: nothing).
    note: str | None = None


def _error(text: str, cmd: Sequence[str]) -> ValueError:
    return ValueError(f"{text} Received: cmd={list(cmd)!r}")


def _check_executable(path: str, cmd: Sequence[str]) -> None:
    if os.path.isdir(path):
        raise _error(f"{path!r} is a directory, not a program.", cmd)
    if not os.access(path, os.X_OK):
        raise _error(
            f"{path!r} is not executable (no execute permission). Make it executable "
            f"(chmod +x {path}) or start it with its interpreter, e.g. `python {path}` or "
            f"`sh {path}`.", cmd)
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return  # execute-only: the kernel will judge it
    if head.startswith(b"\x7fELF"):
        return
    if head.startswith(b"#!"):
        line = head[2:].split(b"\n", 1)[0].strip()
        interpreter = line.split()[0].decode("utf-8", "replace") if line else ""
        if not interpreter:
            raise _error(f"{path!r} has an empty #! line. Name its interpreter, e.g. "
                         f"#!/usr/bin/env python3.", cmd)
        if not (os.path.isfile(interpreter) and os.access(interpreter, os.X_OK)):
            raise _error(
                f"{path!r} starts with #!{line.decode('utf-8', 'replace')}, but "
                f"{interpreter!r} is not an executable file here. Fix the #! line, or start "
                f"the script with its interpreter (e.g. `python {path}`).", cmd)
        return
    if head and not head.startswith(_MACH_O):
        raise _error(
            f"{path!r} is neither a binary nor a script with a #! line, so the system cannot "
            f"run it (Exec format error). Add a #! line (e.g. #!/bin/sh) or start it with its "
            f"interpreter, e.g. `sh {path}` or `python {path}`.", cmd)


def _check_python_script(argv: Sequence[str], cmd: Sequence[str]) -> None:
    args = iter(argv[1:])
    for arg in args:
        if arg in ("-m", "-c") or arg.startswith(("-m", "-c")) and len(arg) > 2:
            return  # a module or inline code: nothing to check here
        if arg in _PY_OPTIONS_WITH_VALUE:
            next(args, None)
            continue
        if arg == "-":
            return
        if arg.startswith("-"):
            continue
        if os.path.isdir(arg):
            if not os.path.isfile(os.path.join(arg, "__main__.py")):
                raise _error(f"The script {arg!r} is a directory without __main__.py.", cmd)
        elif not os.path.isfile(arg):
            raise _error(
                f"The script {arg!r} does not exist (looked in {os.getcwd()}). Check the path; "
                f"it is relative to the current directory.", cmd)
        return


def resolve(cmd: Sequence[str], *, env: Mapping[str, str] | None = None) -> Program:
    """Checks the command and resolves its program to an absolute path.

    Args:
      cmd: the command, e.g. ["python", "train.py", "--epochs=3"].
      env: the tasks' environment (its PATH finds the program).

    Raises:
      ValueError: what is wrong, with the fix.
    """
    if isinstance(cmd, (str, bytes)) or not cmd or not all(isinstance(a, str) for a in cmd):
        raise ValueError(
            "The command must be a non-empty list of strings, e.g. ['python', 'train.py']. "
            f"Received: cmd={cmd!r}. On the command line put it after '--': "
            "tfdist launch --num_workers=2 -- python train.py")
    cmd = list(cmd)
    for arg in cmd:
        if "\0" in arg:
            raise _error(f"Argument {arg!r} contains a NUL character, which a command line "
                         f"cannot carry.", cmd)
    program = cmd[0]
    note = None
    if program in python_names():
        path = sys.executable
        if not path:
            raise _error("This Python does not know its own executable (sys.executable is "
                         "empty); give the interpreter's full path.", cmd)
        note = f"{program} = {path} (the launcher's own interpreter)"
    elif os.sep in program:
        path = os.path.abspath(program)
        if not os.path.exists(path):
            raise _error(f"The program {program!r} does not exist.", cmd)
    else:
        search = (env if env is not None else os.environ).get("PATH", os.defpath)
        found = shutil.which(program, path=search)
        if found is None:
            raise _error(f"The program {program!r} is not on PATH. Give its full path or fix "
                         f"PATH.", cmd)
        path = os.path.abspath(found)
    _check_executable(path, cmd)
    argv = [path] + cmd[1:]
    if os.path.basename(path).startswith("python"):
        _check_python_script(argv, cmd)
    elif program.endswith(".py") and not os.path.isfile(path):
        raise _error(f"The script {program!r} does not exist.", cmd)
    return Program(argv=tuple(argv), note=note)
