"""Pipelines over placed stages, as a keras.Model: `split_model`.

Each batch is split into M micro-batches. Micro-batch i runs stage 0 on its
device, hands the tensors crossing the cut to stage 1 on the next device,
and so on; the outputs are concatenated back into the full batch, so Keras
computes the loss on the whole batch exactly as for the unsplit model, and
gradients (sums over micro-batches) equal the unsplit ones up to fp32
summation order.

Schedules:
- "free" (default): TensorFlow's executor runs whatever op is ready.
- "gpipe": stage k of micro-batch i waits for stage k of micro-batch i-1
  (control dependencies): every forward, then every backward.
- "1f1b": one forward, one backward per stage in steady state (PipeDream-
  flush / Megatron's 1F1B). Each micro-batch's loss is computed as soon as its
  forward reaches the last stage and its backward starts there, so a stage
  holds the activations of at most K - stage micro-batches, not M
  (tfdist.split.one_f_one_b).

The backward pass is the reverse pipeline: `tf.gradients` puts every gradient
op on its forward op's device (tfdist.compat.placed_training).

Data parallelism composes: with replicas=R, devices are grouped as R
replicas x K stages; a MirroredStrategy runs one replica per group, and
replica r runs stage k on devices[r*K + k].
"""

from __future__ import annotations

import contextlib
from typing import Mapping, Sequence

import numpy as np

from tfdist import parallelism as parallelism_lib
from tfdist._tf import import_tensorflow
from tfdist.compat import keras_graph, placed_training
from tfdist.split import balance, graph as graph_lib
from tfdist.split import plan as plan_lib

import_tensorflow()  # quietly, before keras imports TensorFlow itself

import keras  # noqa: E402

Schedule = parallelism_lib.Schedule
SCHEDULES = parallelism_lib.SCHEDULES


def _has_batch_statistics(layers) -> list[str]:
    found = []
    for name, layer in layers.items():
        if isinstance(layer, keras.layers.BatchNormalization):
            found.append(name)
        elif any("moving_mean" in w.path or "moving_variance" in w.path
                 for w in layer.non_trainable_weights):
            found.append(name)
    return found


