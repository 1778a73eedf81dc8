"""Keras's `compile`/`fit`/`evaluate`/`predict` for models under a tfdist ParameterServerStrategy.

`tfdist.compat.ps_fit` routes these methods here for models built under a
ParameterServerStrategy made by `tfdist.make_strategy` (every other model
runs Keras unchanged). Each function takes Keras's arguments, checks them
(clear errors for what parameter-server training cannot honour), runs Keras's
callbacks, and delegates the steps to `tfdist.ps.trainer.CoordinatorTrainer`.

* `fit`: `x` is `fn(input_context) -> tf.data.Dataset`, a `tf.data.Dataset`
  (copied to every worker) or a `tfdist.PerWorkerDataset(fn)`;
  `steps_per_epoch` is required (the coordinator never sees the data, so it
  cannot know where an epoch ends). Batch-level logs are the metrics
  accumulated on the parameter servers so far (re-read at most every
  `trainer.BATCH_LOG_INTERVAL` s); epoch-level logs are exact.
* `evaluate`: with `compile(pss_evaluation_shards=N or "auto")`, a finite
  dataset is evaluated over the workers exactly once (tf_keras's argument,
  which the TensorFlow tutorial uses); with `steps=N`, N test steps are
  spread over the workers (each reads its own copy from the start: inexact,
  and a warning says so for a repeating dataset); otherwise a finite dataset
  is evaluated on the coordinator, exactly.
* `predict` runs on the coordinator.
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from typing import Any

from tfdist.compat import ps_keras
from tfdist.ps import data as data_lib
from tfdist.ps.errors import lost_ps_is_an_error
from tfdist.ps.trainer import CoordinatorTrainer, StepHooks

logger = logging.getLogger("tfdist")

_STEPS_PER_EPOCH_HELP = (
    "The coordinator schedules steps on the workers "
    "without seeing their data, so it cannot know where a dataset ends: pass "
    "steps_per_epoch=N (and make the dataset repeat(), so no worker runs out).")

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

    Same arguments as `keras.Model.fit`; `x` is `fn(input_context) ->
    tf.data.Dataset`, a `tf.data.Dataset` (copied to every worker) or a
    `tfdist.PerWorkerDataset(fn)`, and `steps_per_epoch` is required.

    Returns:
      The `History` callback, as `keras.Model.fit`.

    Raises:
      ValueError: missing `steps_per_epoch`, unsupported data or arguments
        (`y`, `sample_weight`, `class_weight`, `batch_size`, `shuffle`,
        `validation_split`, `validation_batch_size`: they belong in the dataset).
      ParameterServerError: a parameter server (or every worker) was lost.
    """
    del keras_fit
    ps_keras.assert_compiled(model, "fit")
    data_lib.check_data(x, "x")
    _check_steps(steps_per_epoch, "steps_per_epoch", _STEPS_PER_EPOCH_HELP)
    fix = "Put labels, weights and batching inside the dataset."
    _reject("fit", "y", y, None, fix)
    _reject("fit", "sample_weight", sample_weight, None, fix)
    _reject("fit", "class_weight", class_weight, None, "Weight the loss inside the dataset.")
    _reject("fit", "batch_size", batch_size, None, "Batch inside the dataset function.")
    _reject("fit", "shuffle", shuffle, _UNSET,
            "Every worker reads its own dataset in that dataset's order: shuffle inside "
            "it (ds.shuffle(buffer_size)) and leave shuffle out of fit.")
    _reject("fit", "validation_split", validation_split, 0.0,
            "Pass validation_data=... instead.")
    _reject("fit", "validation_batch_size", validation_batch_size, None,
            "Batch the validation dataset itself (validation_data=ds.batch(n)).")
    _check_validation_freq(validation_freq)
    if validation_data is not None:
        data_lib.check_data(validation_data, "validation_data")

    with lost_ps_is_an_error():
        return _fit(model, x, epochs=epochs, verbose=verbose, callbacks=callbacks,
                    validation_data=validation_data, initial_epoch=initial_epoch,
                    steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
                    validation_freq=validation_freq)


