"""Version-guarded fixes for gaps in TensorFlow and Keras 3.

Every fix here names its upstream issue, states the versions it was
verified on, and has a test that fails when upstream behaviour changes
under it (tests/test_compat.py). Nothing outside this package touches
private TensorFlow or Keras symbols to work around a bug.
"""

from tfdist.compat._versions import TESTED, check_versions, versions
from tfdist.compat.collective_keys import fresh_collective_key_base

__all__ = ["TESTED", "check_versions", "fresh_collective_key_base", "versions"]
