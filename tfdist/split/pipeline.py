"""GPipe-style pipeline over placed stages, as a keras.Model: `split_model`.

Each batch is split into M micro-batches. Micro-batch i runs stage 0 on its
device, hands the tensors crossing the cut to stage 1 on the next device,
and so on; the outputs are concatenated back into the full batch, so Keras
computes the loss on the whole batch exactly as for the unsplit model, and
gradients (sums over micro-batches) equal the unsplit ones up to fp32
summation order. By default (schedule="free") TensorFlow's executor runs
whatever op is ready; with schedule="gpipe", stage k of micro-batch i waits for
stage k of micro-batch i-1 (control dependencies): each device works through
its micro-batches in order while the next device consumes them, which is
what lets stage 1 of micro-batch i overlap stage 0 of micro-batch i+1. The
backward pass is the reverse pipeline: `tf.gradients` puts every gradient
op on its forward op's device (tfdist.compat.placed_training).

Data parallelism composes: with replicas=R, devices are grouped as R
replicas x K stages; a MirroredStrategy runs one replica per group, and
replica r runs stage k on devices[r*K + k].
"""

from __future__ import annotations

import contextlib
from typing import Literal, Sequence

import numpy as np

from tfdist._tf import import_tensorflow
from tfdist.compat import placed_training
from tfdist.split import balance, graph
from tfdist.split import plan as plan_lib

import_tensorflow()  # quietly, before keras imports TensorFlow itself

import keras  # noqa: E402

Schedule = Literal["gpipe", "free"]


def _has_batch_statistics(layers) -> list[str]:
    found = []
    for layer in layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            found.append(layer.name)
        elif any("moving_mean" in w.path or "moving_variance" in w.path
                 for w in layer.non_trainable_weights):
            found.append(layer.name)
    return found


