"""Deprecated: what gradient compression saves is in `tfdist.planning.communication`.

    from tfdist.comm import planning              # deprecated
    from tfdist.planning import communication     # instead: candidates, recommend, ...
"""

from __future__ import annotations

import warnings

from tfdist.planning.communication import (  # noqa: F401
    MIN_COMM_SHARE,
    CompressionCost,
    candidates,
    recommend,
)

warnings.warn("tfdist.comm.planning is deprecated: import from tfdist.planning.communication.",
              DeprecationWarning, stacklevel=2)
