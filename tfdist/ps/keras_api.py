"""Keras's `compile`/`fit`/`evaluate`/`predict` for models under a tfdist ParameterServerStrategy.

`tfdist.compat.ps_fit` routes these methods here for models built under a
ParameterServerStrategy made by `tfdist.make_strategy` (every other model
runs Keras unchanged). Each function takes Keras's arguments, checks them
(clear errors for what parameter-server training cannot honour), runs Keras's
callbacks, and delegates the steps to `tfdist.ps.trainer.CoordinatorTrainer`.

* `fit`: `x` is `fn(input_context) -> tf.data.Dataset`, a `tf.data.Dataset`
  (copied to every worker), a `tfdist.PerWorkerDataset(fn)`, NumPy arrays,
  or a `keras.utils.PyDataset` (see tfdist.ps.data); `class_weight` becomes
  sample weights; `steps_per_epoch` is required where the coordinator cannot
  know where an epoch ends (a dataset function, a repeating dataset).
  Batch-level logs are the metrics accumulated on the parameter servers so
  far (re-read at most every `trainer.BATCH_LOG_INTERVAL` s, and never before
  the first step finished); epoch-level logs are exact.
* `evaluate`: with `compile(pss_evaluation_shards=N or "auto")`, a finite
  dataset (or arrays) is evaluated over the workers exactly once (tf_keras's
  argument, which the TensorFlow tutorial uses); with `steps=N` and
  per-worker input, N test steps are spread over the workers (each reads its
  own copy from the start: inexact, and a warning says so for a repeating
  dataset); otherwise Keras's own evaluate runs on the coordinator, exactly.
* `predict` runs on the coordinator.

Keras's evaluate and predict on the coordinator run outside the strategy's
scope and without XLA (see `tfdist.compat.ps_keras.without_strategy`), so
they also work inside `with strategy.scope():` and with `jit_compile=True`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import warnings
import weakref
from typing import Any

from tfdist.compat import ps_keras
from tfdist.ps import data as data_lib
from tfdist.ps.errors import lost_ps_is_an_error, missing_worker_ops_explained
from tfdist.ps.trainer import CoordinatorTrainer, StepHooks

logger = logging.getLogger("tfdist")

# Workers x this = the shards of pss_evaluation_shards="auto": small enough
# pieces that a lost worker's shard is cheap to redo and the load evens out.
AUTO_SHARDS_PER_WORKER = 5

_UNSET = object()  # an argument the caller did not pass
_exact_shards: "weakref.WeakKeyDictionary[Any, int | str]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class RepeatedEvaluationDataWarning(UserWarning):
    """`evaluate(steps=N)` on a repeating dataset under parameter-server training re-reads it."""


class RerunStepsWarning(UserWarning):
    """A worker died after applying a step's update; TensorFlow re-ran that step elsewhere."""


# --- argument checks ---------------------------------------------------------------


def _check_steps(steps, name: str, help_text: str) -> None:
    if steps is None:
        raise ValueError(f"{name} is required under ParameterServerStrategy. Received: "
                         f"{name}=None. {help_text}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{name} must be an integer >= 1. Received: {name}={steps!r}.")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _reject(method: str, name: str, value, default, fix: str) -> None:
    if value is _UNSET or value is default:
        return
    if _is_number(default) and _is_number(value) and value == default:
        return  # validation_split=0 is the default 0.0
    raise ValueError(
        f"{method} under ParameterServerStrategy does not take {name}. "
        f"Received: {name}={value!r}. {fix}")


def _check_validation_freq(validation_freq) -> None:
    ok = (isinstance(validation_freq, int) and not isinstance(validation_freq, bool)
          and validation_freq >= 1) or (
        isinstance(validation_freq, (list, tuple)) and validation_freq
        and all(isinstance(e, int) and not isinstance(e, bool) and e >= 1
                for e in validation_freq))
    if not ok:
        raise ValueError(
            "validation_freq must be an integer >= 1 (validate every N epochs) or a list of "
            f"epoch numbers (1-based). Received: validation_freq={validation_freq!r}.")


