"""Which TensorFlow and Keras versions tfdist supports, and the check that refuses others.

tfdist's fixes replace private Keras/TensorFlow code, so they are only right
on releases whose code they were checked against. The supported range is the
one the version matrix measured (docs/compat.md lists every pair and what
ran on it); setup.cfg's install_requires states the same range.

Outside it, tfdist refuses at the first thing that would depend on private
code (`make_strategy`, installing a fix) with an `UnsupportedVersionError`
naming the versions found, the range, and the pip command that fixes it,
instead of crashing later inside a patch. Setting
TFDIST_ALLOW_UNSUPPORTED_VERSIONS=1 turns the refusal into one warning (to
try a new release): every fix still checks the shape of the code it
replaces and refuses, clearly, where that differs.
"""

from __future__ import annotations

import os
import threading
import warnings

from tfdist.compat._patch import CompatError

# Inclusive major.minor bounds, measured by the version matrix (docs/compat.md).
SUPPORTED = {"tensorflow": ("2.16", "2.21"), "keras": ("3.10", "3.15")}

# The pairs the matrix ran (TensorFlow, Keras) and what ran on each: see docs/compat.md.
TESTED_PAIRS = (
    ("2.16.2", "3.10.0"),
    ("2.18.1", "3.12.1"),
    ("2.20.0", "3.11.3"),
    ("2.21.0", "3.15.1"),
)

ALLOW_ENV = "TFDIST_ALLOW_UNSUPPORTED_VERSIONS"

_lock = threading.Lock()
_checked = False


class UnsupportedVersionError(CompatError):
    """TensorFlow or Keras is outside the range tfdist supports."""


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def _within(version: str, bounds: tuple[str, str]) -> bool:
    low, high = (_major_minor(b) for b in bounds)
    return low <= _major_minor(version) <= high


def versions() -> dict[str, str]:
    """Installed TensorFlow and Keras versions."""
    from tfdist._tf import import_tensorflow

    import sys

    tf = import_tensorflow()
    keras = sys.modules.get("keras")
    if keras is None:
        # Without importing Keras: parameter servers never need it (less memory per task).
        from importlib import metadata

        try:
            return {"tensorflow": tf.__version__, "keras": metadata.version("keras")}
        except metadata.PackageNotFoundError:
            import keras
    return {"tensorflow": tf.__version__, "keras": keras.__version__}


def supported_range() -> str:
    """The supported range in words, e.g. 'TensorFlow 2.16-2.21 with Keras 3.10-3.15'."""
    tf_low, tf_high = SUPPORTED["tensorflow"]
    k_low, k_high = SUPPORTED["keras"]
    return f"TensorFlow {tf_low}-{tf_high} with Keras {k_low}-{k_high}"


def pip_requirement() -> str:
    """The pip arguments that install a supported pair."""
    tf_low, tf_high = SUPPORTED["tensorflow"]
    k_low, k_high = SUPPORTED["keras"]
    tf_next = f"{tf_high.split('.')[0]}.{int(tf_high.split('.')[1]) + 1}"
    k_next = f"{k_high.split('.')[0]}.{int(k_high.split('.')[1]) + 1}"
    return f"'tensorflow>={tf_low},<{tf_next}' 'keras>={k_low},<{k_next}'"


def is_supported(found: dict[str, str] | None = None) -> bool:
    """True if TensorFlow and Keras (default: the installed ones) are in the supported range."""
    found = versions() if found is None else found
    return all(_within(found[name], SUPPORTED[name]) for name in SUPPORTED)


def unsupported_message(found: dict[str, str]) -> str:
    """What is installed, what tfdist supports, and the fix."""
    pairs = ", ".join(f"{t}+{k}" for t, k in TESTED_PAIRS)
    return (f"tfdist supports {supported_range()} (tested pairs, TensorFlow+Keras: {pairs}); "
            f"found TensorFlow {found['tensorflow']} with Keras {found['keras']}. Its fixes "
            "replace private TensorFlow/Keras code and are only right on the releases they "
            f"were checked against. Fix: pip install {pip_requirement()}. To try these versions "
            f"anyway, set {ALLOW_ENV}=1 (every fix still checks the code it replaces).")


def check_supported() -> None:
    """Refuses unsupported TensorFlow/Keras versions (once per process when they pass).

    Raises:
      UnsupportedVersionError: outside the supported range, unless
        TFDIST_ALLOW_UNSUPPORTED_VERSIONS=1 (then one warning instead).
    """
    global _checked
    with _lock:
        if _checked:
            return
        found = versions()
        if not is_supported(found):
            if os.environ.get(ALLOW_ENV, "") in ("", "0"):
                raise UnsupportedVersionError(unsupported_message(found))
            warnings.warn(f"{ALLOW_ENV} is set: running outside the tested range. "
                          + unsupported_message(found), stacklevel=3)
        _checked = True


def check_versions(*, warn: bool = True) -> bool:
    """Kept for callers written before `check_supported`: refuses outside the range.

    Returns:
      True (the versions are supported, or the user allowed them).

    Raises:
      UnsupportedVersionError: see `check_supported`.
    """
    del warn
    check_supported()
    return True
