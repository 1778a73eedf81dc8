"""Deprecated: the planner moved to `tfdist.planning.planner` (`tfdist.plan` is unchanged).

    from tfdist import planner             # deprecated
    from tfdist.planning import planner    # instead

`Plan`, the planner's answer, is `tfdist.planning.Recommendation` (tfdist.split
had a `Plan` too).
"""

from __future__ import annotations

import warnings

from tfdist.planning.planner import (  # noqa: F401
    ATTENTION_CLASSES,
    DEFAULT_LOCAL_LINK,
    MAX_STAGES,
    TARGET_BUBBLE,
    VARIANTS,
    Candidate,
    Recommendation,
    SplitSuggestion,
    Variant,
    plan,
    this_machine,
    variant_available,
)

Plan = Recommendation

warnings.warn("tfdist.planner is deprecated: import from tfdist.planning instead.",
              DeprecationWarning, stacklevel=2)