class SplitModel(keras.Model):
    """A keras.Model running another model's layers across devices (see split_model).

    Attributes:
      plan: the SplitPlan (stages for replica 0).
      micro_batches: M.
      schedule: "free", "gpipe" or "1f1b".
      replicas: R data-parallel replicas (1 = none).
      parallelism: the `tfdist.Parallelism` it runs (replicas, the plan's
        stages, micro-batches, schedule; its devices when they were the layout).
      strategy: the replicas' strategy (None for one replica).
      stages: the Stage objects in order.
      cuts: tensors crossing each stage boundary.
    """

    def __init__(self, *, graph, plan, stages, cuts, layer_map, source_order,
                 micro_batches, schedule, replica_devices, strategy, groups=None,
                 parallelism=None, **kwargs):
        super().__init__(name=kwargs.pop("name", f"{graph.model.name}_split"), **kwargs)
        self.plan = plan
        self.micro_batches = micro_batches
        self.schedule = schedule
        self.stages = stages
        self.cuts = cuts
        self._graph = graph
        # Tracked: the placed layers' variables are this model's weights.
        self._placed = list(layer_map.values())
        self._layer_map = layer_map          # plan name -> placed layer
        self._source_order = source_order    # [(plan name, weight index)] in model.weights order
        self.replica_devices = replica_devices  # [[stage devices of replica r], ...]
        self.replicas = len(replica_devices)
        # [[all devices of replica r's group], ...]: a device maps to the same place in each
        self._groups = groups if groups is not None else replica_devices
        self.parallelism = parallelism
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

    def device_for_this_replica(self, device: str) -> str:
        """`device` (a replica-0 stage device) as the replica running now sees it."""
        return self._map_device(device, self._replica_id())

    def _map_device(self, device: str, replica: int) -> str:
        if replica == 0:
            return device
        base = self._groups[0]
        return self._groups[replica][base.index(device)] if device in base else device

    # --- forward --------------------------------------------------------------------------
    def _inputs(self, inputs) -> list:
        tf = import_tensorflow()
        flat = self._graph.flat_inputs(inputs)
        out = []
        for x, (_, _, dtype) in zip(flat, self._graph.input_specs):
            x = tf.convert_to_tensor(x)
            if x.dtype.name != dtype and (x.dtype.is_integer == tf.as_dtype(dtype).is_integer):
                x = tf.cast(x, dtype)  # e.g. int64 numpy ids into an int32 Input
            out.append(x)
        return out

    def _micro_split(self, x, training):
        """M equal micro-batches; for inference the batch is padded to a multiple of M.

        Training requires equal micro-batches (a partial batch is a
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

    def micro_batch_inputs(self, inputs, training):
        """[{input key: micro-batch i of that input}, ...] on stage 0's device."""
        tf = import_tensorflow()
        with tf.device(self.stage_device(0, self._replica_id())):
            flat = self._inputs(inputs)
            pieces = [self._micro_split(x, training) for x in flat]
        return [{k: p[i] for k, p in zip(self._graph.input_keys, pieces)}
                for i in range(self.micro_batches)], flat

    def call(self, inputs, training=None):
        tf = import_tensorflow()
        replica = self._replica_id()
        micro, flat = self.micro_batch_inputs(inputs, training)
        # 1f1b orders forward and backward together in its own train step.
        ordered = self.schedule == "gpipe" and not tf.executing_eagerly() \
            and self.micro_batches > 1
        last_of_stage: list[list] = [[] for _ in self.stages]
        outputs_per_micro = []
        for values in micro:
            for s, stage in enumerate(self.stages):
                deps = last_of_stage[s] if ordered else []
                with tf.device(self.stage_device(s, replica)), tf.control_dependencies(deps):
                    stage.run(values, training)
                last_of_stage[s] = [values[k] for k in stage.output_keys
                                    if tf.is_tensor(values[k])]
            outputs_per_micro.append([values[k] for k in self._graph.output_keys])
        outs = self.gather_outputs(outputs_per_micro, flat, training)
        return self._graph.pack_outputs(outs)

    def gather_outputs(self, outputs_per_micro, flat_inputs, training):
        tf = import_tensorflow()
        with tf.device(self.stage_device(len(self.stages) - 1, self._replica_id())):
            if self.micro_batches == 1:
                return outputs_per_micro[0]
            outs = [tf.concat([o[j] for o in outputs_per_micro], axis=0)
                    for j in range(len(self._graph.output_keys))]
            if not training:  # drop the inference padding
                n = tf.shape(flat_inputs[0])[0]
                outs = [o[:n] for o in outs]
            return outs

    @property
    def losses(self):
        """`add_loss` losses averaged over the micro-batches, plus weight penalties.

        Each micro-batch's forward adds its own losses (a mixture of experts'
        load-balancing loss, activity regularizers), so their mean over the M
        micro-batches stands for the batch's (equal to it when the loss is
        linear in the batch; a load-balancing loss is not exactly).
        """
        per_call = keras_graph.call_losses(self)
        if self.micro_batches > 1:
            per_call = [loss / self.micro_batches for loss in per_call]
        return per_call + keras_graph.regularization_losses(self)

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
        tf = import_tensorflow()
        if self.schedule == "1f1b" and not tf.executing_eagerly():
            from tfdist.split import one_f_one_b

            return one_f_one_b.train_step(self, data)
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
        """{layer name in the plan: the placed layer} (read its variables' devices)."""
        return dict(self._layer_map)

    @property
    def layer_graph(self):
        """The flattened graph (tfdist.split.graph.LayerGraph) the stages run."""
        return self._graph


def check_batch(batch_size: int, micro_batches: int) -> None:
    if batch_size % micro_batches:
        raise ValueError(
            f"A batch of {batch_size} samples cannot be split into micro_batches="
            f"{micro_batches} equal micro-batches. Use a batch size that is a multiple of "
            f"{micro_batches} (e.g. "
            f"{max(micro_batches, batch_size // micro_batches * micro_batches)})."
        )


