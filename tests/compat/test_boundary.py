"""All private TensorFlow/Keras use lives in tfdist/compat/.

An AST scan of every module under tfdist/ outside tfdist/compat/ fails on
- imports of `keras.src` / `tensorflow.python` (also `tf.python` / `keras.src`
  reached as attributes);
- private attributes read or written on objects that are not tfdist's own:
  `x._name` where `x` is not `self`/`cls` and not a name bound to a tfdist or
  standard-library import, and `getattr/hasattr/setattr/delattr(x, "_name")`.

The allowlist names every offender that is still there, in files other
helpers own; the lead drives it to empty at integration. A stale entry
fails too, so the list stays true.
"""

from __future__ import annotations

import ast
import os
import sys

from tests.support import REPO

PACKAGE = os.path.join(REPO, "tfdist")
PRIVATE_MODULES = ("keras.src", "tensorflow.python")
PRIVATE_ATTRIBUTE_ROOTS = (("tf", "python"), ("keras", "src"), ("tensorflow", "python"))

# (path, offending code) -> "owner: why it is still here". Drive to empty.
ALLOWLIST: dict[tuple[str, str], str] = {}


def _relative(path: str) -> str:
    return os.path.relpath(path, REPO).replace(os.sep, "/")


def _modules():
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if _relative(folder).startswith("tfdist/compat"):
            continue
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def _trusted_names(tree: ast.AST) -> set[str]:
    """Names bound to tfdist or standard-library imports (their privates are not TF/Keras)."""
    names = {"self", "cls"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top == "tfdist" or top in sys.stdlib_module_names:
                    names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module:
            top = node.module.split(".")[0]
            if node.level or top == "tfdist" or top in sys.stdlib_module_names:
                names.update(alias.asname or alias.name for alias in node.names)
    return names


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _attribute_path(node: ast.AST) -> tuple[str, ...]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return tuple(reversed(parts))


def offenders(path: str) -> list[tuple[str, int]]:
    """(offending code, line) for one module."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    trusted = _trusted_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(f"import {a.name}", node.lineno) for a in node.names
                      if a.name.startswith(PRIVATE_MODULES)]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.startswith(PRIVATE_MODULES):
                found.append((f"import {node.module}", node.lineno))
        elif isinstance(node, ast.Attribute):
            path_parts = _attribute_path(node)
            if path_parts[:2] in PRIVATE_ATTRIBUTE_ROOTS:
                found.append((".".join(path_parts[:2]), node.lineno))
            elif _is_private(node.attr):
                value = node.value
                if not (isinstance(value, ast.Name) and value.id in trusted):
                    found.append((ast.unparse(node), node.lineno))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _is_private(node.args[1].value)):
            owner = node.args[0]
            if not (isinstance(owner, ast.Name) and owner.id in trusted):
                found.append((f"{node.func.id}({ast.unparse(owner)}, {node.args[1].value!r})",
                              node.lineno))
    return found


def test_no_private_tensorflow_or_keras_use_outside_compat():
    seen, unexpected = set(), []
    for path in _modules():
        relative = _relative(path)
        for code, line in offenders(path):
            if (relative, code) in ALLOWLIST:
                seen.add((relative, code))
            else:
                unexpected.append(f"{relative}:{line}: {code}")
    assert not unexpected, (
        "Private TensorFlow/Keras use outside tfdist/compat/ (move it behind a small named "
        "function in tfdist/compat/):\n" + "\n".join(unexpected))
    stale = sorted(set(ALLOWLIST) - seen)
    assert not stale, f"Allowlist entries no longer found (delete them): {stale}"


def test_the_scan_finds_what_it_must():
    # The scan itself, on a module written to offend in every way it checks.
    import tempfile

    source = '''
import os
from tfdist import cost
from keras.src import tree
import tensorflow.python.eager.context
def f(model, strategy):
    os._exit(0); cost._check_positive(); self_like = model._compute_loss
    getattr(strategy, "_cluster_resolver", None); tf.python.eager
    return self._fine, cls._fine
'''
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    try:
        found = [code for code, _ in offenders(f.name)]
    finally:
        os.unlink(f.name)
    assert found == sorted(found, key=found.index)  # deterministic order
    assert set(found) == {"import keras.src", "import tensorflow.python.eager.context",
                          "model._compute_loss", "getattr(strategy, '_cluster_resolver')",
                          "tf.python"}, found