def _should_validate(epoch: int, validation_freq) -> bool:
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return (epoch + 1) in validation_freq


def exact_evaluation_shards(model) -> int:
    """How many shards `compile(pss_evaluation_shards=...)` asked for (0: off)."""
    shards = _exact_shards.get(model, 0)
    if shards == "auto":
        return AUTO_SHARDS_PER_WORKER * ps_keras.num_workers(model.distribute_strategy)
    return shards


def _check_shards(value) -> None:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)
                           and value >= 0):
        return
    raise ValueError(
        "pss_evaluation_shards must be 0 (off), 'auto' (5 per worker) or a number of "
        f"shards >= 1. Received: pss_evaluation_shards={value!r}.")


def _callback_list(callbacks, model, *, add_history, verbose, epochs, steps):
    import keras

    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    return keras.callbacks.CallbackList(
        callbacks, add_history=add_history, add_progbar=verbose != 0, verbose=verbose,
        epochs=epochs, steps=steps, model=model)


# --- compile -------------------------------------------------------------------------


def compile(model, keras_compile, *args, pss_evaluation_shards=0, **kwargs):  # noqa: A001
    """`Model.compile`, plus tf_keras's `pss_evaluation_shards` (exactly-once evaluation).

    Args:
      pss_evaluation_shards: 0 (default: `evaluate` as Keras does it here),
        "auto" (5 shards per worker) or N: `evaluate` and fit's validation
        visit every element of a finite dataset exactly once, split into N
        shards over the workers.

    Raises:
      ValueError: a bad `pss_evaluation_shards`.
    """
    _check_shards(pss_evaluation_shards)
    result = keras_compile(model, *args, **kwargs)
    with _lock:
        _exact_shards[model] = pss_evaluation_shards
    CoordinatorTrainer.forget(model)  # new optimizer/loss: trace the steps again
    return result


# --- fit -------------------------------------------------------------------------------


def fit(model, keras_fit, x=None, y=None, batch_size=None, epochs=1, verbose="auto",
        callbacks=None, validation_split=0.0, validation_data=None, shuffle=_UNSET,
        class_weight=None, sample_weight=None, initial_epoch=0, steps_per_epoch=None,
        validation_steps=None, validation_batch_size=None, validation_freq=1):
    """`Model.fit` for a model built under a tfdist ParameterServerStrategy.

    Same arguments as `keras.Model.fit`. `x` is `fn(input_context) ->
    tf.data.Dataset` (called on every worker), a `tf.data.Dataset` (copied to
    every worker), a `tfdist.PerWorkerDataset(fn)`, NumPy arrays (with `y`,
    `batch_size`, `shuffle`, `sample_weight`, `validation_split`: Keras's
    own batching, copied to every worker) or a `keras.utils.PyDataset` /
    generator (read on the coordinator, each batch sent with its step).
    `class_weight` becomes sample weights as in Keras. `steps_per_epoch` is
    required where the coordinator cannot know where an epoch ends (a
    dataset function, a dataset that repeats).

    Returns:
      The `History` callback, as `keras.Model.fit`.

    Raises:
      ValueError: missing `steps_per_epoch`, unsupported data or arguments
        (`y`, `sample_weight`, `batch_size`, `validation_batch_size` with a
        dataset: they belong in the dataset).
      ParameterServerError: a parameter server (or every worker) was lost.
    """
    del keras_fit
    ps_keras.assert_compiled(model, "fit")
    if steps_per_epoch is not None:
        _check_steps(steps_per_epoch, "steps_per_epoch", "")
    _check_validation_freq(validation_freq)
    if validation_split and validation_data is None:
        # Keras's own split (the last part of the arrays); it refuses other data.
        (x, y, sample_weight), validation_data = ps_keras.train_validation_split(
            (x, y, sample_weight), validation_split)
    training = data_lib.training_data(
        x, y=y, sample_weight=sample_weight, batch_size=batch_size,
        shuffle=True if shuffle is _UNSET else shuffle, class_weight=class_weight,
        steps_per_epoch=steps_per_epoch)
    validation = None
    if validation_data is not None:
        validation = _EvaluationData.of(validation_data,
                                        batch_size=validation_batch_size or batch_size)
        if data_lib.is_dataset_like(validation.x):
            _reject("fit", "validation_batch_size", validation_batch_size, None,
                    "Batch the validation dataset itself (validation_data=ds.batch(n)).")

    try:
        with lost_ps_is_an_error(), missing_worker_ops_explained():
            return _fit(model, training, epochs=epochs, verbose=verbose, callbacks=callbacks,
                        validation=validation, initial_epoch=initial_epoch,
                        validation_steps=validation_steps, validation_freq=validation_freq)
    finally:
        if data_lib.is_coordinator_feed(training.source):
            training.source.close()