def _source_order(model, graph) -> list[tuple[str, int]]:
    owner = {}
    for name, layer in graph.layers.items():
        for i, w in enumerate(layer.weights):
            owner.setdefault(id(w), (name, i))
    order = []
    for w in model.weights:
        if id(w) not in owner:
            raise ValueError(f"Weight {w.path!r} belongs to no layer of {model.name!r}; "
                             "models with weights outside their layers cannot be split.")
        order.append(owner[id(w)])
    return order


def _check_devices_arg(devices) -> list[str] | None:
    if devices is None:
        return None
    return list(parallelism_lib.check_device_list(
        devices, fix="To put several layers on one device, give fewer stages, or write a "
                     "SplitPlan."))


def given_parallelism(parallelism, strategy, keywords: Mapping, *, caller: str):
    """The resolved Parallelism of `parallelism=` or of `strategy=`; None when neither is given.

    Raises:
      ValueError: both given, a strategy that carries no Parallelism, a
        Parallelism that is not a Parallelism, keywords that the Parallelism
        holds given beside it, or data-parallel fields (shard, offload,
        gradient_compression, workers) that a split does not run.
    """
    from tfdist import state as state_lib

    if parallelism is None and strategy is None:
        return None
    if parallelism is not None and strategy is not None:
        raise ValueError(
            f"Pass parallelism= or strategy= to {caller}, not both (a strategy made by "
            "tfdist.make_strategy(parallelism) carries its Parallelism).")
    if strategy is not None:
        state = state_lib.state_of(strategy)
        dims = None if state is None else state.parallelism
        if dims is None:
            raise ValueError(
                f"strategy= must be one tfdist.make_strategy(parallelism) made, so it carries "
                f"the Parallelism to run. Received: {type(strategy).__name__} with no "
                "Parallelism recorded (TensorFlow's default strategy, which one replica runs "
                "on, carries none). Pass parallelism=tfdist.Parallelism(...) instead.")
    else:
        if not isinstance(parallelism, parallelism_lib.Parallelism):
            raise ValueError(
                "parallelism must be a tfdist.Parallelism, e.g. tfdist.Parallelism(stages=2, "
                f"micro_batches=4). Received: {type(parallelism).__name__} {parallelism!r:.80}")
        dims = parallelism
    beside = {k: v for k, v in keywords.items() if v is not None}
    if beside:
        raise ValueError(
            f"{', '.join(beside)} are part of the Parallelism; give them there "
            f"(parallelism.replace({next(iter(beside))}=...)), not beside it. Received: "
            f"{dims}, " + ", ".join(f"{k}={v!r}" for k, v in beside.items()) + ".")
    data = [f"{name}={getattr(dims, name)!r}" for name in parallelism_lib.DATA_PARALLEL_FIELDS
            if getattr(dims, name) != "none"]
    if dims.workers > 1:
        data.append(f"workers={dims.workers}")
    if data:
        raise ValueError(
            f"{caller} does not run {', '.join(data)}: that is data parallelism of a model "
            f"built under tfdist.make_strategy(parallelism).scope(). Received: {dims}. Build "
            "the model under that strategy's scope instead, or drop those fields.")
    return dims.resolve() if strategy is None else dims


def _tensor_parallel_devices(tensor_parallel: Mapping, plan: plan_lib.SplitPlan,
                             dims: parallelism_lib.Parallelism) -> dict:
    """{layer: (mode, devices)}: a mode alone takes its stage's `tensor` devices from `dims`."""
    out = {}
    for name, spec in tensor_parallel.items():
        if not isinstance(spec, str):
            out[name] = spec
            continue
        if dims.tensor < 2 or dims.devices is None:
            raise ValueError(
                f"tensor_parallel={{{name!r}: {spec!r}}} takes its devices from "
                "Parallelism(tensor=N) (each stage's N devices); without it give them: "
                f"{{{name!r}: ({spec!r}, ['/cpu:0', '/cpu:1'])}}. Received: "
                f"tensor={dims.tensor}.")
        device = plan.device_of(name)
        stage_devices = dims.stage_devices(0)
        if device not in stage_devices:
            raise ValueError(
                f"Layer {name!r} runs on {device}, which is no stage device of {dims} "
                f"({', '.join(stage_devices)}), so it has no tensor devices. Place it on a "
                "stage device, or give its devices: "
                f"{{{name!r}: ({spec!r}, [...])}}.")
        out[name] = (spec, list(dims.tensor_devices(stage_devices.index(device))))
    return out


