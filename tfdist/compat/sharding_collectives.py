"""Reduce-scatter and all-gather between the replicas of a tf.distribute strategy.

What TensorFlow offers (TF 2.21, measured on CPU; tests/sharding/test_layout_and_options.py
keeps checking it):

- `tf.distribute.ReplicaContext.all_gather` works, but each call is a
  `merge_call`, two collectives (the shapes, then the padded data) and two
  transposes, and its gradient is an all-reduce followed by a slice: every
  replica then holds the full reduced gradient, which is what ZeRO stage 2
  exists to avoid.
- `CollectiveGatherV2` (`collective_ops.all_gather_v2`): one collective for
  equal shapes. tfdist's all-gather is this op.
- `CollectiveReduceScatterV2` has no CPU (ring) implementation: it fails with
  "CollectiveRegistry::Lookup did not find collective implementation" (only
  NCCL implements it), and nothing public wraps it.
- `CollectiveAllToAllV2` works on CPU and across workers.

So tfdist's reduce-scatter is an all-to-all of the gradient cut into N
blocks, then a local sum of the N blocks each replica receives: every
replica sends and receives (N-1)/N of the gradient, as in a ring
reduce-scatter (half an all-reduce), and never holds the reduced whole; the
price is one gradient-sized receive buffer per call (a ring needs 1/N of it).

The collectives run on the strategy's own `CollectiveReplicaLauncher`s
(private: `CollectiveAllReduce._launchers`, each with its group key,
instance-key counter and ordering token), so on each device they are ordered
with Keras's own all-reduces and every replica issues them in the same order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfdist import state as state_lib
from tfdist._tf import import_tensorflow
from tfdist.sharding.errors import EagerStepError, ShardingUnavailableError


@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    """Where this process's replicas sit in the strategy's collective group.

    Attributes:
      num_replicas: N, replicas in sync over all workers (the collective group).
      local_devices: this process's replica devices, in replica order.
      ranks: each local replica's rank in the collective group (the position
        of its block in an all-gather), in replica order.
    """

    num_replicas: int
    local_devices: tuple[str, ...]
    ranks: tuple[int, ...]


def _collective_ops(strategy: Any):
    from tensorflow.python.distribute import cross_device_ops

    extended = strategy.extended
    for name in ("_collective_ops", "_cross_device_ops"):
        ops = getattr(extended, name, None)
        if isinstance(ops, cross_device_ops.CollectiveAllReduce):
            return ops
    raise ShardingUnavailableError(
        f"{type(strategy).__name__} on {', '.join(extended.worker_devices)} has no collective "
        "all-reduce (TensorFlow falls back to reducing on one device when CPUs and GPUs are "
        "mixed), and sharding is built from collectives. Received devices of mixed types. "
        "Use replicas of one device type.")


def replica_layout(strategy: Any) -> ReplicaLayout:
    """This process's replicas and their ranks in the strategy's collective group.

    TensorFlow orders a collective group's members by full device name: job,
    replica, task, device type, then device index
    (`DeviceNameUtils::CompareFullNames`), which is not the order a user may
    list `devices` in; the rank decides which block of an all-gather a
    replica contributes, so it decides which shard each replica owns.
    """
    tf = import_tensorflow()
    ops = _collective_ops(strategy)
    local = tuple(launcher._device for launcher in ops._launchers)
    devices = tuple(strategy.extended.worker_devices)
    canonical = [tf.DeviceSpec.from_string(d) for d in devices]
    if [tf.DeviceSpec.from_string(d).to_string() for d in local] != [
            d.to_string() for d in canonical]:
        raise ShardingUnavailableError(
            f"The strategy's collective devices ({', '.join(local)}) differ from its replica "
            f"devices ({', '.join(devices)}); tfdist cannot tell which replica owns which "
            "shard.")
    group_size = ops._group_size
    num_local = len(local)
    first = _worker_index(strategy) * num_local

    def key(spec):
        return (spec.job or "", spec.replica or 0, spec.task or 0, spec.device_type or "",
                spec.device_index or 0)

    order = sorted(range(num_local), key=lambda i: key(canonical[i]))
    ranks = [0] * num_local
    for position, replica in enumerate(order):
        ranks[replica] = first + position
    return ReplicaLayout(num_replicas=group_size, local_devices=devices, ranks=tuple(ranks))


def _worker_index(strategy: Any) -> int:
    # MultiWorkerMirroredStrategy: the worker's place in the cluster (chief first), which is
    # also how the collective group orders the workers' devices (by job name, then task).
    return int(getattr(strategy.extended, "_id_in_cluster", 0) or 0)


def local_replica_id() -> int:
    """This replica's index among the process's replicas (replica context only)."""
    from tensorflow.python.distribute import values_util

    replica = values_util.get_current_replica_id_as_int()
    if replica is None:
        raise RuntimeError("local_replica_id() needs a replica context (inside strategy.run).")
    return int(replica)


def _launcher(strategy: Any):
    tf = import_tensorflow()
    if tf.executing_eagerly():
        # Eager replica threads issue the collectives one device at a time: they deadlock.
        raise EagerStepError(
            "Sharding exchanges shards with collectives that only run inside a compiled "
            "training step (tf.function). Received: a step running eagerly "
            "(model.compile(run_eagerly=True) or tf.config.run_functions_eagerly(True)). "
            "Fix: drop run_eagerly (or shard='none' to debug eagerly).")
    return _collective_ops(strategy)._launchers[local_replica_id()]


def all_gather(strategy: Any, tensor: Any) -> Any:
    """Concatenates every replica's `tensor` (same shape everywhere) along axis 0, in rank order.

    Replica context, inside a tf.function; every replica must call it, in the
    same order as its other collectives.
    """
    tf = import_tensorflow()
    from tensorflow.python.ops import gen_collective_ops

    launcher = _launcher(strategy)
    options = launcher._options
    with tf.device(launcher._device):
        gathered = gen_collective_ops.collective_gather_v2(
            tensor, group_size=launcher._group_size, group_key=launcher._group_key,
            instance_key=launcher._next_instance_key(),
            ordering_token=[launcher._get_ordering_token()],
            communication_hint=options.implementation.value,
            timeout_seconds=options.timeout_seconds or 0)
        if tensor.shape.is_fully_defined():  # the collective's output has no static shape
            gathered = tf.reshape(gathered, [tensor.shape[0] * launcher._group_size,
                                             *tensor.shape[1:]])
        return gathered


def reduce_scatter(strategy: Any, tensor: Any) -> Any:
    """Block `rank` of the sum over replicas of `tensor` ([N * S] -> [S]).

    Built from an all-to-all (TensorFlow has no CPU reduce-scatter): the
    [N, S] blocks go one to each replica, which sums the N blocks it gets.
    """
    tf = import_tensorflow()
    from tensorflow.python.ops import gen_collective_ops

    launcher = _launcher(strategy)
    options = launcher._options
    group_size = launcher._group_size
    with tf.device(launcher._device):
        blocks = tf.reshape(tensor, [group_size, -1])
        received = gen_collective_ops.collective_all_to_all_v2(
            blocks, group_size=group_size, group_key=launcher._group_key,
            instance_key=launcher._next_instance_key(),
            ordering_token=[launcher._get_ordering_token()],
            communication_hint=options.implementation.value,
            timeout_seconds=options.timeout_seconds or 0)
        summed = tf.reduce_sum(received, axis=0)
        size = tensor.shape.num_elements()
        if size is not None:  # the collective's output has no static shape
            summed = tf.reshape(summed, [size // group_size])
        return summed


def gather_blocks(strategy: Any, blocks: Any) -> Any:
    """All replicas' blocks, concatenated in rank order, from a cross-replica context.

    `blocks` is a PerReplica value (one block per local replica). A collective
    across workers: every worker must call it, in the same order. One traced
    function per strategy and block shape (TensorFlow's `strategy.gather`
    traces a new function on every call).
    """
    tf = import_tensorflow()
    state = state_lib.state_of(strategy)
    function = None if state is None else state.gather
    if function is None:
        def run(values):
            result = strategy.run(lambda value: all_gather(strategy, value), args=(values,))
            return strategy.experimental_local_results(result)[0]

        function = tf.function(run, reduce_retracing=True)
        if state is not None:
            state.gather = function
    return function(blocks)


def check_supported() -> None:
    """Raises CompatError if the private TensorFlow pieces used here changed shape."""
    from tensorflow.python.distribute import cross_device_ops, cross_device_utils, values_util
    from tensorflow.python.ops import gen_collective_ops

    from tfdist.compat import _patch

    _patch.require_attributes(cross_device_utils.CollectiveReplicaLauncher,
                              "_next_instance_key", "_get_ordering_token",
                              what="CollectiveReplicaLauncher")
    _patch.require_attributes(gen_collective_ops, "collective_gather_v2",
                              "collective_all_to_all_v2", what="gen_collective_ops")
    _patch.require_attributes(values_util, "get_current_replica_id_as_int",
                              what="tensorflow values_util")
    _patch.require_attributes(cross_device_ops, "CollectiveAllReduce",
                              what="tensorflow cross_device_ops")
