"""`CommSync`: the GradientSync that compresses gradients and all-reduces them in buckets.

It runs inside Keras's optimizer update (tfdist.compat.optimizer_update), in
each replica, in place of Keras's single all-reduce:

- sparse gradients (`tf.IndexedSlices`, e.g. from `Embedding`) go through
  Keras's own all-reduce and have their duplicate indices summed, exactly as
  without compression (they are not compressed: only the rows a batch
  touched cross the wire already, and casting or factorising the gathered
  rows would buy little for the error it adds);
- dense gradients are grouped into buckets of about `bucket_bytes`, last
  layers first (the order the backward pass produces them) and cut at layer
  boundaries (`tfdist.comm.buckets`); each bucket is one collective whose
  only inputs are its own gradients, so it can start while the backward pass
  is still computing earlier layers (TensorFlow's executor runs an op as soon
  as its inputs exist); with `bucket_priority` (the default) each bucket's
  gradient ops also run before the backward pass moves on to the layers below
  (`tfdist.compat.backward_priority`), so that its inputs exist early;
- "fp16"/"bf16": each gradient is cast to half precision before the
  all-reduce and back after (the sum is taken in half precision too, as in
  Horovod's `Compression.fp16`);
- "powersgd": see `tfdist.comm.powersgd`. For `warmup_steps` optimizer
  steps the gradients are all-reduced whole; the switch is a `tf.cond` on
  the optimizer's step counter, which the merge-free collectives of
  `tfdist.compat.comm_collectives` allow.

Every replica ends with the same reduced gradients (the collectives hand
every replica the same sum; orthogonalisation is deterministic), so
replicas stay identical.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable

import numpy as np

from tfdist._tf import import_tensorflow
from tfdist.comm import buckets as buckets_lib
from tfdist.comm import powersgd
from tfdist.compat import backward_priority
from tfdist.compat import comm_collectives as collectives
from tfdist import sync as sync_lib
from tfdist.compat import optimizer_update
from tfdist.planning.units import format_bytes

_HALF = {"fp16": "float16", "bf16": "bfloat16"}
# Seed of PowerSGD's initial Q matrices: the same on every replica and worker.
_Q_SEED = 20190531
# A layout with more buckets than this, of less than SMALL_BUCKET_BYTES each on average, is
# warned about: every bucket is its own all-reduce, and each pays a ring round trip.
MANY_BUCKETS = 64
SMALL_BUCKET_BYTES = 1 << 20


class CommSync(sync_lib.GradientSync):
    """Gradient compression (none, fp16, bf16, powersgd) and bucketed all-reduce.

    Args:
      strategy: the strategy (made by tfdist) whose replicas this sync joins.
      compression: "none", "fp16", "bf16" or "powersgd".
      rank: PowerSGD rank.
      warmup_steps: PowerSGD: optimizer steps all-reduced uncompressed first.
      bucket_bytes: dense gradients per collective, in bytes of the
        uncompressed gradients (0: one collective for all of them).
      bytes_per_pack: TensorFlow's packing inside each collective (0: one pack).
      bucket_priority: with bucket_bytes, compute each bucket's gradients before
        the backward pass moves on (tfdist.compat.backward_priority).
    """

    def __init__(self, *, strategy: Any, compression: str = "none", rank: int = 4,
                 warmup_steps: int = 0, bucket_bytes: int = 0, bytes_per_pack: int = 0,
                 bucket_priority: bool = True):
        collectives.check_collectives(strategy)
        self.strategy = strategy
        self.compression = compression
        self.rank = rank
        self.warmup_steps = warmup_steps
        self.bucket_bytes = bucket_bytes
        self.bytes_per_pack = bytes_per_pack
        self.bucket_priority = bucket_priority
        # optimizer -> {variable key: (error, q)}; weak: an optimizer's state goes with it.
        self._state_of: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
        # optimizer -> {variable key: the variable's layer}, for cutting buckets at layers.
        self._layers_of: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
        self._warned: set = set()  # the layouts warned about, as (buckets, bytes)

    def __repr__(self) -> str:
        extra = (f", rank={self.rank}, warmup_steps={self.warmup_steps}"
                 if self.compression == "powersgd" else "")
        priority = "" if self.bucket_priority or not self.bucket_bytes \
            else ", bucket_priority=False"
        return (f"CommSync(compression={self.compression!r}{extra}, "
                f"bucket_bytes={self.bucket_bytes}{priority})")

    @property
    def reduces_before_loss_scale(self) -> bool:
        """A LossScaleOptimizer's gradients are summed before its finite check
        (tfdist.compat.loss_scale), so buckets can start during the backward pass; not
        PowerSGD, whose error feedback would take in a skipped step's gradients."""
        return self.compression != "powersgd"

    # -- state ------------------------------------------------------------------------

    def build_state(self, optimizer: Any, variables: list) -> None:
        """Creates PowerSGD's per-replica error and warm-start Q for `optimizer`.

        Called when Keras builds the optimizer (tfdist.compat.comm_collectives),
        under the strategy's scope. The variables are attributes of the
        optimizer, so Keras lists them in `optimizer.variables` and
        `tfdist.BackupAndRestore` saves them with the optimizer:
        `<variable>_powersgd_error` (SyncOnRead, SUM: a backup holds the sum
        over replicas, which is all the training depends on) and
        `<variable>_powersgd_q` (SyncOnRead, first replica: identical on all).

        Also records each variable's layer (`tfdist.comm.buckets.layer_of`), so
        that buckets are cut at layer boundaries.

        Raises:
          ValueError: the rank exceeds the smaller dimension of every weight matrix.
        """
        self._layers_of[optimizer] = {optimizer_update.variable_key(optimizer, v):
                                      buckets_lib.layer_of(v) for v in variables}
        if self.compression != "powersgd":
            return
        import keras

        powersgd.check_rank([(v.path, tuple(v.shape)) for v in variables], self.rank)
        errors, qs = [], []
        with self.strategy.scope():
            for index, variable in enumerate(variables):
                shape = tuple(variable.shape)
                if not powersgd.compresses(shape, self.rank):
                    continue
                n, m = powersgd.matrix_shape(shape)
                base = variable.path.replace("/", "_")
                errors.append(keras.Variable(
                    np.zeros((n, m), "float32"), trainable=False, name=f"{base}_powersgd_error",
                    synchronization="on_read", aggregation="sum"))
                qs.append(keras.Variable(
                    _initial_q(m, self.rank, index), trainable=False, name=f"{base}_powersgd_q",
                    synchronization="on_read", aggregation="only_first_replica"))
        # Attributes of the optimizer: tracked (Keras's tracker and TensorFlow's
        # object graph), so saved and restored with it.
        collectives.track_on_optimizer(optimizer, powersgd_errors=errors, powersgd_qs=qs)
        keys = [optimizer_update.variable_key(optimizer, v) for v in variables
                if powersgd.compresses(tuple(v.shape), self.rank)]
        self._state_of[optimizer] = dict(zip(keys, zip(errors, qs)))

    def _state(self, optimizer: Any, variable: Any):
        states = self._state_of.get(optimizer)
        if states is None:
            raise ValueError(
                "gradient_compression='powersgd' keeps its state in the optimizer, created "
                "when Keras builds it; this optimizer was not built under the tfdist strategy "
                "that compresses. Create and compile the model (or call "
                "optimizer.build(model.trainable_variables)) under strategy.scope().")
        return states.get(optimizer_update.variable_key(optimizer, variable))

    # -- the exchange ----------------------------------------------------------------

    @property
    def weights_examples(self) -> bool:
        """The example count rides in an uncompressed collective (tfdist.sync.sum_over_replicas):
        not with fp16/bf16 (a count above 2048 or 256 is not exact there) or PowerSGD."""
        return self.compression == "none"

    def reduce(self, optimizer: Any, grads_and_vars,
               keras_all_reduce: Callable) -> list:
        return self._reduce(optimizer, grads_and_vars, keras_all_reduce)[0]

    def reduce_counted(self, optimizer: Any, grads_and_vars, count: Any,
                       keras_all_reduce: Callable) -> tuple[list, Any]:
        return self._reduce(optimizer, grads_and_vars, keras_all_reduce, count)

    def _reduce(self, optimizer: Any, grads_and_vars, keras_all_reduce: Callable,
                count: Any = None) -> tuple[list, Any]:
        """(reduced grads_and_vars, `count` summed in the first dense collective, or in the
        sparse one where there is no dense gradient; None without a count)."""
        tf = import_tensorflow()
        grads_and_vars = list(grads_and_vars)
        out: list = list(grads_and_vars)
        sparse = [i for i, (g, _) in enumerate(grads_and_vars)
                  if isinstance(g, tf.IndexedSlices)]
        dense = [i for i, (g, _) in enumerate(grads_and_vars)
                 if g is not None and not isinstance(g, tf.IndexedSlices)]
        total = None
        if sparse:
            counted = [] if count is None or dense else [(count, None)]
            reduced = list(keras_all_reduce([grads_and_vars[i] for i in sparse] + counted))
            if counted:
                total = reduced.pop()[0]
            summing = sync_lib.sums_duplicates(optimizer)
            for i, (g, v) in zip(sparse, reduced):
                out[i] = (sync_lib.sum_duplicate_indices(g) if summing else g, v)
        layers_of = self._layers_of.get(optimizer, {})
        layers = [layers_of.get(optimizer_update.variable_key(optimizer, v))
                  for _, v in grads_and_vars]
        if self.compression == "powersgd":
            # Buckets of whole variables: PowerSGD factorises each matrix.
            order = list(reversed(dense))
            buckets = self._ordered(self._layout([grads_and_vars[i][0] for i in order],
                                                 [layers[i] for i in order], split=False),
                                    [grads_and_vars[i][0] for i in order])
            for bucket in buckets:
                indices = [order[segment.item] for segment in bucket]
                grads = [grads_and_vars[i][0] for i in indices]
                variables = [grads_and_vars[i][1] for i in indices]
                for i, g in zip(indices, self._powersgd(optimizer, grads, variables)):
                    out[i] = (g, grads_and_vars[i][1])
            return out, total
        extra = [] if count is None or not dense else [count]
        summed = self.sum_dense([grads_and_vars[i][0] for i in dense],
                                [layers[i] for i in dense], extra=extra)
        if extra:
            total = summed.pop()
        for i, g in zip(dense, summed):
            out[i] = (g, grads_and_vars[i][1])
        return out, total

    def sum_dense(self, grads: list, layers: list | None = None, *,
                  extra: list = ()) -> list:
        """Sums dense gradients over replicas (cast to half precision for fp16/bf16).

        Without bucket_bytes: one collective. With it: the gradients, last ones
        first, go into buckets of about bucket_bytes cut at layer boundaries
        (`layers`: each gradient's layer, None: each its own;
        `tfdist.comm.buckets.layout`: a layer larger than a bucket is cut into
        spans of its own), and each bucket is its own collective, depending
        only on its own gradients. Smaller messages also move faster over gRPC
        than one large one (see experiments/bench_allreduce.py).

        `extra` tensors (uncompressed) join the first collective, and their sums follow
        the gradients' in the list returned.
        """
        tf = import_tensorflow()
        half = getattr(tf, _HALF[self.compression]) if self.compression in _HALF else None
        sent = [tf.cast(g, half) if half is not None else g for g in grads]
        extra = list(extra)
        if not self.bucket_bytes:
            summed = self._all_reduce(sent + extra)
            extra = summed[len(sent):]
            summed = summed[:len(sent)]
        else:
            order = list(reversed(range(len(sent))))  # last gradients first
            flat: dict = {}
            parts: dict = {i: [] for i in order}

            def segment_tensor(segment):
                i = order[segment.item]
                if segment.stop is None:  # the whole gradient
                    return sent[i]
                if i not in flat:
                    flat[i] = tf.reshape(sent[i], [-1])
                return flat[i][segment.start:segment.stop]

            in_order = [grads[i] for i in order]
            buckets = self._ordered(
                self._layout(in_order, None if layers is None else [layers[i] for i in order]),
                in_order)
            for position, bucket in enumerate(buckets):
                riders = extra if position == 0 else []
                reduced = self._all_reduce([segment_tensor(segment) for segment in bucket]
                                           + riders)
                if riders:
                    extra = reduced[len(bucket):]
                for segment, r in zip(bucket, reduced):
                    parts[order[segment.item]].append(r)
            # A gradient's segments come in order: one whole, or spans to join.
            summed = [parts[i][0] if i not in flat
                      else tf.reshape(tf.concat(parts[i], 0), tf.shape(g))
                      for i, g in enumerate(sent)]
        if half is not None:
            summed = [tf.cast(s, g.dtype) for s, g in zip(summed, grads)]
        return summed + extra

    def _layout(self, grads: list, layers: list | None, *, split: bool = True) -> list:
        """`tfdist.comm.buckets.layout` of `grads` (sending order), in float32-equivalent
        bytes: fp16/bf16 buckets are counted by the gradients' own bytes. Warns where the
        buckets are many and small (`warn_if_many`)."""
        buckets = buckets_lib.layout(
            [g.shape.num_elements() if g.shape.is_fully_defined() else 0 for g in grads],
            self.bucket_bytes, layers=layers, bytes_per_element=[g.dtype.size for g in grads],
            split=split)
        self.warn_if_many(buckets, grads)
        return buckets

    def _ordered(self, buckets: list, grads: list) -> list:
        """`buckets` (of `grads`, in sending order), after making the backward pass compute
        each bucket's gradients before it moves on (tfdist.compat.backward_priority), where
        bucket_priority asks for it and there is more than one bucket."""
        if self.bucket_priority and len(buckets) > 1:
            backward_priority.prioritise(
                [[grads[segment.item] for segment in bucket] for bucket in buckets])
        return buckets

    def warn_if_many(self, buckets: list, grads: list) -> None:
        """Warns, once per layout, where `buckets` (of `grads`) are more than MANY_BUCKETS
        and average less than SMALL_BUCKET_BYTES: each is its own all-reduce, so a step pays
        the collective's latency once per bucket. With a small `bucket_bytes` a model's
        step can slow several-fold (and its trace take minutes) without an error to say
        why."""
        # Every element of every gradient is in exactly one bucket.
        total = sum(g.shape.num_elements() * g.dtype.size for g in grads
                    if g.shape.is_fully_defined())
        count = len(buckets)
        if count <= MANY_BUCKETS or total >= count * SMALL_BUCKET_BYTES \
                or (count, total) in self._warned:
            return
        self._warned.add((count, total))
        warnings.warn(
            f"tfdist: bucket_bytes={self.bucket_bytes} cuts {format_bytes(total)} of "
            f"gradients into {count} buckets ({format_bytes(total / count)} each on "
            "average), and each bucket is its own all-reduce: every step pays a collective's "
            f"round trip {count} times (1-2 ms each between two processes on one host, "
            "more between hosts and with more workers), and tracing the step takes longer "
            "with each. Buckets of 1-25 MiB are the usual range (PyTorch DDP's default is "
            f"25 MiB): pass a larger bucket_bytes, or 0 for one all-reduce. "
            "tfdist.planning.bucket_collectives(shapes, bucket_bytes=..., layers=...) counts "
            "the collectives of a size before you train.", UserWarning, stacklevel=2)

    def _all_reduce(self, tensors: list) -> list:
        """One collective per dtype among `tensors` (a pack is concatenated)."""
        dtypes = list(dict.fromkeys(t.dtype for t in tensors))
        if len(dtypes) <= 1:
            return collectives.all_reduce_sum(self.strategy, tensors,
                                              bytes_per_pack=self.bytes_per_pack)
        out: list = [None] * len(tensors)
        for dtype in dtypes:
            indices = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            summed = collectives.all_reduce_sum(self.strategy, [tensors[i] for i in indices],
                                                bytes_per_pack=self.bytes_per_pack)
            for i, t in zip(indices, summed):
                out[i] = t
        return out

    def _powersgd(self, optimizer, grads: list, variables: list) -> list:
        tf = import_tensorflow()
        states = [self._state(optimizer, v) for v in variables]
        if not any(states):
            return self._all_reduce(grads)
        if not self.warmup_steps:
            return self._compressed(grads, states)
        return tf.cond(optimizer.iterations < self.warmup_steps,
                       lambda: self._all_reduce(grads),
                       lambda: self._compressed(grads, states))

    def _compressed(self, grads: list, states: list) -> list:
        tf = import_tensorflow()
        replicas = float(self.strategy.num_replicas_in_sync)
        whole = [i for i, s in enumerate(states) if s is None]
        low = [i for i, s in enumerate(states) if s is not None]
        # A_i = gradient + this replica's error, as an n x m matrix.
        matrices = {i: tf.reshape(tf.cast(grads[i], tf.float32), states[i][0].shape)
                    + states[i][0].value for i in low}
        # Round 1: P = A Q (with the uncompressed gradients in the same collective).
        ps = [tf.matmul(matrices[i], states[i][1].value) for i in low]
        first = self._all_reduce([grads[i] for i in whole] + ps)
        reduced_whole, ps = first[:len(whole)], first[len(whole):]
        ps = [tf.linalg.qr(p)[0] for p in ps]
        # Round 2: Q = A^T P.
        qs = self._all_reduce([tf.matmul(matrices[i], p, transpose_a=True)
                               for i, p in zip(low, ps)])
        out: list = [None] * len(grads)
        updates = []
        for i, g in zip(whole, reduced_whole):
            out[i] = g
        for i, p, q in zip(low, ps, qs):
            error, q_state = states[i]
            approx = tf.matmul(p, q, transpose_b=True)
            updates.append(error.assign(matrices[i] - approx / replicas))
            updates.append(q_state.assign(q))
            out[i] = tf.cast(tf.reshape(approx, tf.shape(grads[i])), grads[i].dtype)
        with tf.control_dependencies(updates):
            return [tf.identity(g) for g in out]


def _initial_q(columns: int, rank: int, index: int) -> np.ndarray:
    """An orthonormal columns x rank matrix, the same on every replica and worker."""
    rng = np.random.default_rng([_Q_SEED, index])
    q, _ = np.linalg.qr(rng.standard_normal((columns, rank)))
    return q.astype("float32")