def split_model(model, *, parallelism: parallelism_lib.Parallelism | None = None,
                strategy=None, devices: Sequence[str] | None = None,
                plan: plan_lib.SplitPlan | None = None, micro_batches: int | None = None,
                num_stages: int | None = None, balance_by: str | None = None,
                device_weights: Sequence[float] | None = None, replicas: int | None = None,
                tensor_parallel: Mapping | None = None, schedule: Schedule | None = None,
                input_shape: Sequence[int] | None = None):
    """Runs a Keras model's layers on several devices, pipelined over micro-batches.

    The split runs the model's own layers: their variables are moved to the
    planned devices (the Keras variable objects stay the same), so `model`
    and the returned SplitModel share their weights: train the split, then
    `model.save(...)` saves the trained weights. Nested Functional and
    Sequential models (a KerasHub backbone inside its task model) are
    flattened so their layers can go to different stages; their layers are
    named "<nested model>/<layer>" in the plan. A layer called twice (tied
    embeddings) keeps its variables on its first call's stage; later calls
    read them across devices.

    The layout comes from a `tfdist.Parallelism` (`parallelism=`, or the
    `strategy=` `tfdist.make_strategy(parallelism)` made), or from the
    keywords `devices=`, `replicas=`, `micro_batches=`, `schedule=` (a
    shorthand for the same Parallelism). A Parallelism with `sequence` > 1 is
    run by `tfdist.split.sequence_parallel`.

    Args:
      model: a built Sequential or Functional model, or a subclassed model
        whose call() applies its layers in order.
      parallelism: replicas x stages (x tensor) and micro-batches, schedule and
        devices (default: the first replicas x stages x tensor devices).
      strategy: a strategy `tfdist.make_strategy(parallelism)` made (its
        replicas run the pipelines), instead of `parallelism`.
      devices: the devices, e.g. ["/cpu:0", "/cpu:1"]. With replicas=R, R*K
        devices grouped as R replicas x K stages. Default: the plan's devices.
      plan: a SplitPlan (layer -> device) for replica 0. Default: plan_balanced
        over the stages' devices.
      micro_batches: M (default 1); each training batch must divide into M
        equal micro-batches.
      num_stages: K for the automatic plan (default: len(devices) / replicas).
      balance_by: "params" (default), "flops" or "time" (automatic plan only).
      device_weights: relative speed of each stage's device (automatic plan only).
      replicas: data-parallel replicas (default 1; MirroredStrategy), each a
        full pipeline.
      tensor_parallel: {layer name: ("column"|"row", [devices])} Dense or
        MultiHeadAttention layers to split across devices (added to the plan);
        with Parallelism(tensor=N), {layer name: "column"|"row"} splits the
        layer over its stage's N devices.
      schedule: "free" (default: TensorFlow's executor runs any ready op),
        "gpipe" (each stage processes micro-batches strictly in order) or
        "1f1b" (one forward, one backward per stage in steady state: at most
        K micro-batches of activations in flight instead of M; needs M >= K).
      input_shape: input shape without batch for subclassed models that were
        never called symbolically.

    Returns:
      A SplitModel (a SequenceParallelModel for sequence parallelism):
      compile() and fit() it like the original.

    Raises:
      ValueError: unknown or repeated devices, fewer layers than stages, a plan
        that does not match the model or cannot cut it, options that conflict
        with `plan=` or with `parallelism=`, BatchNormalization with M > 1,
        "1f1b" with M < K, a Parallelism the devices cannot hold.

    Example:
      >>> split = tfdist.split_model(model, devices=["/cpu:0", "/cpu:1"], micro_batches=8)
      >>> split.compile("adam", "mse"); split.fit(x, y, batch_size=64)
      >>> print(tfdist.placement_report(split))
      >>> split = tfdist.split_model(model, parallelism=tfdist.Parallelism(
      ...     replicas=2, stages=2, micro_batches=4))   # the first 4 devices
    """
    from tfdist import devices as devices_lib
    from tfdist import strategies

    dims = given_parallelism(parallelism, strategy, {
        "devices": devices, "replicas": replicas, "micro_batches": micro_batches,
        "schedule": schedule, "num_stages": num_stages}, caller="split_model")
    if dims is not None and dims.sequence > 1:
        shaping = {k: v for k, v in (("plan", plan), ("tensor_parallel", tensor_parallel),
                                      ("balance_by", balance_by),
                                      ("device_weights", device_weights),
                                      ("input_shape", input_shape)) if v is not None}
        if shaping:
            raise ValueError(
                f"{', '.join(shaping)} shape a pipeline; {dims} cuts every sequence instead "
                "(tfdist.split.sequence_parallel). Drop them, or use sequence=1.")
        from tfdist.split.sequence_parallel import sequence_parallel

        return sequence_parallel(model, parallelism=dims if strategy is None else None,
                                 strategy=strategy)
    if dims is None:  # the keywords, checked as the Parallelism they describe
        dims = parallelism_lib.Parallelism(
            replicas=1 if replicas is None else replicas,
            micro_batches=1 if micro_batches is None else micro_batches,
            schedule="free" if schedule is None else schedule)
    if plan is not None and not isinstance(plan, plan_lib.SplitPlan):
        raise ValueError(
            "plan must be a tfdist.split.SplitPlan (e.g. SplitPlan.from_dict({'dense': '/cpu:0', "
            f"...}}) or SplitPlan.load(path)). Received: {type(plan).__name__} {plan!r:.80}")
    if plan is not None:
        ignored = {k: v for k, v in (("num_stages", num_stages), ("balance_by", balance_by),
                                      ("device_weights", device_weights)) if v is not None}
        if ignored:
            raise ValueError(
                f"{', '.join(ignored)} shape the automatic plan; with plan= given they would "
                f"be ignored. Received: plan=<{plan.num_stages} stages>, "
                + ", ".join(f"{k}={v!r}" for k, v in ignored.items())
                + ". Drop them, or drop plan= to let split_model balance the layers.")
    devices = _check_devices_arg(devices)
    graph = graph_lib.flatten(model, input_shape=input_shape)
    replicas = dims.replicas
    if devices is not None:
        devices_lib.resolve_devices(devices)  # raises for devices this process lacks
        if len(devices) % replicas:
            raise ValueError(
                f"{len(devices)} devices cannot be grouped into replicas={replicas} equal "
                f"pipelines. Received: devices={devices}. Give replicas x stages devices.")
        if plan is None:  # devices= with the automatic plan: the mesh of the Parallelism
            per_replica = len(devices) // replicas
            k = num_stages if num_stages is not None else per_replica
            if k != per_replica:
                raise ValueError(
                    f"num_stages={k} but {per_replica} device(s) per replica were given "
                    f"({devices[:per_replica]}). Give one device per stage.")
            dims = dims.replace(stages=k, devices=tuple(devices))
    # The device groups, one per replica: the Parallelism's (resolved once, by
    # given_parallelism or here), else devices= or the plan's devices split R ways.
    if dims.devices is not None:
        dims = dims.resolve() if devices is not None else dims
        groups = [list(g) for g in dims.replica_groups]
    elif plan is None:
        raise ValueError("split_model needs devices=[...] or plan=SplitPlan(...). "
                         "Received neither.")
    else:
        pool = devices if devices is not None else list(plan.devices)
        k = len(pool) // replicas
        groups = [pool[r * k:(r + 1) * k] for r in range(replicas)]
    if plan is None:
        plan = balance.plan_balanced(graph, dims.stages, by=balance_by or "params",
                                     device_weights=device_weights,
                                     devices=list(dims.stage_devices(0)))
    plan = plan_lib.in_model_order(plan, graph.layer_names)
    if tensor_parallel:
        plan = plan.replace(tensor_parallel=_tensor_parallel_devices(tensor_parallel, plan, dims))
    elif dims.tensor > 1:
        raise ValueError(
            f"{dims} splits the layers named in tensor_parallel= over each stage's "
            f"{dims.tensor} devices; name them, e.g. tensor_parallel={{'dense': 'column'}} "
            "(Dense: 'column' or 'row'; MultiHeadAttention: 'column'). Received: no "
            "tensor_parallel.")
    devices_lib.resolve_devices(list(plan.devices))
    stage_devices = [d for d, _ in plan.stages]
    # What runs: the plan's own stage count, under the Parallelism's rules (1f1b needs M >= K).
    run = parallelism_lib.Parallelism(replicas=replicas, stages=len(stage_devices),
                                      micro_batches=dims.micro_batches, schedule=dims.schedule)
    if dims.devices is not None and dims.stages == run.stages:
        run = dims
    if replicas == 1:
        if devices is not None or dims.devices is not None:
            outside = [d for d in stage_devices if d not in groups[0]]
            if outside:
                raise ValueError(
                    f"The plan uses devices {outside} that devices= does not list "
                    f"({groups[0]}). Drop devices= (the plan names the devices) or make them "
                    "agree.")
        replica_devices = [stage_devices]
    else:
        base = groups[0]
        extra = [d for d in plan.devices if d not in base]
        if extra:
            raise ValueError(
                f"With replicas={replicas}, the plan may use only replica 0's devices {base}; "
                f"it also uses {extra}.")
        replica_devices = [[g[base.index(d)] for d in stage_devices] for g in groups]
    found = _has_batch_statistics(graph.layers)
    if found and run.micro_batches > 1:
        raise ValueError(
            f"Layers {found} keep batch statistics (BatchNormalization): with micro_batches="
            f"{run.micro_batches} they would normalise each micro-batch separately and the "
            "result would differ from the unsplit model. Use micro_batches=1, or "
            "LayerNormalization / GroupNormalization instead.")
    if replicas == 1:
        strategy = None
    elif strategy is None:
        # The replicas' strategy, made from the Parallelism: one replica per device group,
        # on the group's first device.
        strategy = strategies.make_strategy(
            run if run.devices is not None else parallelism_lib.Parallelism(
                replicas=replicas, devices=tuple(g[0] for g in groups)))
    source_order = _source_order(model, graph)  # before tensor-parallel layers change weights
    layer_map = _place_layers(graph, plan, strategy)
    stages, cuts = graph_lib.cut_into_stages(graph, plan)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        split = SplitModel(graph=graph, plan=plan, stages=stages, cuts=cuts,
                           layer_map=layer_map, source_order=source_order,
                           micro_batches=run.micro_batches, schedule=run.schedule,
                           replica_devices=replica_devices, groups=groups, strategy=strategy,
                           parallelism=run)
    from tfdist.split.tensor_parallel import sharded_sublayers

    for name, _ in plan.tensor_parallel:
        for sub in sharded_sublayers(layer_map[name]):
            sub.device_map = split.device_for_this_replica
    if strategy is None:
        misplaced = check_placement(split)
        if misplaced:
            raise ValueError(
                "After the split, these variables are not on their layer's planned device: "
                + "; ".join(misplaced[:10]) + (f" (and {len(misplaced) - 10} more)"
                                               if len(misplaced) > 10 else "")
                + ". They are created outside Keras's tracking (e.g. a raw tf.Variable in a "
                "custom layer), which split_model cannot move; create them with "
                "self.add_weight(...) in the layer.")
    return split