def _fit(model, training: data_lib.TrainingData, *, epochs, verbose, callbacks, validation,
         initial_epoch, validation_steps, validation_freq):
    x = training.source
    trainer = CoordinatorTrainer.for_model(model)
    trainer.build(x)
    callbacks = _callback_list(callbacks, model, add_history=True, verbose=verbose,
                               epochs=epochs, steps=training.steps_per_epoch)
    model.stop_training = False
    callbacks.on_train_begin()
    # keras.callbacks.BackupAndRestore sets the epoch it restored in on_train_begin; a
    # backup taken mid-epoch (tfdist.compat.keras_resume) says at which step it starts.
    initial_epoch = ps_keras.restored_initial_epoch(model) or initial_epoch
    from tfdist.compat import keras_resume

    start = (keras_resume.take_pending() or (0, 0))[0]
    training_logs = None
    for epoch in range(initial_epoch, epochs):
        first = start if epoch == initial_epoch else 0
        hooks = StepHooks(begin=lambda step, first=first: callbacks.on_train_batch_begin(
                              step + first),
                          end=lambda step, logs, first=first: callbacks.on_train_batch_end(
                              step + first, logs),
                          stop=lambda: model.stop_training)
        callbacks.on_epoch_begin(epoch)
        epoch_logs = trainer.train(x, training.steps_per_epoch - first, hooks)
        _report_rerun_after_write(trainer)
        if validation is not None and _should_validate(epoch, validation_freq):
            val_logs = _evaluate(model, validation, steps=validation_steps,
                                 callbacks=callbacks, verbose=verbose, in_fit=True)
            epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
        callbacks.on_epoch_end(epoch, epoch_logs)
        training_logs = epoch_logs
        if model.stop_training:
            break
    callbacks.on_train_end(logs=training_logs)
    return model.history


def _report_rerun_after_write(trainer: CoordinatorTrainer) -> None:
    report = trainer.last_report
    if report is not None and report.rerun_after_write:
        warnings.warn(
            f"{report.rerun_after_write} of {report.scheduled} step(s) ran twice: a worker died "
            "after writing (part of) a step's update to the parameter servers, and TensorFlow "
            f"re-ran the step on another worker ({report.rerun} re-run(s) this epoch; "
            f"optimizer.iterations moved {report.applied}). TensorFlow runs parameter-server "
            "steps at least once; make_strategy('parameter_server', "
            "skip_completed_reruns=True) skips re-runs of steps that had completed (see "
            "docs/parameter_server.md, 'Failures').",
            RerunStepsWarning, stacklevel=4)