class SplitModel(keras.Model):
    """A keras.Model running another model's layers across devices (see split_model).

    Attributes:
      plan: the Plan (stages for replica 0).
      micro_batches: M.
      replicas: R data-parallel replicas (1 = none).
      stages: the Stage objects (sub-models) in order.
      cuts: tensors crossing each stage boundary.
    """

    def __init__(self, *, functional, plan, stages, cuts, layer_map, source_order,
                 micro_batches, schedule, replica_devices, strategy, **kwargs):
        super().__init__(name=kwargs.pop("name", f"{functional.name}_split"), **kwargs)
        self.plan = plan
        self.micro_batches = micro_batches
        self.schedule = schedule
        self.stages = stages
        self.cuts = cuts
        self._stage_models = [s.model for s in stages]  # tracked: weights, save/load
        self._input_ids = tuple(id(t) for t in functional.inputs)
        self._input_names = tuple(t.name for t in functional.inputs)
        self._output_ids = tuple(id(t) for t in functional.outputs)
        self._single_output = len(functional.outputs) == 1
        self._layer_map = layer_map          # original layer name -> placed layer
        self._source_order = source_order    # [(layer name, weight index)] in model.weights order
        self.replica_devices = replica_devices  # [[stage devices of replica r], ...]
        self.replicas = len(replica_devices)
        self.strategy = strategy
        self.built = True

    # --- devices --------------------------------------------------------------------------
    def _replica_id(self) -> int:
        tf = import_tensorflow()
        if self.replicas == 1:
            return 0
        ctx = tf.distribute.get_replica_context()
        if ctx is None:
            return 0
        rid = tf.get_static_value(ctx.replica_id_in_sync_group)
        return 0 if rid is None else int(rid)

    def stage_device(self, stage: int, replica: int = 0) -> str:
        return self.replica_devices[replica][stage]

    def _map_device(self, device: str, replica: int) -> str:
        if replica == 0:
            return device
        base = self.replica_devices[0]
        return self.replica_devices[replica][base.index(device)] if device in base else device

    # --- forward --------------------------------------------------------------------------
    def _flat_inputs(self, inputs):
        if isinstance(inputs, dict):
            missing = [n for n in self._input_names if n not in inputs]
            if missing:
                raise ValueError(f"Missing inputs {missing}; expected keys {list(self._input_names)}.")
            return [inputs[n] for n in self._input_names]
        flat = keras.tree.flatten(inputs)
        if len(flat) != len(self._input_ids):
            raise ValueError(f"Expected {len(self._input_ids)} input tensor(s), received {len(flat)}.")
        return flat

    def _micro_split(self, x, training):
        """M equal micro-batches; for inference the batch is padded to a multiple of M.

        Training requires equal micro-batches (GPipe; a partial batch is a
        data-pipeline mistake worth reporting). Inference accepts any batch
        (evaluate/predict on a dataset's last partial batch): the batch is
        zero-padded to a multiple of M and the padding is cut from the outputs
        (samples are independent: batch-statistics layers are rejected).
        """
        tf = import_tensorflow()
        m = self.micro_batches
        if m == 1:
            return [x]
        if not training:
            pad = (-tf.shape(x)[0]) % m
            paddings = tf.concat([[[0, pad]], tf.zeros((tf.rank(x) - 1, 2), tf.int32)], axis=0)
            return tf.split(tf.pad(x, paddings), m, axis=0)
        static = x.shape[0]
        if static is not None:
            check_batch(int(static), m)
            return tf.split(x, m, axis=0)
        n = tf.shape(x)[0]
        with tf.control_dependencies([tf.debugging.assert_equal(
                n % m, 0, message=f"tfdist split_model: the training batch size must be "
                                  f"divisible by micro_batches={m}. Use a batch size that is a "
                                  f"multiple of {m} and drop the last partial batch "
                                  "(dataset.batch(..., drop_remainder=True)).")]):
            x = tf.identity(x)
        return tf.split(x, m, axis=0)

    def call(self, inputs, training=None):
        tf = import_tensorflow()
        replica = self._replica_id()
        flat = self._flat_inputs(inputs)
        with tf.device(self.stage_device(0, replica)):
            pieces = [self._micro_split(tf.convert_to_tensor(x), training) for x in flat]
        eager = tf.executing_eagerly()
        ordered = self.schedule == "gpipe" and not eager and self.micro_batches > 1
        last_of_stage: list[list] = [[] for _ in self.stages]
        outputs_per_micro = []
        for i in range(self.micro_batches):
            values = {tid: p[i] for tid, p in zip(self._input_ids, pieces)}
            for s, stage in enumerate(self.stages):
                with tf.device(self.stage_device(s, replica)):
                    args = [values[t] for t in stage.input_ids]
                    if ordered and last_of_stage[s]:
                        with tf.control_dependencies(last_of_stage[s]):
                            args = [tf.identity(a) for a in args]
                    outs = stage.model(args, training=training)
                    outs = keras.tree.flatten(outs)
                    last_of_stage[s] = outs
                for t, v in zip(stage.output_ids, outs):
                    values[t] = v
            outputs_per_micro.append([values[t] for t in self._output_ids])
        with tf.device(self.stage_device(len(self.stages) - 1, replica)):
            if self.micro_batches == 1:
                outs = outputs_per_micro[0]
            else:
                outs = [tf.concat([o[j] for o in outputs_per_micro], axis=0)
                        for j in range(len(self._output_ids))]
                if not training:  # drop the inference padding
                    n = tf.shape(flat[0])[0]
                    outs = [o[:n] for o in outs]
        return outs[0] if self._single_output else outs

    # --- training ---------------------------------------------------------------------------
    def compile(self, *args, **kwargs):
        if self.strategy is not None:
            with self.strategy.scope():
                super().compile(*args, **kwargs)
        else:
            super().compile(*args, **kwargs)
        if self.optimizer is not None:
            placed_training.colocate_optimizer_slots(self.optimizer)

    def train_step(self, data):
        return placed_training.placed_train_step(self, data)

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        if batch_size is not None and hasattr(x, "shape") and self.micro_batches > 1:
            check_batch(int(batch_size), self.micro_batches)
            last = int(x.shape[0]) % int(batch_size)
            if last and last % self.micro_batches:
                raise ValueError(
                    f"The last batch has {last} samples ({x.shape[0]} samples, batch_size="
                    f"{batch_size}), which does not divide into micro_batches="
                    f"{self.micro_batches}. Use a sample count that is a multiple of "
                    f"{self.micro_batches} or drop the remainder.")
        return super().fit(x, y, batch_size, *args, **kwargs)

    # --- weights in the original model's layout -----------------------------------------------
    def get_weights(self):
        per_layer = {name: layer.get_weights() for name, layer in self._layer_map.items()}
        return [per_layer[name][i] for name, i in self._source_order]

    def set_weights(self, weights):
        weights = list(weights)
        if len(weights) != len(self._source_order):
            raise ValueError(f"Expected {len(self._source_order)} arrays (the original model's "
                             f"get_weights() layout). Received: {len(weights)}")
        per_layer = {name: layer.get_weights() for name, layer in self._layer_map.items()}
        for (name, i), w in zip(self._source_order, weights):
            per_layer[name][i] = np.asarray(w)
        for name, layer in self._layer_map.items():
            layer.set_weights(per_layer[name])

    def placed_layers(self) -> dict:
        """{original layer name: the placed layer} (read its variables' devices)."""
        return dict(self._layer_map)


