"""XLA where it can compile a distributed step, not where it cannot: one warning instead of a crash.

Fix `keras_xla.jit_compile` replaces the getter of the `jit_compile`
property Keras's TF trainer reads when it compiles the train, test and
predict functions (`Trainer.jit_compile`, inherited by `TensorFlowTrainer`).
XLA cannot compile a step whose replicas are several CPUs (tfdist's
`mirrored` on logical CPUs: "Trying to access resource ... located in device
CPU:1 from device CPU:0"; `multi_worker_mirrored` on CPU workers: "Collectives
are not yet implemented for CPU devices when compiling with XLA"), so a
program that compiles with `jit_compile=True` (or whose `"auto"` resolves to
XLA) dies at its first step there. Upstream, keras-team/keras#19005 (the same
CPU:1 error) made Keras's `"auto"` turn XLA off under any strategy and on
CPU-only machines, but an explicit `True` is kept, and TensorFlow has no CPU
collectives under XLA.

Under a strategy tfdist made whose replicas XLA cannot compile
(`tfdist.step_options.xla_can_compile`), the replacement returns False, so the
step runs as a plain `tf.function`, and warns once per model saying so. The
model keeps what the user asked for: the setter is Keras's, the value saved
with the model (`get_compile_config()`) is the one passed to `compile`, so the
same file compiles with XLA where it can. On GPUs, and with one replica, XLA
stays on. Every other model reads Keras's value untouched.

Shape relied on: `jit_compile` is a property of `Trainer` with a getter and a
setter. Only the getter is wrapped: `compile` itself is left alone (Keras's
`load_model` checks whether a class overrides `compile`).
"""

from __future__ import annotations

import logging
import threading
import weakref

from tfdist.compat import _owner, _patch

logger = logging.getLogger("tfdist")

NAME = "keras_xla.jit_compile"
ISSUE = ("keras-team/keras#19005 (XLA under tf.distribute: Keras turned \"auto\" off under any "
         "strategy, an explicit True still fails with several CPU replicas)")

_warned: weakref.WeakSet = weakref.WeakSet()
_lock = threading.Lock()


class _Property(property):
    """A property that can carry the marks `_patch.install` sets on a replacement."""


def _trainer_class():
    return _patch.upstream("keras.src.backend.tensorflow.trainer.TensorFlowTrainer")


def _check(original) -> None:
    if not isinstance(original, property) or original.fget is None or original.fset is None:
        raise _patch.CompatError(
            f"Keras's Trainer.jit_compile is {type(original).__name__}, not a property with a "
            f"getter and a setter; the tfdist fix {NAME!r} wraps its getter. See "
            "tfdist.compat.SUPPORTED for the tested versions.")


def _warn_once(model, strategy) -> None:
    with _lock:
        if model in _warned:
            return
        _warned.add(model)
    logger.warning(
        "tfdist: %s was compiled with jit_compile=True, but XLA cannot compile a step whose "
        "%d replicas run on CPUs (%s): it would fail at the first step. Training without XLA. "
        "(XLA stays on where it works: on GPUs, or with one replica.)",
        getattr(model, "name", type(model).__name__), strategy.num_replicas_in_sync,
        ", ".join(strategy.extended.worker_devices))


def _make(original):
    from tfdist import step_options

    getter = original.fget

    def jit_compile(self):
        value = getter(self)
        strategy = getattr(self, "_distribute_strategy", None)
        if not value or not _owner.owns(strategy) or step_options.xla_can_compile(strategy):
            return value
        _warn_once(self, strategy)
        return False

    return _Property(jit_compile, original.fset, original.fdel, original.__doc__)


FIX = _patch.Fix(
    name=NAME,
    issue=ISSUE,
    target=lambda: (_trainer_class(), "jit_compile"),
    check=_check,
    make=_make,
)


def install() -> tuple[str, ...]:
    """Installs the fix (idempotent, thread-safe).

    Returns:
      The names of the fixes this call installed (() if it already was).

    Raises:
      CompatError: Keras's code is not shaped as the fix expects (nothing is
        installed then); UnsupportedVersionError outside the supported range.
    """
    return _patch.install_all((FIX,))