# --- evaluate --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _EvaluationData:
    """What is evaluated: per-worker input, or data Keras reads (arrays, a PyDataset)."""

    x: Any
    y: Any = None
    sample_weight: Any = None
    batch_size: Any = None

    @classmethod
    def of(cls, validation_data, *, batch_size) -> "_EvaluationData":
        import keras

        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(validation_data)
        return cls(x, y, sample_weight, batch_size)

    @property
    def per_worker(self) -> bool:
        return data_lib.is_dataset_like(self.x)


def evaluate(model, keras_evaluate, x=None, y=None, batch_size=None, verbose="auto",
             sample_weight=None, steps=None, callbacks=None, return_dict=False, **kwargs):
    """`Model.evaluate` for a model built under a tfdist ParameterServerStrategy.

    Exactly once over a finite dataset (or arrays) when the model was
    compiled with `pss_evaluation_shards`; with `steps` and per-worker input,
    that many test steps spread over the workers; otherwise Keras's own
    evaluate on the coordinator (reading the variables from the ps), exact.

    Raises:
      ValueError: bad data or arguments, a dataset that never ends, `steps`
        together with exactly-once evaluation.
      ParameterServerError: a parameter server (or every worker) was lost.
    """
    kwargs.pop("_use_cached_eval_dataset", None)  # Keras's fit passes it
    if kwargs:
        raise ValueError(f"Arguments not recognized: {kwargs}")
    ps_keras.assert_compiled(model, "evaluate")
    data = _EvaluationData(x, y, sample_weight, batch_size)
    if data.per_worker:
        fix = "Put labels, weights and batching inside the dataset."
        _reject("evaluate", "y", y, None, fix)
        _reject("evaluate", "sample_weight", sample_weight, None, fix)
        _reject("evaluate", "batch_size", batch_size, None, "Batch inside the dataset function.")
    with lost_ps_is_an_error(), missing_worker_ops_explained():
        logs = _evaluate(model, data, steps=steps, callbacks=callbacks, verbose=verbose,
                         in_fit=False, keras_evaluate=keras_evaluate)
    if return_dict:
        return logs
    return ps_keras.flatten_metrics(model, logs)