def check_batch(batch_size: int, micro_batches: int) -> None:
    if batch_size % micro_batches:
        raise ValueError(
            f"A batch of {batch_size} samples cannot be split into micro_batches="
            f"{micro_batches} equal micro-batches. Use a batch size that is a multiple of "
            f"{micro_batches} (e.g. {max(micro_batches, batch_size // micro_batches * micro_batches)})."
        )


def _source_order(model) -> list[tuple[str, int]]:
    owner = {}
    for layer in graph.source_layers(model):
        for i, w in enumerate(layer.weights):
            owner.setdefault(id(w), (layer.name, i))
    order = []
    for w in model.weights:
        if id(w) not in owner:
            raise ValueError(f"Weight {w.path!r} belongs to no layer of {model.name!r}; "
                             "models with weights outside their layers cannot be split.")
        order.append(owner[id(w)])
    return order


def split_model(model, *, devices: Sequence[str] | None = None,
                plan: plan_lib.Plan | None = None, micro_batches: int = 1,
                num_stages: int | None = None, balance_by: str = "params",
                device_weights: Sequence[float] | None = None, replicas: int = 1,
                tensor_parallel: dict | None = None, schedule: Schedule = "free",
                input_shape: Sequence[int] | None = None) -> SplitModel:
    """Runs a Keras model's layers on several devices, pipelined over micro-batches.

    The returned model is a keras.Model holding new variables on the planned
    devices, initialised from `model`'s weights (the original is not
    changed); `split.get_weights()` lists them in `model.get_weights()` order.

    Args:
      model: a built Sequential or Functional model, or a subclassed model
        whose call() applies its layers in order.
      devices: the devices, e.g. ["/cpu:0", "/cpu:1"]. With replicas=R, R*K
        devices grouped as R replicas x K stages. Default: the plan's devices.
      plan: a Plan (layer -> device). Default: plan_balanced over `devices`.
      micro_batches: M; each batch must divide into M equal micro-batches.
      num_stages: K for the automatic plan (default: len(devices) / replicas).
      balance_by: "params", "flops" or "time" (automatic plan only).
      device_weights: relative speed of each stage's device (automatic plan).
      replicas: data-parallel replicas (MirroredStrategy), each a full pipeline.
      tensor_parallel: {layer name: ("column"|"row", [devices])} Dense layers to
        split across devices (added to the plan).
      schedule: "free" (default: TensorFlow's executor runs any ready op, which
        also fills the bubble with independent backward work) or "gpipe" (each
        stage processes micro-batches strictly in order; measured slower).
      input_shape: input shape without batch for subclassed models that were
        never called symbolically.

    Returns:
      A SplitModel: compile() and fit() it like the original.

    Raises:
      ValueError: unknown devices, fewer layers than stages, a plan that does
        not match the model or cannot cut it, BatchNormalization with M > 1.

    Example:
      >>> split = tfdist.split_model(model, devices=["/cpu:0", "/cpu:1"], micro_batches=8)
      >>> split.compile("adam", "mse"); split.fit(x, y, batch_size=64)
      >>> print(tfdist.placement_report(split))
    """
    from tfdist import devices as devices_lib

    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an integer >= 1. Received: micro_batches={micro_batches!r}")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1. Received: replicas={replicas!r}")
    if schedule not in ("gpipe", "free"):
        raise ValueError(f"schedule must be 'gpipe' or 'free'. Received: schedule={schedule!r}")
    if devices is not None:
        devices = [plan_lib.canonical_device(d) for d in devices]
        devices_lib.resolve_devices(devices)  # raises for devices this process lacks
        if len(devices) % replicas:
            raise ValueError(
                f"{len(devices)} devices cannot be grouped into replicas={replicas} equal "
                f"pipelines. Received: devices={devices}. Give replicas x stages devices.")
    if plan is None:
        if devices is None:
            raise ValueError("split_model needs devices=[...] or plan=Plan(...). Received neither.")
        stage_devices = devices[: len(devices) // replicas]
        k = num_stages if num_stages is not None else len(stage_devices)
        if k != len(stage_devices):
            raise ValueError(
                f"num_stages={k} but {len(stage_devices)} device(s) per replica were given "
                f"({stage_devices}). Give one device per stage.")
        plan = balance.plan_balanced(model, k, by=balance_by, device_weights=device_weights,
                                     devices=stage_devices)
    plan = plan_lib.in_model_order(plan, graph.layer_names(model))
    if tensor_parallel:
        plan = plan.replace(tensor_parallel=tensor_parallel)
    devices_lib.resolve_devices(list(plan.devices))
    stage_devices = [d for d, _ in plan.stages]
    if devices is None:
        devices = list(plan.devices)
    if replicas == 1:
        replica_devices = [stage_devices]
    else:
        k = len(devices) // replicas
        groups = [devices[r * k:(r + 1) * k] for r in range(replicas)]
        base = groups[0]
        extra = [d for d in plan.devices if d not in base]
        if extra:
            raise ValueError(
                f"With replicas={replicas}, the plan may use only replica 0's devices {base}; "
                f"it also uses {extra}.")
        replica_devices = [[g[base.index(d)] for d in stage_devices] for g in groups]
    found = _has_batch_statistics(graph.source_layers(model))
    if found and micro_batches > 1:
        raise ValueError(
            f"Layers {found} keep batch statistics (BatchNormalization): with micro_batches="
            f"{micro_batches} they would normalise each micro-batch separately and the result "
            "would differ from the unsplit model. Use micro_batches=1, or LayerNormalization / "
            "GroupNormalization instead.")
    strategy = None
    if replicas > 1:
        from tfdist import strategies

        strategy = strategies.make_strategy(
            "mirrored", devices=tuple(g[0] for g in replica_devices))
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        functional, layer_map = graph.placed_functional(model, plan, input_shape=input_shape)
        stages, cuts = graph.cut_into_stages(functional, plan)
        split = SplitModel(functional=functional, plan=plan, stages=stages, cuts=cuts,
                           layer_map=layer_map, source_order=_source_order(model),
                           micro_batches=micro_batches, schedule=schedule,
                           replica_devices=replica_devices, strategy=strategy)
    from tfdist.split.tensor_parallel import _MHA_PROJECTIONS

    for layer in layer_map.values():
        for sub in [layer] + [getattr(layer, a, None) for a, _ in _MHA_PROJECTIONS]:
            if hasattr(sub, "shard_devices"):
                sub.device_map = lambda d, s=split: s._map_device(d, s._replica_id())
    return split


def split_from_options(model, options, *, devices: Sequence[str] | None = None):
    """Applies a SplitOptions (the --split flags) to a built model.

    Returns the model unchanged for split="none", else a SplitModel: "auto"
    balances over `options.stages` devices (default: all logical devices, or
    `devices`), a path loads a Plan file.
    """
    from tfdist import devices as devices_lib

    if not options.enabled:
        return model
    if options.split == "auto":
        pool = list(devices) if devices is not None else list(devices_lib.resolve_devices(None))
        k = options.stages if options.stages is not None else len(pool)
        if k > len(pool):
            raise ValueError(
                f"stages={k} but only {len(pool)} device(s) are available ({pool}). Use "
                f"--logical_devices={k} or fewer stages.")
        return split_model(model, devices=pool[:k], micro_batches=options.micro_batches,
                           balance_by=options.split_balance)
    return split_model(model, plan=plan_lib.Plan.load(options.split),
                       micro_batches=options.micro_batches)
