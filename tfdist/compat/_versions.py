"""The versions tfdist's fixes were verified against."""

from __future__ import annotations

import warnings

# Major.minor of the stack the fixes in this package were verified on.
TESTED = {"tensorflow": ("2.21",), "keras": ("3.15",)}


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def versions() -> dict[str, str]:
    """Installed TensorFlow and Keras versions."""
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    import keras

    return {"tensorflow": tf.__version__, "keras": keras.__version__}


def check_versions(*, warn: bool = True) -> bool:
    """True if TensorFlow and Keras are versions the compat fixes were verified on.

    Outside that range the fixes still apply where their target exists, but
    may be unneeded or wrong: we warn once rather than refuse to run.
    """
    ok = True
    for name, version in versions().items():
        if _major_minor(version) not in TESTED[name]:
            ok = False
            if warn:
                warnings.warn(
                    f"tfdist's compat fixes were verified on {name} "
                    f"{', '.join(TESTED[name])}.x; found {name} {version}. "
                    "Run tests/test_compat.py to see which fixes still apply.",
                    stacklevel=2,
                )
    return ok