def _place_layers(graph, plan: plan_lib.SplitPlan, strategy) -> dict:
    """Moves every layer's variables to its planned device; builds tensor-parallel layers.

    Returns {plan name: the layer the stages run} (the model's own layer, or
    the ShardedDense that replaces a tensor-parallel Dense).
    """
    from tfdist.split.tensor_parallel import ShardedDense, shard_attention

    tf = import_tensorflow()
    moved: set[int] = set()
    layer_map = {}
    for name, layer in graph.layers.items():
        device = plan.device_of(name)
        tp = plan.tensor_parallel_of(name)
        if tp is not None and not isinstance(layer, keras.layers.MultiHeadAttention):
            first = graph.nodes_of(name)[0]
            in_shape = _input_shape_of(graph, first)
            scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
            with scope, tf.device(device):  # construction and build on the stage device
                sharded = ShardedDense.from_dense(layer, mode=tp.mode, devices=tp.devices,
                                                  output_device=device)
                sharded.build(in_shape)
            sharded.set_weights(layer.get_weights())
            for node in graph.nodes_of(name):
                node.operation = sharded
            layer_map[name] = sharded
            continue
        for variable in layer.variables:
            if id(variable) in moved:  # shared with an earlier layer: stays there
                continue
            moved.add(id(variable))
            keras_graph.move_variable(variable, device, strategy=strategy)
        if tp is not None:
            if tp.mode != "column":
                raise ValueError(
                    f"MultiHeadAttention {name!r} is split by heads: give mode 'column' "
                    "(query/key/value column-parallel, output projection row-parallel). "
                    f"Received: mode={tp.mode!r}")
            shard_attention(layer, devices=tp.devices, output_device=device)
        layer_map[name] = layer
    return layer_map


