"""Every place tfdist touches private TensorFlow/Keras code, and the way back to stock Keras.

Each fix here names its upstream issue, checks the shape of the code it
replaces (signature, what it iterates, the attributes it relies on) and
refuses with a `CompatError` where that differs, passes straight through
for objects tfdist did not make, and is undone by `uninstall()`. Each has a
behavioural canary in tests/ (the unpatched path, run in a subprocess, still
fails). docs/compat.md lists them all, with the version matrix.

Nothing outside this package imports `keras.src` / `tensorflow.python` or
reads private attributes of TensorFlow/Keras objects
(tests/compat/test_boundary.py checks it).

    import tfdist
    strategy = tfdist.make_strategy("multi_worker_mirrored")   # installs its fixes
    ...
    tfdist.compat.uninstall()           # every original back: stock Keras again

    with tfdist.compat.uninstall_after():   # or only for a block
        ...
"""

from tfdist.compat._patch import CompatError, installed, uninstall, uninstall_after
from tfdist.compat._versions import (
    SUPPORTED,
    TESTED_PAIRS,
    UnsupportedVersionError,
    check_supported,
    check_versions,
    is_supported,
    versions,
)

__all__ = [
    "SUPPORTED",
    "TESTED_PAIRS",
    "CompatError",
    "UnsupportedVersionError",
    "check_supported",
    "check_versions",
    "installed",
    "is_supported",
    "uninstall",
    "uninstall_after",
    "versions",
]
