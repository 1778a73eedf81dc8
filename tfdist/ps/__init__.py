"""Parameter-server training for Keras 3: `ParameterServerStrategy` with plain `model.fit`.

    strategy = tfdist.make_strategy("parameter_server", local_workers=2, local_ps=1)
    with strategy.scope():
        model = build_model(); model.compile(optimizer="adam", loss="mse")
    model.fit(dataset_fn, epochs=3, steps_per_epoch=100)

Keras 3 has no ParameterServerStrategy support (keras-team/keras#18624). The
subsystem, one job per module, imports running one way (down this list, and
into tfdist.compat, never back):

* `servers`: the cluster: in-process servers, TF_CONFIG tasks that serve,
  waiting for the cluster, the coordinator's cluster resolver;
* `data`: what each worker reads (dataset functions, datasets,
  `PerWorkerDataset`);
* `trainer`: `CoordinatorTrainer`, the loop that schedules a model's steps
  on the workers (train, evaluate, exactly-once evaluate);
* `keras_api`: Keras's `compile`/`fit`/`evaluate`/`predict` mapped onto the
  trainer (arguments, callbacks, logs);
* `strategy`: the preset's factory, which wires the above together and
  installs the fixes (tfdist.compat.ps_variables, ps_tables, ps_fit).

See docs/parameter_server.md.
"""

from __future__ import annotations

import importlib

from tfdist.ps.errors import ParameterServerError

_LAZY = {
    "make_strategy": "tfdist.ps.strategy",
    "local_cluster": "tfdist.ps.servers",
    "LocalCluster": "tfdist.ps.servers",
    "wait_for_tasks": "tfdist.ps.servers",
    "serve_forever": "tfdist.ps.servers",
    "PerWorkerDataset": "tfdist.ps.data",
    "CoordinatorTrainer": "tfdist.ps.trainer",
    "StepsReport": "tfdist.ps.trainer",
    "coordinator_for": "tfdist.ps.trainer",
    "RepeatedEvaluationDataWarning": "tfdist.ps.keras_api",
    "RerunStepsWarning": "tfdist.ps.keras_api",
}

__all__ = ["ParameterServerError", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tfdist.ps' has no attribute {name!r}")


def is_parameter_server_strategy(strategy) -> bool:
    """True for a `tf.distribute.ParameterServerStrategy` (V2)."""
    from tfdist.compat import ps_keras

    return ps_keras.is_parameter_server_strategy(strategy)
