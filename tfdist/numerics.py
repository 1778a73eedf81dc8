"""Training like one device: the public side of tfdist's numerical fixes.

Under strategies made by `tfdist.make_strategy`, two things are fixed
without being asked (see docs/numerics.md):

- sparse (`IndexedSlices`) gradients reach the optimizer with duplicate
  indices summed, so Adam, RMSprop, Adagrad... see the summed gradient of an
  embedding row, as on Keras's JAX backend and in tf_keras;
- replica copies of layer state updated during training (BatchNormalization's
  moving statistics) are averaged at each update and stay identical
  (`sync_batch_norm=True` additionally computes BN statistics over the global
  batch).

Plain single-device Keras is left as it is; this module offers the
sparse-gradient fix as an explicit opt-in for it (and an opt-out under
tfdist's strategies), and a way to check that a model's replicas agree.
"""

from __future__ import annotations

from typing import Any


def sum_duplicate_sparse_gradients(optimizer: Any) -> Any:
    """Makes `optimizer` sum duplicate indices of sparse gradients; returns it.

    Keras 3's TensorFlow-backend optimizers apply an `IndexedSlices` gradient
    one slice at a time, so an embedding row looked up twice in a batch gets
    Adam's second moment g1**2 + g2**2 instead of (g1 + g2)**2 (and RMSprop's
    and Adagrad's accumulators likewise). Keras's JAX backend, tf_keras and
    TensorFlow's own optimizers use the summed gradient. Strategies made by
    tfdist always sum; this is the opt-in for training without one (one
    device), e.g. for a single-device reference run that matches a
    distributed one. SGD (without momentum or with it) is unaffected either
    way: its update is linear in the gradient.

    Args:
      optimizer: a Keras optimizer object (pass the object to `compile`, not a
        string). A `LossScaleOptimizer`'s inner optimizer is included.

    Returns:
      `optimizer`, for chaining: `model.compile(sum_duplicate_sparse_gradients(Adam()), ...)`.

    Raises:
      ValueError: `optimizer` is not a Keras optimizer.

    Example:
      >>> opt = tfdist.sum_duplicate_sparse_gradients(keras.optimizers.Adam(0.1))
      >>> model.compile(opt, "mse")
    """
    import keras

    from tfdist.compat import optimizer_update

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            "sum_duplicate_sparse_gradients takes a Keras optimizer object such as "
            f"keras.optimizers.Adam(1e-3). Received: {optimizer!r} ({type(optimizer).__name__}).")
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:  # LossScaleOptimizer: the inner optimizer runs the update step
        optimizer_update.opt_in(inner)
    return optimizer_update.opt_in(optimizer)


def keep_duplicate_sparse_slices(optimizer: Any) -> Any:
    """Makes `optimizer` apply sparse gradients slice by slice, as Keras does; returns it.

    The opposite of `sum_duplicate_sparse_gradients`, for a run under a
    strategy tfdist made: there, duplicate indices of an `IndexedSlices`
    gradient are summed before the optimizer sees them (Adam's math as on
    Keras's JAX backend and in tf_keras), which makes a distributed run differ
    from a plain single-device TensorFlow run of the same program wherever an
    embedding row is looked up more than once in a batch (docs/numerics.md).
    With this opt-out, the distributed run keeps Keras's slice-by-slice
    arithmetic and equals that plain run. A variable that sharding (`shard=`)
    cuts into shards gets a dense gradient, duplicates summed, either way.

    Args:
      optimizer: a Keras optimizer object. A `LossScaleOptimizer`'s inner
        optimizer is included.

    Returns:
      `optimizer`, for chaining.

    Raises:
      ValueError: `optimizer` is not a Keras optimizer.

    Example:
      >>> opt = tfdist.keep_duplicate_sparse_slices(keras.optimizers.Adam(0.1))
      >>> with strategy.scope():
      ...     model.compile(opt, "mse")
    """
    import keras

    from tfdist import sync

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            "keep_duplicate_sparse_slices takes a Keras optimizer object such as "
            f"keras.optimizers.Adam(1e-3). Received: {optimizer!r} ({type(optimizer).__name__}).")
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        sync.keep_sparse_slices(inner)
    return sync.keep_sparse_slices(optimizer)


def replica_spread(variables: Any) -> float:
    """The largest difference between any two local replica copies of any variable.

    0.0 means every replica of this process holds the same values (the
    promise tfdist keeps under its synchronous strategies); variables that are
    not distributed count as 0.

    Args:
      variables: a Keras model or layer (all its weights), or an iterable of
        Keras / TensorFlow variables.

    Returns:
      max over variables of max |copy_i - copy_0|, as a Python float.
    """
    import numpy as np

    from tfdist._tf import import_tensorflow
    from tfdist.compat import _owner

    tf = import_tensorflow()
    if hasattr(variables, "weights"):
        variables = variables.weights
    spread = 0.0
    for variable in variables:
        value = getattr(variable, "value", variable)
        strategy = _owner.strategy_of_variable(variable)
        if strategy is None or not isinstance(value, tf.distribute.DistributedValues):
            continue
        copies = strategy.experimental_local_results(value)
        first = np.asarray(copies[0].numpy(), dtype=np.float64)
        for other in copies[1:]:
            difference = np.abs(np.asarray(other.numpy(), dtype=np.float64) - first)
            spread = max(spread, float(difference.max()) if difference.size else 0.0)
    return spread
