"""Read-only questions about TensorFlow state that its public API does not answer.

Nothing here replaces anything; each function reads one private attribute,
checks that it is there (a `CompatError` naming it otherwise) and answers
one question, so the rest of tfdist asks the question, not the attribute.
"""

from __future__ import annotations

from typing import Any

from tfdist.compat import _patch


def runtime_started() -> bool:
    """True once TensorFlow's eager runtime is initialised in this process.

    After that, collective ops, logical devices and threads can no longer be
    configured (multi-worker strategies must be created before it).
    """
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from tensorflow.python.eager import context

    ctx = context.context()
    _patch.require_attributes(ctx, "_context_handle", what="tensorflow eager Context")
    return ctx._context_handle is not None


def cluster_resolver(strategy: Any) -> Any:
    """The strategy's cluster resolver, or None for single-machine strategies.

    `Strategy.cluster_resolver` is the public way, but ParameterServerStrategy
    keeps its resolver on the strategy (`_cluster_resolver`), not on the
    extended object the public property reads, so the property returns None
    there (TF 2.16-2.21).
    """
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        resolver = getattr(strategy, "_cluster_resolver", None)
    return resolver
