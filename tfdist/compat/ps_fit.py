"""Keras 3 `Model.compile`/`fit`/`evaluate`/`predict` under ParameterServerStrategy.

Upstream: keras-team/keras#18624. Keras 3's TensorFlow trainer has no
ClusterCoordinator or DatasetCreator support: under a ParameterServerStrategy
`fit` rejects tf.data ("you need to pass this dataset to
ClusterCoordinator.create_per_worker_dataset"), numpy, and callables
("Unrecognized data type"); `compile(pss_evaluation_shards=...)` (tf_keras's
exactly-once evaluation, used by the public parameter_server_training
tutorial) is a TypeError. Verified on Keras 3.15 / TF 2.21.

The fixes wrap `TensorFlowTrainer.fit`, `evaluate`, `predict` and
`Trainer.compile`: when the model's strategy is a ParameterServerStrategy made by
`tfdist.make_strategy`, the call goes to the route given to `install()` (the
parameter_server preset passes tfdist.ps's Keras entry points); every other
model runs Keras unchanged, `compile(pss_evaluation_shards=...)` included (a
TypeError, as in stock Keras). This module never imports tfdist.ps: the preset
hands it the routes, so imports go one way (tfdist.ps -> tfdist.compat).
Models that override these methods (KerasHub tasks) still reach the routes
through `super().fit(...)`.

`compile` is replaced where Keras defines it, on `Trainer`, never on
`TensorFlowTrainer`: Keras's `compile_from_config` (what `load_model` calls)
compiles a loaded model only if `type(model).compile == Trainer.compile`, so a
`compile` installed on the subclass made every loaded model in the process
come back uncompiled ("No loss to compute" at `evaluate`).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from tfdist.compat import _patch, ps_keras

UPSTREAM_ISSUE = "https://github.com/keras-team/keras/issues/18624"

# Keras's signatures these fixes were written for (what the routes accept).
_SIGNATURES = {
    "fit": ("x", "y", "batch_size", "epochs", "verbose", "callbacks", "validation_split",
            "validation_data", "shuffle", "class_weight", "sample_weight", "initial_epoch",
            "steps_per_epoch", "validation_steps", "validation_batch_size", "validation_freq"),
    "evaluate": ("x", "y", "batch_size", "verbose", "sample_weight", "steps", "callbacks",
                 "return_dict", "kwargs"),
    "predict": ("x", "batch_size", "verbose", "steps", "callbacks"),
    "compile": ("optimizer", "loss", "loss_weights", "metrics", "weighted_metrics",
                "run_eagerly", "steps_per_execution", "jit_compile", "auto_scale_loss"),
}
METHODS = tuple(_SIGNATURES)

Route = Callable[..., Any]
_routes: dict[str, Route] = {}
_lock = threading.Lock()


def _trainer_class():
    return _patch.upstream("keras.src.backend.tensorflow.trainer.TensorFlowTrainer")


def _base_trainer_class():
    return _patch.upstream("keras.src.trainers.trainer.Trainer")


def _target(method: str):
    if method == "compile":
        return _base_trainer_class(), method
    return _trainer_class(), method


def _check(method: str, original) -> None:
    _patch.require_signature(original, *_SIGNATURES[method],
                             what=f"keras TensorFlowTrainer.{method}")
    if method == "compile" and "compile" in vars(_trainer_class()):
        # Replacing Trainer.compile would then miss TensorFlow models, and replacing
        # the subclass's would make compile_from_config skip every loaded model.
        raise _patch.CompatError(
            "keras TensorFlowTrainer defines its own compile in this Keras version; the "
            "tfdist fix ps_fit.compile was written for the one it inherits from Trainer "
            "(see tfdist.compat.SUPPORTED for the tested versions).")


def _applies(model, *args, **kwargs) -> bool:
    return ps_keras.owned_ps_strategy(getattr(model, "distribute_strategy", None))


def _make(method: str):
    def make(original):
        @_patch.passthrough(original, _applies)
        def routed(self, *args, **kwargs):
            # route(model, keras_method, *args, **kwargs): keras_method is Keras's own
            # implementation, for the parts the route hands back to Keras.
            return _routes[method](self, original, *args, **kwargs)

        return routed

    return make


def _fix(method: str) -> _patch.Fix:
    return _patch.Fix(
        name=f"ps_fit.{method}", issue=UPSTREAM_ISSUE,
        target=lambda: _target(method),
        check=lambda original: _check(method, original),
        make=_make(method))


FIXES = tuple(_fix(m) for m in METHODS)


def set_routes(routes: dict[str, Route]) -> None:
    """Where the fixes send compile/fit/evaluate/predict of tfdist PS-strategy models.

    Args:
      routes: method name -> `route(model, keras_method, *args, **kwargs)`, one per
        name in `METHODS` (tfdist.ps.keras_api.ROUTES).

    Raises:
      ValueError: `routes` does not name exactly `METHODS`.
    """
    if set(routes) != set(METHODS):
        raise ValueError(f"routes must name {', '.join(METHODS)}. Received: {sorted(routes)}.")
    with _lock:
        _routes.update(routes)


def install() -> tuple[str, ...]:
    """Installs the four fixes, or none (idempotent); returns the names installed by this call.

    Raises:
      RuntimeError: no routes yet (`set_routes` first).
      CompatError: Keras's methods are not shaped as these fixes expect.
    """
    from tfdist.compat._versions import check_versions

    with _lock:
        missing = [m for m in METHODS if m not in _routes]
    if missing:
        raise RuntimeError(f"tfdist.compat.ps_fit has no route for {', '.join(missing)}: call "
                           "ps_fit.set_routes(tfdist.ps.keras_api.ROUTES) before install().")
    check_versions(warn=True)
    return _patch.install_all(FIXES)


def names() -> tuple[str, ...]:
    """The names of this module's fixes (for `_patch.uninstall`)."""
    return tuple(fix.name for fix in FIXES)
