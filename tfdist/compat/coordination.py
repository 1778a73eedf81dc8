"""The coordination service's key-value store: how the workers of one job agree on a step.

MultiWorkerMirroredStrategy starts TensorFlow's coordination service (one
leader, every chief/worker task an agent). Its key-value store is what
TensorFlow's own `tf.distribute.experimental.PreemptionCheckpointHandler`
uses to agree on the step to save at: the eager context's
`set_config_key_value` and `get_config_key_value`. There is no public API
for them; nothing here replaces anything: each function checks that the
member it calls exists (a `CompatError` naming it otherwise) and calls it.

`get_config_key_value` takes a timeout (`timeout_in_ms`) in newer
TensorFlow releases only; where it does not, a bounded `get` waits for the
blocking call in a helper thread.
"""

from __future__ import annotations

import inspect
import threading

from tfdist.compat import _patch

_MEMBERS = ("set_config_key_value", "get_config_key_value", "coordination_service")


def _context():
    from tfdist._tf import import_tensorflow

    import_tensorflow()
    from tensorflow.python.eager import context

    ctx = context.context()
    _patch.require_attributes(ctx, *_MEMBERS, what="tensorflow eager Context")
    if "key" not in inspect.signature(ctx.get_config_key_value).parameters:
        raise _patch.CompatError(
            "tensorflow's Context.get_config_key_value takes no `key`; tfdist's preemption "
            "agreement was written for TensorFlow 2.16-2.21.")
    return ctx


def available() -> bool:
    """True when this process runs a coordination service agent (a multi-worker job)."""
    return _context().coordination_service is not None


def put(key: str, value: str) -> bool:
    """Stores `value` at `key` unless the key exists. Returns False if it existed."""
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    try:
        _context().set_config_key_value(key, value)
    except tf.errors.AlreadyExistsError:
        return False
    return True


def _takes_timeout(ctx) -> bool:
    return "timeout_in_ms" in inspect.signature(ctx.get_config_key_value).parameters


def get(key: str, timeout: float | None) -> str | None:
    """The value at `key`, waiting up to `timeout` seconds for it (None: forever).

    Returns None if the key did not appear in time, or the service went away
    (the job is ending).
    """
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    ctx = _context()
    if timeout is None or _takes_timeout(ctx):
        kwargs = {} if timeout is None else {"timeout_in_ms": max(1, int(timeout * 1000))}
        try:
            return ctx.get_config_key_value(key, **kwargs)
        except tf.errors.OpError:
            return None  # DeadlineExceeded (the timeout), Unavailable/Cancelled (shutdown)
    found: list[str | None] = [None]

    def wait():
        found[0] = get(key, None)

    helper = threading.Thread(target=wait, name="tfdist-coordination-get", daemon=True)
    helper.start()
    helper.join(timeout)
    return found[0]


__all__ = ["available", "get", "put"]
