"""Run a function on a local multi-worker cluster from a notebook cell.

    def train(epochs):
        import tfdist, keras
        strategy = tfdist.make_strategy("multi_worker_mirrored")
        ...
        return {"loss": float(history.history["loss"][-1])}

    results = tfdist.notebook_launcher(train, args=(3,), num_workers=2)
    results["worker:0"]    # what worker 0 returned

Like Accelerate's `notebook_launcher`, but a notebook kernel that has
imported TensorFlow cannot be forked safely (its runtime threads do not
survive fork), and a multi-worker cluster needs one fresh process per task
with its own TF_CONFIG. So the function's *source* is sent to new Python
processes started by `tfdist.launch.launch` (a private loopback-only network
where the OS allows it, output prefixed with each task's name, one progress
bar drawn in the cell, failures stop the group). The function must therefore
be self-contained: import what it uses inside its body, and take and return
picklable values.

The tasks import with the kernel's `sys.path` and its working directory (so
`import models` works as in the notebook), except folders that other users
can write to (such as /tmp): a module planted there would run in every task,
so those are left out with a warning. Run the notebook from a folder of your
own to import from it.
"""

from __future__ import annotations

import inspect
import os
import pickle
import stat
import sys
import tempfile
import textwrap
import warnings
from typing import Any, Callable, Sequence

_RUNNER = """\
import json, os, pickle, sys
sys.path[:0] = {paths!r}
from tfdist._tf import import_tensorflow
import_tensorflow()  # before the function imports keras: no C++ start-up lines
with open({args_path!r}, "rb") as f:
    _args, _kwargs = pickle.load(f)
{source}
_result = {name}(*_args, **_kwargs)
_task = json.loads(
    os.environ.get("TF_CONFIG") or '{{"task": {{"type": "worker", "index": 0}}}}')["task"]
_task = f"{{_task['type']}}_{{_task['index']}}"
with open(os.path.join({out_dir!r}, _task + ".pkl"), "wb") as f:
    pickle.dump(_result, f)
"""


class NotebookLaunchError(RuntimeError):
    """A task failed; the message says which and how (its output is above)."""


def _writable_by_others(path: str) -> str | None:
    """Why `path` is unsafe on a task's sys.path (None: safe or absent)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if st.st_mode & stat.S_IWOTH:
        return "every user can write to it"
    if st.st_uid not in (os.geteuid(), 0):
        return f"it belongs to another user (uid {st.st_uid})"
    return None


def task_sys_path() -> list[str]:
    """The kernel's working directory and sys.path, without folders others can write to."""
    paths, seen = [], set()
    for path in [os.getcwd()] + [p for p in sys.path if p]:
        path = os.path.abspath(path)
        if path in seen:
            continue
        seen.add(path)
        why = _writable_by_others(path)
        if why:
            warnings.warn(
                f"notebook_launcher leaves {path} off the tasks' sys.path: {why}, so a module "
                f"planted there would be imported by every task. Move the notebook (and the "
                f"modules it imports) to a folder of your own.", stacklevel=3)
            continue
        paths.append(path)
    return paths


def _function_source(function: Callable) -> str:
    if not callable(function) or not inspect.isfunction(function):
        raise ValueError(
            f"notebook_launcher needs a plain function defined with `def`. Received: "
            f"{function!r}")
    if function.__name__ == "<lambda>":
        raise ValueError("notebook_launcher cannot send a lambda to other processes; define the "
                         "function with `def` in a cell.")
    if function.__closure__:
        raise ValueError(
            f"{function.__name__} uses variables of an enclosing function "
            f"({', '.join(function.__code__.co_freevars)}); pass them as arguments instead.")
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        raise ValueError(
            f"Cannot read the source of {function.__name__}: define it in a notebook cell or a "
            "file (not in exec or the interactive prompt).") from None
    return textwrap.dedent(source)


def notebook_launcher(function: Callable, args: Sequence[Any] = (), kwargs: dict | None = None,
                      *, num_workers: int = 2, num_ps: int = 0, chief: bool = False,
                      max_restarts: int = 0, timeout: float | None = 600.0,
                      network: str = "auto", output: str = "main",
                      env: dict[str, str] | None = None) -> dict[str, Any]:
    """Runs `function(*args, **kwargs)` once per task of a local cluster.

    Args:
      function: a self-contained function (imports inside its body).
      args, kwargs: picklable arguments, the same for every task.
      num_workers, num_ps, chief: the cluster (see `tfdist.launch.launch`).
      max_restarts: restart the whole group after a failure up to this often.
      timeout: seconds for the whole job; None for no limit.
      network: "auto", "private" or "host" (see `tfdist.launch.launch`).
      output: "main": the chief's (else worker 0's) Keras progress bar, drawn
        in place in the cell, other tasks' progress and TensorFlow's start-up
        and INFO log lines hidden; "all": everything from every task.
      env: extra environment variables for the tasks.

    Returns:
      {task name: return value}, e.g. {"worker:0": ..., "worker:1": ...},
      for every task that returned (servers of a parameter-server job do not).

    Raises:
      ValueError: a function that cannot be sent, unpicklable arguments, or
        bad cluster sizes.
      NotebookLaunchError: a task failed or the job timed out.
    """
    from tfdist import launch as launch_lib

    source = _function_source(function)
    with tempfile.TemporaryDirectory(prefix="tfdist-notebook-") as work_dir:
        args_path = os.path.join(work_dir, "args.pkl")
        try:
            with open(args_path, "wb") as f:
                pickle.dump((tuple(args), dict(kwargs or {})), f)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise ValueError(f"notebook_launcher arguments must be picklable: {e}") from None
        script = os.path.join(work_dir, "task.py")
        with open(script, "w") as f:
            # The kernel's working directory and path, so `import models` etc. work.
            paths = task_sys_path()
            f.write(_RUNNER.format(paths=paths, args_path=args_path, source=source,
                                   name=function.__name__, out_dir=work_dir))
        result = launch_lib.launch(
            [sys.executable, script], num_workers=num_workers, num_ps=num_ps, chief=chief,
            max_restarts=max_restarts, timeout=timeout, network=network, output=output,
            env={**os.environ, **(env or {})})
        if not result.ok:
            raise NotebookLaunchError(result.message)
        returned = {}
        for name in sorted(os.listdir(work_dir)):
            if name.endswith(".pkl") and name != "args.pkl":
                with open(os.path.join(work_dir, name), "rb") as f:
                    returned[name[:-4].replace("_", ":")] = pickle.load(f)
        return returned
