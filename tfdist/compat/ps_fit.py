"""Keras 3 `Model.fit`/`evaluate`/`predict` under ParameterServerStrategy.

Upstream: keras-team/keras#18624. Keras 3's TensorFlow trainer has no
ClusterCoordinator or DatasetCreator support: under a ParameterServerStrategy
`fit` rejects tf.data ("you need to pass this dataset to
ClusterCoordinator.create_per_worker_dataset"), numpy, and callables
("Unrecognized data type"). Verified on Keras 3.15 / TF 2.21.

The fix wraps `TensorFlowTrainer.fit`, `evaluate` and `predict`: when the
model's distribute strategy is a ParameterServerStrategy, the call goes to
`tfdist.ps.fit` / `evaluate` / `predict`; otherwise to Keras unchanged. So
users keep calling plain `model.fit` on a model built and compiled under
`strategy.scope()`. Installed by the `parameter_server` preset (idempotent).
"""

from __future__ import annotations

import functools

UPSTREAM_ISSUE = "https://github.com/keras-team/keras/issues/18624"
_METHODS = ("fit", "evaluate", "predict")
_originals: dict[str, object] = {}


def _trainer_class():
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return TensorFlowTrainer


def original(method: str):
    """Keras's own (unwrapped) TensorFlowTrainer method."""
    cls = _trainer_class()
    return _originals.get(method, getattr(cls, method))


def _dispatching(method: str, keras_method):
    @functools.wraps(keras_method)
    def wrapper(self, *args, **kwargs):
        from tfdist import ps

        if ps.is_parameter_server_strategy(self.distribute_strategy):
            return getattr(ps, method)(self, *args, **kwargs)
        return keras_method(self, *args, **kwargs)

    wrapper._tfdist_patched = True
    return wrapper


def installed() -> bool:
    cls = _trainer_class()
    return all(getattr(getattr(cls, m), "_tfdist_patched", False) for m in _METHODS)


def install() -> None:
    """Routes fit/evaluate/predict of PS-strategy models to tfdist.ps."""
    from tfdist.compat._versions import check_versions

    cls = _trainer_class()
    if installed():
        return
    check_versions(warn=True)
    for method in _METHODS:
        current = getattr(cls, method)
        if getattr(current, "_tfdist_patched", False):
            continue
        _originals[method] = current
        setattr(cls, method, _dispatching(method, current))
