"""`ShardedSync`: the GradientSync of a sharding strategy (ZeRO stages 1-3, host offload).

Runs inside Keras's optimizer update (tfdist.compat.optimizer_update), in
each replica, in two steps:

`reduce` (what crosses the wire before the update):
- replicated variables (small ones, below `shard_min_bytes`): all-reduce, as
  without sharding (duplicate sparse indices summed);
- stage 1: every gradient is all-reduced (each replica holds it whole);
- stage 2: gradients of sharded variables are reduce-scattered in one packed
  collective: each replica receives only the sum of its shard;
- stage 3: gradients of sharded weights arrive already reduce-scattered
  (they are the gradients of the replica's shard: the backward of the
  all-gather that read the weight), so nothing is exchanged here.

`apply` (the update):
- replicated variables: Keras's own update;
- sharded variables: each replica runs the optimizer's own `update_step` on
  its shard of the variable, the gradient and the (sharded) slots, on its
  device or, with offload, on the host CPU; stages 1 and 2 then all-gather
  the updated shards (one packed collective) into every replica's whole copy;
  stage 3 keeps only the shard.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from tfdist._tf import import_tensorflow
from tfdist import sync as gradient_sync_lib
from tfdist.compat import optimizer_update
from tfdist.compat import sharding_collectives as collectives
from tfdist.compat import sharding_variables as variables_lib
from tfdist.sharding import registry

_WHOLE, _REDUCED_THEN_SLICED, _SCATTERED, _GATHERED = "whole", "stage1", "stage2", "stage3"
SCALAR_READS = "(scalar variable reads)"


class _ParameterShard:
    """The replica's shard of a variable, as the optimizer's `update_step` sees it.

    `update_step(gradient, variable, lr)` finds the slots by the variable's key
    and writes the result with `assign_sub`/`assign_add`/`assign`; this object
    carries the real variable's key and collects the written value.
    """

    def __init__(self, *, key, block, name: str):
        self._unique_id = key
        self._value = block
        self.name = name

    @property
    def dtype(self):
        return self._value.dtype

    @property
    def shape(self):
        return self._value.shape

    def assign(self, value, use_locking=None, name=None, read_value=True):
        tf = import_tensorflow()
        self._value = tf.cast(tf.convert_to_tensor(value), self.dtype)
        return self._value

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        return self.assign(self._value + delta)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        return self.assign(self._value - delta)

    def __tf_tensor__(self, dtype=None, name=None):
        tf = import_tensorflow()
        return self._value if dtype in (None, self.dtype) else tf.cast(self._value, dtype)

    def value(self):
        return self._value

    read_value = value


class ShardedSync(gradient_sync_lib.GradientSync):
    """Reduce-scatter / sharded update / all-gather for one strategy (see the module doc).

    Attributes:
      plan: the strategy's `ShardingPlan`.
      traced_gradient_bytes: per replica device, the bytes of the reduced
        gradients handed to the update in the last traced step (read from the
        graph's tensors), for the memory figures.
      traced_update_devices: per replica device, how many graph ops of the
        sharded updates were placed on each device (with offload: the host).
    """

    # Stage 2 hands each replica the sum of its shard only.
    reduces_whole_gradients = False

    def __init__(self, strategy: Any, plan: Any):
        self._strategy = weakref.ref(strategy)
        self.plan = plan
        self.traced_gradient_bytes: dict[str, int] = {}
        self.traced_update_devices: dict[str, dict[str, int]] = {}
        self._checked: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._lock = threading.Lock()

    # -- which path each variable takes ---------------------------------------------

    def _kind(self, variable: Any) -> str:
        if variables_lib.sharded_storage(variable) is not None:
            return _GATHERED
        tf = import_tensorflow()
        if not self.plan.shards(variable.shape, tf.as_dtype(variable.dtype).size):
            return _WHOLE
        return _REDUCED_THEN_SLICED if self.plan.stage == 1 else _SCATTERED

    def _check(self, optimizer: Any) -> None:
        with self._lock:
            if optimizer in self._checked:
                return
        registry.check_optimizer(optimizer, stage=self.plan.stage)
        with self._lock:
            self._checked.add(optimizer)

    # -- GradientSync ------------------------------------------------------------------

    @property
    def weights_examples(self) -> bool:
        """Stages 1 and 2 carry the example count (tfdist.sync.sum_over_replicas): in the
        all-reduce, or as one more column of the reduce-scatter, so every shard holds the
        sum. Stage 3's gradients are reduce-scattered inside the backward pass
        (`sharding_variables`), before the count could join them."""
        return self.plan.stage < 3

    @property
    def clips_reduced_gradients(self) -> bool:
        """Stages 1 and 2 clip the summed gradients as one device does (`clip`); stage 3
        refuses clipping (registry.check_optimizer): its gradients are summed and cut into
        shards inside the backward pass."""
        return self.plan.stage < 3

    def clip(self, optimizer, grads_and_vars, keras_clip):
        """Keras's clipping of the whole summed gradients, where stage 2 holds a shard of some.

        A shard's part of a norm is the sum of its squares: those are summed over the
        replicas in one small all-reduce (one value per sharded gradient), only where the
        optimizer clips by a norm; `clipvalue` is element-wise and needs none. Gradients
        every replica holds whole (replicated variables, and every gradient at stage 1) are
        clipped by Keras's own code where their norms are their own (`clipnorm`).
        """
        pairs = list(grads_and_vars)
        sharded = [g is not None and self._kind(v) == _SCATTERED for g, v in pairs]
        clipnorm = getattr(optimizer, "clipnorm", None)
        global_clipnorm = getattr(optimizer, "global_clipnorm", None)
        by_norm = (clipnorm and clipnorm > 0) or (global_clipnorm and global_clipnorm > 0)
        if not any(sharded) or not by_norm:
            return super().clip(optimizer, pairs, keras_clip)
        tf = import_tensorflow()
        squares = [None if g is None else _sum_of_squares(tf, g) for g, _ in pairs]
        mine = tf.stack([q for q, s in zip(squares, sharded) if s])
        summed = iter(tf.unstack(tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, mine)))
        squares = [next(summed) if s else q for q, s in zip(squares, sharded)]
        grads = [g for g, _ in pairs]
        if clipnorm and clipnorm > 0:  # Keras checks clipnorm first
            whole = keras_clip([None if s else g for g, s in zip(grads, sharded)])
            clipped = [_clip_by_norm(tf, g, q, clipnorm) if s else w
                       for g, q, s, w in zip(grads, squares, sharded, whole)]
        else:
            # keras.optimizers' clip_by_global_norm, over the whole summed gradients.
            use_norm = tf.sqrt(tf.add_n([q for q in squares if q is not None]))
            scale = global_clipnorm * tf.minimum(1.0 / use_norm, 1.0 / global_clipnorm)
            scale = scale + (use_norm - use_norm)  # NaN where the norm is not finite
            clipped = [gradient_sync_lib.map_values(g, lambda x: x * tf.cast(scale, x.dtype))
                       for g in grads]
        return [(g, v) for g, (_, v) in zip(clipped, pairs)]

    def reduce(self, optimizer, grads_and_vars, keras_all_reduce):
        return self._reduce(optimizer, grads_and_vars, keras_all_reduce)[0]

    def reduce_counted(self, optimizer, grads_and_vars, count, keras_all_reduce):
        return self._reduce(optimizer, grads_and_vars, keras_all_reduce, count)

    def _reduce(self, optimizer, grads_and_vars, keras_all_reduce, count=None):
        """(reduced pairs, `count` summed over replicas by one of the collectives, or None)."""
        tf = import_tensorflow()
        self._check(optimizer)
        strategy = self._strategy()
        pairs = list(grads_and_vars)
        kinds = [self._kind(v) for _, v in pairs]
        out: list[Any] = [g for g, _ in pairs]
        total = None

        all_reduce = [i for i, k in enumerate(kinds)
                      if pairs[i][0] is not None and k in (_WHOLE, _REDUCED_THEN_SLICED)]
        if all_reduce:
            gathered = [pairs[i] for i in all_reduce]
            if count is None:
                reduced = gradient_sync_lib.DEFAULT_SYNC.reduce(optimizer, gathered,
                                                                keras_all_reduce)
            else:
                reduced, total = gradient_sync_lib.DEFAULT_SYNC.reduce_counted(
                    optimizer, gathered, count, keras_all_reduce)
            for i, (g, _) in zip(all_reduce, reduced):
                out[i] = g

        scatter = [i for i, k in enumerate(kinds) if pairs[i][0] is not None and k == _SCATTERED]
        if scatter:
            layouts = [self.plan.layout(pairs[i][1].shape) for i in scatter]
            blocks = [tf.reshape(_padded(tf, _dense(tf, pairs[i][0]), layout),
                                 [layout.num_shards, layout.shard_size])
                      for i, layout in zip(scatter, layouts)]
            sizes = [layout.shard_size for layout in layouts]
            if count is not None and total is None:  # every shard gets the summed count
                blocks.append(tf.fill([layouts[0].num_shards, 1], count))
                sizes.append(1)
            packed = tf.reshape(tf.concat(blocks, axis=1), [-1])
            mine = tf.split(collectives.reduce_scatter(strategy, packed), sizes)
            if len(sizes) > len(scatter):
                total = tf.reshape(mine.pop(), [])
            for i, shard in zip(scatter, mine):
                out[i] = shard

        result = [(g, v) for g, (_, v) in zip(out, pairs)]
        self._record(result)
        return result, total

    def apply(self, optimizer, grads_and_vars, learning_rate, keras_apply):
        tf = import_tensorflow()
        strategy = self._strategy()
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        whole = [(g, v) for g, v in pairs if self._kind(v) == _WHOLE]
        if whole:
            keras_apply(whole, learning_rate)
        sharded = [(g, v, self._kind(v)) for g, v in pairs if self._kind(v) != _WHOLE]
        if not sharded:
            return
        replica = collectives.local_replica_id()
        rank = self.plan.ranks[replica]
        device = self.plan.local_devices[replica]
        state_device = self.plan.state_device(replica)
        to_gather = []
        for gradient, variable, kind in sharded:
            storage = variables_lib.sharded_storage(variable)
            if storage is not None:
                layout = storage.layout
                with tf.device(device):
                    block = storage.local().read_value()
            else:
                layout = self.plan.layout(variable.shape)
                local = strategy.experimental_local_results(variable)[replica]
                with tf.device(device):
                    block = _block(tf, local.read_value(), layout, rank)
            if kind == _REDUCED_THEN_SLICED:
                with tf.device(device):
                    gradient = _block(tf, _dense(tf, gradient), layout, rank)
            graph = tf.compat.v1.get_default_graph()
            first_op = len(graph.get_operations()) if not tf.executing_eagerly() else 0
            with tf.device(state_device):
                shard = _ParameterShard(key=optimizer_update.variable_key(optimizer, variable),
                                        block=tf.identity(block), name=variable.name)
                optimizer.update_step(gradient, shard, learning_rate)
                updated = shard.value()
            if not tf.executing_eagerly():
                self._record_update_ops(replica, graph.get_operations()[first_op:])
            if storage is not None:
                with tf.device(device):
                    storage.assign_block(updated)
            else:
                to_gather.append((local, layout, updated))
        if to_gather:
            with tf.device(device):
                packed = tf.concat([updated for _, _, updated in to_gather], axis=0)
                gathered = tf.reshape(collectives.all_gather(strategy, packed),
                                      [self.plan.num_replicas, -1])
                columns = tf.split(gathered, [layout.shard_size for _, layout, _ in to_gather],
                                   axis=1)
                for (local, layout, _), column in zip(to_gather, columns):
                    flat = tf.reshape(column, [-1])[:layout.num_elements]
                    local.assign(tf.reshape(flat, layout.shape))

    # -- figures -------------------------------------------------------------------------

    def _record_update_ops(self, replica: int, ops) -> None:
        device = self.plan.local_devices[replica]
        with self._lock:
            seen = self.traced_update_devices.setdefault(device, {})
            for op in ops:
                where = op.device
                if not where and op.type == "ReadVariableOp" and all(
                        t.shape.rank == 0 for t in op.outputs):
                    # The optimizer's step counter and learning rate: scalars read where
                    # they live (no device of their own in the graph).
                    where = SCALAR_READS
                seen[where] = seen.get(where, 0) + 1

    def _record(self, grads_and_vars) -> None:
        from tfdist.sharding import memory

        replica = collectives.local_replica_id()
        total = memory.reduced_gradient_bytes(grads_and_vars)
        with self._lock:
            self.traced_gradient_bytes[self.plan.local_devices[replica]] = total


def _dense(tf, gradient):
    # An IndexedSlices gradient becomes dense with duplicate indices summed, which is what
    # the default sync's de-duplication gives the optimizer too.
    return tf.convert_to_tensor(gradient)


def _sum_of_squares(tf, gradient):
    # An IndexedSlices' slices, as Keras's norms square them; a shard's padding is zeros.
    values = gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
    return tf.cast(tf.reduce_sum(tf.square(values)), "float32")


def _clip_by_norm(tf, gradient, l2sum, clipnorm):
    """BaseOptimizer._clip_by_norm's arithmetic, with the squares summed beforehand."""
    l2sum = tf.cast(l2sum, gradient.dtype)
    positive = l2sum > 0
    l2norm = tf.where(positive, tf.sqrt(tf.where(positive, l2sum, tf.ones_like(l2sum))), l2sum)
    return gradient * tf.cast(clipnorm, gradient.dtype) / tf.maximum(
        l2norm, tf.cast(clipnorm, gradient.dtype))


def _padded(tf, value, layout):
    flat = tf.reshape(value, [-1])
    return tf.pad(flat, [[0, layout.padded_size - layout.num_elements]])


def _block(tf, value, layout, rank):
    start, stop = layout.shard_range(rank)
    return _padded(tf, value, layout)[start:stop]