def _fit(model, x, *, epochs, verbose, callbacks, validation_data, initial_epoch,
         steps_per_epoch, validation_steps, validation_freq):
    trainer = CoordinatorTrainer.for_model(model)
    trainer.build(x)
    callbacks = _callback_list(callbacks, model, add_history=True, verbose=verbose,
                               epochs=epochs, steps=steps_per_epoch)
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
        epoch_logs = trainer.train(x, steps_per_epoch - first, hooks)
        _report_rerun_after_write(trainer)
        if validation_data is not None and _should_validate(epoch, validation_freq):
            val_logs = _evaluate(model, validation_data, steps=validation_steps,
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


def evaluate(model, keras_evaluate, x=None, y=None, batch_size=None, verbose="auto",
             sample_weight=None, steps=None, callbacks=None, return_dict=False, **kwargs):
    """`Model.evaluate` for a model built under a tfdist ParameterServerStrategy.

    Exactly once over a finite dataset when the model was compiled with
    `pss_evaluation_shards`; with `steps`, that many test steps spread over
    the workers; otherwise a finite `tf.data.Dataset` evaluated once on the
    coordinator (reading the variables from the ps).

    Raises:
      ValueError: bad data or arguments, a dataset that never ends, `steps`
        together with exactly-once evaluation.
      ParameterServerError: a parameter server (or every worker) was lost.
    """
    kwargs.pop("_use_cached_eval_dataset", None)  # Keras's fit passes it
    if kwargs:
        raise ValueError(f"Arguments not recognized: {kwargs}")
    ps_keras.assert_compiled(model, "evaluate")
    data_lib.check_data(x, "x")
    fix = "Put labels, weights and batching inside the dataset."
    _reject("evaluate", "y", y, None, fix)
    _reject("evaluate", "sample_weight", sample_weight, None, fix)
    _reject("evaluate", "batch_size", batch_size, None, "Batch inside the dataset function.")
    with lost_ps_is_an_error():
        logs = _evaluate(model, x, steps=steps, callbacks=callbacks, verbose=verbose,
                         in_fit=False, keras_evaluate=keras_evaluate)
    if return_dict:
        return logs
    return ps_keras.flatten_metrics(model, logs)


def _evaluate(model, x, *, steps, callbacks, verbose, in_fit, keras_evaluate=None) -> dict:
    what = "validation_data" if in_fit else "x"
    steps_name = "validation_steps" if in_fit else "steps"
    shards = exact_evaluation_shards(model)
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
        return _on_coordinator_evaluate(model, data_lib.on_coordinator(x), verbose=verbose,
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


def _on_coordinator_evaluate(model, dataset, *, verbose, callbacks, keras_evaluate) -> dict:
    """Keras's own evaluate on this process (no strategy): one exact pass over `dataset`."""
    if keras_evaluate is None:  # validation inside fit: Keras's evaluate via the model
        keras_evaluate = _keras_method(model, "evaluate")
    with ps_keras.without_strategy(model):
        return keras_evaluate(model, dataset, verbose=verbose, callbacks=callbacks,
                              return_dict=True)


def _keras_method(model, name: str):
    from tfdist.compat import _patch

    return _patch.stored_original(f"ps_fit.{name}")


# --- predict ---------------------------------------------------------------------------


def predict(model, keras_predict, x, batch_size=None, verbose="auto", steps=None,
            callbacks=None):
    """`Model.predict` under a tfdist ParameterServerStrategy: runs on the coordinator.

    The ops run here and read the variables from the parameter servers.
    """
    tf_dataset = data_lib.on_coordinator(x) if data_lib.is_per_worker_dataset(x) else x
    with lost_ps_is_an_error(), ps_keras.without_strategy(model):
        return keras_predict(model, tf_dataset, batch_size=batch_size, verbose=verbose,
                             steps=steps, callbacks=callbacks)


ROUTES = {"compile": compile, "fit": fit, "evaluate": evaluate, "predict": predict}