def _input_shape_of(graph, node):
    if not node.input_keys:
        raise ValueError(f"Layer {node.name!r} has no tensor input to shard.")
    key = node.input_keys[0]
    for n in graph.nodes:
        if key in n.output_keys:
            return n.output_specs[n.output_keys.index(key)][0]
    for k, (_, shape, _) in zip(graph.input_keys, graph.input_specs):
        if k == key:
            return shape
    raise ValueError(f"Layer {node.name!r}: its input shape is unknown.")


def _devices_of(variable) -> list[str]:
    value = getattr(variable, "value", variable)
    values = getattr(value, "values", None)
    if values is not None:
        return [v.device for v in values]
    return [value.device]


def _device_id(device: str) -> tuple[str, int] | None:
    tf = import_tensorflow()
    try:
        spec = tf.DeviceSpec.from_string(device)
    except (ValueError, TypeError):
        return None
    if spec.device_type is None or spec.device_index is None:
        return None
    return spec.device_type.upper(), int(spec.device_index)


def check_placement(split: SplitModel) -> list[str]:
    """Variables of the split whose device is not their layer's planned one.

    Returns:
      "layer: variable path on DEVICE (planned PLANNED)" for each, [] when all
      are placed. Tensor-parallel layers may also use their shard devices.
    """
    out = []
    for name, layer in split.placed_layers().items():
        planned = split.plan.device_of(name)
        tp = split.plan.tensor_parallel_of(name)
        allowed = {_device_id(d) for d in (planned,) + (tp.devices if tp is not None else ())}
        for variable in layer.variables:
            for device in _devices_of(variable):
                if _device_id(device) not in allowed:
                    out.append(f"{name}: {variable.path} on {device or '<unplaced>'} "
                               f"(planned {planned})")
    return out


def split_from_options(model, options, *, devices: Sequence[str] | None = None,
                       strategy=None):
    """Applies a SplitOptions (the --split flags) to a built model.

    Returns the model unchanged when the options split nothing, else
    `split_model` of the `tfdist.Parallelism` they describe: "auto" balances
    over `options.stages` devices (default: all of them), a plan file places
    the layers itself, sequence_parallel=N cuts each sequence over N devices.

    Args:
      model: the built model.
      options: a `tfdist.config.SplitOptions`.
      devices: the devices to split over (default: this process's).
      strategy: a strategy `tfdist.make_strategy(options.parallelism(...,
        replicas=R))` made, whose R replicas each run the split (default:
        one replica).
    """
    from tfdist import devices as devices_lib

    if not options.enabled:
        return model
    plan = None if options.split in ("none", "auto") else plan_lib.SplitPlan.load(options.split)
    balance_by = options.split_balance if options.split == "auto" else None
    if strategy is not None:
        return split_model(model, strategy=strategy, plan=plan, balance_by=balance_by)
    pool = list(devices) if devices is not None else list(devices_lib.resolve_devices(None))
    return split_model(model, parallelism=options.parallelism(pool), plan=plan,
                       balance_by=balance_by)