def _evaluate(model, data: _EvaluationData, *, steps, callbacks, verbose, in_fit,
              keras_evaluate=None) -> dict:
    what = "validation_data" if in_fit else "x"
    steps_name = "validation_steps" if in_fit else "steps"
    shards = exact_evaluation_shards(model)
    if not data.per_worker:
        if not (shards and steps is None
                and ps_keras.is_arrays(data.x, data.y, data.sample_weight)):
            # A PyDataset or generator only this process can read, or arrays without
            # exactly-once shards: Keras's own evaluate here, exact.
            return _on_coordinator_evaluate(model, data, steps=steps, verbose=verbose,
                                            callbacks=callbacks, keras_evaluate=keras_evaluate)
        data = _EvaluationData(data_lib.evaluation_dataset(
            data.x, data.y, data.sample_weight, data.batch_size))
    x = data.x
    if shards:
        if steps is not None:
            raise ValueError(
                f"The model was compiled with pss_evaluation_shards={_exact_shards[model]!r}: "
                f"evaluation visits every element of {what} exactly once, so it takes no "
                f"{steps_name}. Received: {steps_name}={steps!r}. Pass a finite dataset and "
                f"leave {steps_name} out, or compile with pss_evaluation_shards=0.")
        if data_lib.is_infinite(x):
            raise ValueError(
                f"When performing exact evaluation, {what} must be finite: the model was "
                f"compiled with pss_evaluation_shards={_exact_shards[model]!r} and {what} "
                "repeats forever. Make sure not to call repeat() on the evaluation dataset.")
        trainer = CoordinatorTrainer.for_model(model)
        callbacks = _callback_list(callbacks, model, add_history=False, verbose=verbose,
                                   epochs=1, steps=shards)
        model.stop_evaluating = False
        callbacks.on_test_begin()
        hooks = StepHooks(begin=callbacks.on_test_batch_begin, end=callbacks.on_test_batch_end)
        logs = trainer.evaluate_exactly(x, shards, hooks)
        callbacks.on_test_end(logs)
        return logs
    if steps is None:
        if data_lib.dataset_fn_of(x) is not None and not data_lib.is_per_worker_dataset(x):
            raise ValueError(
                f"{steps_name} is required when {what} is a dataset function: the workers "
                "create the data, so the coordinator cannot know where it ends. Received: "
                f"{steps_name}=None. For an exact result over a finite dataset, compile(..., "
                "pss_evaluation_shards='auto') (spread over the workers) or pass the finite "
                f"tf.data.Dataset itself (evaluated here); or pass {steps_name}=N.")
        if data_lib.is_infinite(x):
            raise ValueError(
                f"{what} is an infinite dataset (it repeats), so evaluation would never end. "
                f"Received: {steps_name}=None. Pass a finite dataset (evaluated exactly once), "
                "or compile(..., pss_evaluation_shards='auto') to spread that exact evaluation "
                f"over the workers, or {steps_name}=N for N batches spread over the workers.")
        return _on_coordinator_evaluate(
            model, _EvaluationData(data_lib.on_coordinator(x)), steps=None, verbose=verbose,
            callbacks=callbacks, keras_evaluate=keras_evaluate)
    _check_steps(steps, steps_name, "")
    if data_lib.is_infinite(x):
        warnings.warn(
            f"evaluate with {steps_name}={steps} on a repeating {what}: under "
            "parameter-server training every worker iterates its own copy of the data from "
            f"its start, so the {steps} batches are the first ones again (each worker's), "
            "not your evaluation set: the result is not its loss. For an exact result use a "
            "finite dataset without steps, or compile(..., pss_evaluation_shards='auto').",
            RepeatedEvaluationDataWarning, stacklevel=4)
    trainer = CoordinatorTrainer.for_model(model)
    callbacks = _callback_list(callbacks, model, add_history=False, verbose=verbose,
                               epochs=1, steps=steps)
    model.stop_evaluating = False
    callbacks.on_test_begin()
    hooks = StepHooks(begin=callbacks.on_test_batch_begin, end=callbacks.on_test_batch_end,
                      stop=lambda: getattr(model, "stop_evaluating", False))
    logs = trainer.evaluate(x, steps, hooks)
    callbacks.on_test_end(logs)
    return logs


def _on_coordinator_evaluate(model, data: _EvaluationData, *, steps, verbose, callbacks,
                             keras_evaluate) -> dict:
    """Keras's own evaluate on this process (no strategy): one exact pass over the data."""
    if keras_evaluate is None:  # validation inside fit: Keras's evaluate via the model
        keras_evaluate = _keras_method(model, "evaluate")
    with ps_keras.without_strategy(model):
        return keras_evaluate(model, data.x, data.y, batch_size=data.batch_size,
                              sample_weight=data.sample_weight, steps=steps, verbose=verbose,
                              callbacks=callbacks, return_dict=True)


def _keras_method(model, name: str):
    from tfdist.compat import _patch

    return _patch.stored_original(f"ps_fit.{name}")


# --- predict ---------------------------------------------------------------------------


def predict(model, keras_predict, x, batch_size=None, verbose="auto", steps=None,
            callbacks=None):
    """`Model.predict` under a tfdist ParameterServerStrategy: runs on the coordinator.

    The ops run here and read the variables from the parameter servers; a
    dataset function or PerWorkerDataset is built here, with a default
    InputContext.
    """
    if data_lib.dataset_fn_of(x) is not None:
        x = data_lib.on_coordinator(x)
    with lost_ps_is_an_error(), ps_keras.without_strategy(model):
        return keras_predict(model, x, batch_size=batch_size, verbose=verbose,
                             steps=steps, callbacks=callbacks)


ROUTES = {"compile": compile, "fit": fit, "evaluate": evaluate, "predict": predict}
