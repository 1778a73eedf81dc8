"""The strategy planner: from a model and the hardware to a preset, with reasons.

    machine = tfdist.planning.Machine(device=tfdist.planning.Device(memory=80e9), ...)
    recommendation = tfdist.plan(model, global_batch_size=512, machine=machine)
    recommendation.recommended        # "mirrored"
    recommendation.reasons            # why, with the numbers

Every candidate (no distribution, mirrored, multi-worker mirrored, parameter
servers, a pipeline split) is costed with `tfdist.planning` and checked against
the device memory it was given; only a candidate that fits can be
recommended. When no data-parallel replica fits one device, the planner
looks for the fewest pipeline stages that fit and says how many micro-batches
keep the bubble small. No TensorFlow is imported unless a Keras model is
passed or `this_machine()` probes the local devices.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import subprocess
from typing import Any

from tfdist import planning
from tfdist.parallelism import DATA_PARALLEL_FIELDS, Parallelism
from tfdist.planning.units import check_positive, format_bytes, format_seconds

# Stage counts above this are not searched (and rarely balance well anyway).
MAX_STAGES = 64
# Micro-batches are chosen so the pipeline bubble is at most this fraction.
TARGET_BUBBLE = 0.2


@dataclasses.dataclass(frozen=True)
class Variant:
    """Options of a data-parallel preset that change its memory or traffic.

    The planner costs each variant for every data-parallel preset whose options
    class has the option; it may recommend it only where the installed preset
    accepts those options (`tfdist.make_options(preset, **options)` succeeds),
    so a variant becomes recommendable the moment the feature is installed.

    Attributes:
      options: the preset options, e.g. (("shard", "optimizer"),): fields of a
        `tfdist.Parallelism` (shard, offload, gradient_compression), checked by
        its rules over two replicas when the variant is made.
      summary: what it does, for the reasons.
      state: which per-replica state is divided over the N replicas:
        "optimizer" (ZeRO-1), "gradients" (ZeRO-2: and gradients), "parameters"
        (ZeRO-3: and parameters, one layer gathered at a time), "offload"
        (optimizer slots on the host: none on the device).
      traffic: bytes moved per step relative to a ring all-reduce of the
        gradients (ZeRO-3 gathers the weights in the forward and, with
        shard_remat, again in the backward pass: 1.5, else 1.0; fp16/bf16
        gradients: 0.5).
      host_traffic: gradient bytes per step over the host link, per replica
        share (offload: gradients down and weights up: 2).
      recompute: extra forward passes per step (ZeRO-3 with shard_remat: 1, a
        third more than the step's 3 forward passes of FLOPs).
      keeps_gathered: ZeRO-3 with shard_remat=False: every layer's gathered
        weights live from its forward to its backward pass.
    """

    options: tuple[tuple[str, Any], ...]
    summary: str
    state: str = ""
    traffic: float = 1.0
    host_traffic: float = 0.0
    recompute: float = 0.0
    keeps_gathered: bool = False

    def __post_init__(self):
        fields = DATA_PARALLEL_FIELDS + ("shard_remat",)
        unknown = [k for k, _ in self.options if k not in fields]
        if unknown:
            raise ValueError(f"A variant changes {', '.join(fields)} of a "
                             f"Parallelism. Received: {unknown}")
        Parallelism(replicas=2, **dict(self.options))  # the Parallelism's rules


VARIANTS: tuple[Variant, ...] = (
    # Traffic factors: tfdist.planning.relative_traffic (ZeRO-1 and ZeRO-3 move 1.5x plain data
    # parallelism's bytes, ZeRO-2 and ZeRO-3 with shard_remat=False the same, half-precision
    # gradients half).
    Variant((("shard", "optimizer"),), "optimizer slots sharded over the replicas (ZeRO-1)",
            state="optimizer", traffic=planning.relative_traffic(stage=1)),
    Variant((("shard", "gradients"),), "optimizer slots and gradients sharded (ZeRO-2)",
            state="gradients", traffic=planning.relative_traffic(stage=2)),
    Variant((("shard", "parameters"),), "slots, gradients and weights sharded, weights "
            "gathered one layer at a time, again in the backward pass with the layer's forward "
            "recomputed (ZeRO-3)", state="parameters",
            traffic=planning.relative_traffic(stage=3),
            recompute=planning.recomputed_forward_passes(stage=3)),
    Variant((("shard", "parameters"), ("shard_remat", False)),
            "slots, gradients and weights sharded, each layer's gathered weights kept until its "
            "backward pass (ZeRO-3 without remat)", state="parameters",
            traffic=planning.relative_traffic(stage=3, remat=False),
            recompute=planning.recomputed_forward_passes(stage=3, remat=False),
            keeps_gathered=True),
    Variant((("shard", "gradients"), ("offload", "optimizer")),
            "gradients sharded, optimizer slots and update on the host (ZeRO-Offload)",
            state="offload", traffic=planning.relative_traffic(stage=2), host_traffic=2.0),
    Variant((("gradient_compression", "bf16"),), "gradients all-reduced in bfloat16",
            traffic=planning.relative_traffic(compression="bf16")),
    Variant((("gradient_compression", "fp16"),), "gradients all-reduced in float16",
            traffic=planning.relative_traffic(compression="fp16")),
)


def variant_available(preset: str, variant: Variant) -> bool:
    """True when this installation's `preset` accepts the variant's options."""
    from tfdist import strategies

    if preset not in strategies.available_presets():
        return False
    try:
        strategies.make_options(preset, **dict(variant.options))
    except (ValueError, TypeError):
        return False
    return True


ATTENTION_CLASSES = ("MultiHeadAttention", "CachedMultiHeadAttention")


def _sequence_parallel_candidates(stats, cluster, batch, opt, device) -> list:
    """One device's batch with every sequence cut over the machine's devices.

    Only for models with attention layers (tfdist.split.sequence_parallel):
    weights, gradients and optimizer state stay whole on each device; the
    activations are divided by N; each attention layer all-gathers its
    key/value input ((N-1)/N of it per device).
    """
    n = cluster.machine.num_devices
    attention = [l for l in stats.layers if l.class_name in ATTENTION_CLASSES]
    if n < 2 or not attention:
        return []
    base = planning.replica_memory(stats, per_replica_batch_size=batch, optimizer=opt)
    memory = dataclasses.replace(base, activations=math.ceil(base.activations / n))
    bytes_per_element = stats.activation_bytes_per_example / max(
        1, sum(l.activation_elements for l in stats.layers))
    gathered = sum(l.activation_elements for l in attention) * bytes_per_element * batch
    traffic = gathered * (n - 1) / n
    return [Candidate(
        preset="default", num_replicas=1, per_replica_batch_size=batch, memory=memory,
        device_memory=device.memory, communication_bytes=traffic,
        communication_time=traffic * cluster.machine.link.seconds_per_byte,
        registered=True, options=(("sequence_parallel", str(n)),),
        parallelism=Parallelism(sequence=n),
        note=f"each sequence cut over {n} devices: activations 1/{n} per device, attention "
             "gathers keys/values")]


# The ZeRO stage each Variant.state runs (offload is stage 2 with the slots on the host).
_STAGES = {"": 0, "optimizer": 1, "gradients": 2, "offload": 2, "parameters": 3}


def _variant_memory(base: planning.MemoryEstimate, variant: Variant, replicas: int,
                    stats: planning.ModelStats, opt: planning.OptimizerState
                    ) -> planning.MemoryEstimate:
    n = replicas
    slots = base.optimizer - opt.scalar_bytes
    memory = base
    if variant.state in ("optimizer", "gradients", "parameters"):
        memory = dataclasses.replace(memory, optimizer=math.ceil(slots / n) + opt.scalar_bytes)
    if variant.state in ("gradients", "parameters", "offload"):
        memory = dataclasses.replace(memory, gradients=math.ceil(base.gradients / n))
    if variant.state == "parameters":
        # The shards, and the whole weights gathered at once: one layer's with remat (the
        # largest), every layer's at the turn from the forward to the backward pass without.
        bytes_per_param = stats.trainable_bytes / stats.num_params
        largest = max((layer.num_params for layer in stats.layers), default=0) * bytes_per_param
        gathered = base.parameters if variant.keeps_gathered else largest
        memory = dataclasses.replace(
            memory, parameters=math.ceil(base.parameters / n + gathered))
    if variant.state == "offload":
        memory = dataclasses.replace(memory, optimizer=opt.scalar_bytes)
    if variant.state:
        # The exchange's buffers: the sharding stage's reduce (stage 2's all-to-all holds the
        # local gradients' packed copy and its receive buffer; stage 3 reduces layer by layer).
        memory = dataclasses.replace(memory, exchange=planning.exchange_bytes(
            stats.gradient_bytes, num_replicas=n, stage=_STAGES[variant.state]))
    return memory


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One costed configuration.

    Attributes:
      preset: the tfdist preset it corresponds to.
      num_replicas: data-parallel replicas.
      per_replica_batch_size: examples per replica per step (None: the global
        batch does not divide over the replicas).
      memory: bytes per device (per stage for a split).
      device_memory: what each device has.
      communication_bytes: bytes per step over the busiest link (per rank for
        a ring, through the reducer/server otherwise).
      communication_time: alpha-beta estimate of that traffic, seconds.
      compute_time: FLOPs / device peak, seconds (None without a peak); with
        ZeRO-3's shard_remat the recomputed forward pass counts (4/3 of the step's).
      registered: the preset exists in this installation's registry.
      note: what this configuration means or why it is ruled out.
      options: the preset options of a variant, e.g. (("shard", "optimizer"),).
      parallelism: the `tfdist.Parallelism` that runs it (None for parameter
        servers, and where the global batch does not divide).
    """

    preset: str
    num_replicas: int
    per_replica_batch_size: int | None
    memory: planning.MemoryEstimate | None
    device_memory: int
    communication_bytes: float = 0.0
    communication_time: float = 0.0
    compute_time: float | None = None
    registered: bool = True
    note: str = ""
    options: tuple[tuple[str, Any], ...] = ()
    parallelism: Parallelism | None = None

    @property
    def name(self) -> str:
        """The preset with its options: 'mirrored[shard=optimizer]'."""
        if not self.options:
            return self.preset
        return f"{self.preset}[{','.join(f'{k}={v}' for k, v in self.options)}]"

    @property
    def fits(self) -> bool:
        """True only when the memory was computed and is within the device's."""
        return self.memory is not None and self.memory.total <= self.device_memory

    @property
    def step_time(self) -> float | None:
        """compute + communication (no overlap assumed: an upper bound)."""
        if self.compute_time is None:
            return None
        return self.compute_time + self.communication_time

    def as_dict(self) -> dict[str, Any]:
        return {
            "preset": self.preset, "num_replicas": self.num_replicas,
            "per_replica_batch_size": self.per_replica_batch_size,
            "memory": None if self.memory is None else self.memory.as_dict(),
            "device_memory": self.device_memory, "fits": self.fits,
            "communication_bytes": self.communication_bytes,
            "communication_time": self.communication_time,
            "compute_time": self.compute_time, "step_time": self.step_time,
            "registered": self.registered, "note": self.note,
            "options": dict(self.options), "name": self.name,
            "parallelism": None if self.parallelism is None else _dims_dict(self.parallelism),
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitSuggestion:
    """A pipeline split for a model that does not fit one device.

    Attributes:
      stages: devices one model copy is split over (contiguous layer groups).
      micro_batches: micro-batches per step (bubble <= TARGET_BUBBLE when possible).
      data_parallel_groups: copies of the pipeline (devices // stages).
      stage_boundaries: index of the first layer of each stage (when the
        layers are known; else a balanced split is assumed).
      stage_memory: memory of the fullest stage.
      bubble: (S-1)/(M+S-1).
      ideal_speedup: S*M/(M+S-1) over one (hypothetical, big enough) device.
    """

    stages: int
    micro_batches: int
    data_parallel_groups: int
    stage_boundaries: tuple[int, ...]
    stage_memory: planning.MemoryEstimate
    bubble: float
    ideal_speedup: float

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "stage_memory": self.stage_memory.as_dict()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recommendation:
    """The planner's answer: the numbers, the candidates and the recommendation.

    Attributes:
      stats: the model as the cost model sees it.
      cluster: the hardware it was planned for.
      global_batch_size: examples per step over all replicas.
      optimizer: the optimizer state assumed.
      candidates: every configuration considered, costed and memory-checked.
      recommended: a preset name, or None when nothing fits.
      recommended_options: the preset options that make it fit or faster
        (e.g. (("shard", "optimizer"),)); empty for the preset's defaults.
      reasons: why, in sentences with the numbers.
      split: a pipeline split, when the model does not fit one device.
    """

    stats: planning.ModelStats
    cluster: planning.HardwareCluster
    global_batch_size: int
    optimizer: planning.OptimizerState
    candidates: tuple[Candidate, ...]
    recommended: str | None
    reasons: tuple[str, ...]
    split: SplitSuggestion | None = None
    recommended_options: tuple[tuple[str, Any], ...] = ()

    def candidate(self, preset: str) -> Candidate:
        """The candidate for `preset`.

        Raises:
          ValueError: the planner did not consider it, listing those it did.
        """
        for candidate in self.candidates:
            if candidate.preset == preset:
                return candidate
        raise ValueError(f"No candidate {preset!r} in this plan. Candidates: "
                         f"{', '.join(c.preset for c in self.candidates)}.")

    @property
    def parallelism(self) -> Parallelism | None:
        """The recommendation as a `tfdist.Parallelism` that runs as it is (None: nothing fits).

        Data parallelism: `tfdist.make_strategy(recommendation.parallelism)`, and
        the model built under its scope. A split (`parallelism.splits_model`):
        `tfdist.split_model(model, parallelism=recommendation.parallelism)`.
        Several workers: the same strategy call in each process `tfdist launch`
        starts.
        """
        chosen = self.recommended_candidate
        return None if chosen is None else chosen.parallelism

    @property
    def recommended_candidate(self) -> Candidate | None:
        """The recommended candidate, with its options (None when nothing fits)."""
        for candidate in self.candidates:
            if (candidate.preset == self.recommended
                    and tuple(candidate.options) == tuple(self.recommended_options)):
                return candidate
        return None

    def candidate_named(self, name: str) -> Candidate:
        """The candidate whose `name` (preset[options]) is `name`."""
        for candidate in self.candidates:
            if candidate.name == name:
                return candidate
        raise ValueError(f"No candidate {name!r} in this plan. Candidates: "
                         f"{', '.join(c.name for c in self.candidates)}.")

    def as_dict(self) -> dict[str, Any]:
        machine = self.cluster.machine
        dims = self.parallelism
        return {
            "recommended": self.recommended,
            "recommended_options": dict(self.recommended_options),
            "parallelism": None if dims is None else _dims_dict(dims),
            "reasons": list(self.reasons),
            "split": None if self.split is None else self.split.as_dict(),
            "global_batch_size": self.global_batch_size,
            "model": {
                "num_params": self.stats.num_params,
                "trainable_bytes": self.stats.trainable_bytes,
                "non_trainable_bytes": self.stats.non_trainable_bytes,
                "activation_bytes_per_example": self.stats.activation_bytes_per_example,
                "forward_flops_per_example": self.stats.forward_flops_per_example,
                "num_layers": len(self.stats.layers),
            },
            "optimizer": dataclasses.asdict(self.optimizer),
            "cluster": {
                "num_machines": self.cluster.num_machines,
                "devices_per_machine": machine.num_devices,
                "device_kind": machine.device.kind,
                "device_memory": machine.device.memory,
                "device_peak_flops": machine.device.peak_flops,
                "link": dataclasses.asdict(machine.link),
                "network": None if self.cluster.network is None
                else dataclasses.asdict(self.cluster.network),
            },
            "candidates": [c.as_dict() for c in self.candidates],
        }


def _dims_dict(dims: Parallelism) -> dict[str, Any]:
    return {f.name: getattr(dims, f.name) for f in dataclasses.fields(dims)
            if getattr(dims, f.name) != f.default}


def _registered() -> tuple[str, ...]:
    from tfdist import strategies  # no TensorFlow at import

    return strategies.available_presets()


def _stage_partition(stats: planning.ModelStats, stages: int, *, batch: int,
                     optimizer: planning.OptimizerState
                     ) -> tuple[tuple[int, ...], planning.MemoryEstimate] | None:
    """Contiguous layer groups minimising the fullest stage's bytes.

    The cut is `tfdist.planning.pipeline.balance_contiguous`, the same exact
    partitioner `tfdist.split.plan_balanced` uses, here with each layer's
    bytes as its cost: its parameters x (weights + gradients + optimizer
    slots) + its outputs x batch. Every stage is charged the optimizer's
    scalars and all non-trainable state (an upper bound).

    Returns (first layer index of each stage, memory of the fullest stage), or
    None when there are fewer layers than stages.
    """
    layers = stats.layers
    if len(layers) < stages:
        return None
    bytes_per_param = stats.trainable_bytes / stats.num_params
    elements = sum(layer.activation_elements for layer in layers)
    act_bytes = stats.activation_bytes_per_example / elements if elements else 0.0
    weights = [
        layer.num_params * bytes_per_param * (2 + optimizer.slots_per_variable)
        + layer.activation_elements * act_bytes * batch
        for layer in layers
    ]
    stage_of = planning.balance_contiguous(weights, [1.0] * stages)
    starts = [i for i, s in enumerate(stage_of) if i == 0 or stage_of[i - 1] != s]
    ends = starts[1:] + [len(layers)]
    s, e = max(zip(starts, ends), key=lambda se: sum(weights[se[0]:se[1]]))
    params = sum(layer.num_params for layer in layers[s:e]) * bytes_per_param
    acts = sum(layer.activation_elements for layer in layers[s:e]) * act_bytes * batch
    memory = planning.MemoryEstimate(
        parameters=math.ceil(params), gradients=math.ceil(params),
        optimizer=math.ceil(params * optimizer.slots_per_variable) + optimizer.scalar_bytes,
        non_trainable=stats.non_trainable_bytes, activations=math.ceil(acts))
    return tuple(starts), memory


def _micro_batches(stages: int, batch: int) -> int:
    """Smallest divisor of `batch` giving a bubble <= TARGET_BUBBLE (else the largest useful)."""
    wanted = planning.micro_batches_for_bubble(stages, TARGET_BUBBLE)
    divisors = [m for m in range(1, batch + 1) if batch % m == 0]
    good = [m for m in divisors if m >= wanted]
    return good[0] if good else divisors[-1]


def plan(model: Any = None, *, global_batch_size: int,
         machine: planning.Machine | planning.HardwareCluster | None = None,
         optimizer: Any = None, stats: planning.ModelStats | None = None,
         num_ps: int | None = None, input_shapes: Any = None) -> Recommendation:
    """Costs every strategy for `model` on `machine` and recommends one.

    Args:
      model: a built Keras model (read with `tfdist.planning.model_stats`), or None
        when `stats` is given.
      global_batch_size: examples per step over all replicas.
      machine: a `tfdist.planning.Machine` or `Cluster`; default: this machine
        (`this_machine()`).
      optimizer: a name or Keras optimizer; default: the model's compiled
        optimizer, else "adam".
      stats: the model's `ModelStats`, instead of `model`.
      num_ps: parameter servers for a multi-machine cluster (default: one per
        four machines, at least one).

    Returns:
      A `Recommendation`: `recommended` is a preset whose memory was checked to fit,
      or None (with the reasons) when no configuration fits.

    Raises:
      ValueError: no model, a model that cannot be analysed, a bad batch or
        hardware description.

    Example:
      >>> gpu = planning.Device(kind="GPU", memory=planning.parse_bytes("80GB"))
      >>> node = planning.Machine(device=gpu, num_devices=8,
      ...                     link=planning.Link(bandwidth=planning.parse_bandwidth("300GB/s")))
      >>> tfdist.plan(stats=planning.ModelStats.from_param_count(10**9),
      ...             global_batch_size=512, machine=node).recommended
      'mirrored'
    """
    if stats is None:
        if model is None:
            raise ValueError("plan() needs a model: pass a built keras.Model or "
                             "stats=tfdist.planning.ModelStats.from_param_count(num_params).")
        stats = planning.model_stats(model, input_shapes=input_shapes)
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) \
            or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be an integer >= 1. "
                         f"Received: global_batch_size={global_batch_size!r}")
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None) if model is not None else None
        optimizer = "adam" if optimizer is None else optimizer
    opt = optimizer if isinstance(optimizer, planning.OptimizerState) else \
        planning.optimizer_state(optimizer)
    cluster = planning.as_cluster(this_machine() if machine is None else machine)
    if num_ps is not None:
        check_positive("num_ps", num_ps, integer=True)
    return _plan(stats, cluster, global_batch_size, opt, num_ps)


def _plan(stats: planning.ModelStats, cluster: planning.HardwareCluster, batch: int,
          opt: planning.OptimizerState, num_ps: int | None) -> Recommendation:
    registered = _registered()
    device = cluster.machine.device
    k = stats.gradient_bytes
    d, h, n = cluster.machine.num_devices, cluster.num_machines, cluster.num_devices

    def compute(per_replica: int) -> float | None:
        if device.peak_flops is None or not stats.forward_flops_per_example:
            return None
        return stats.train_flops_per_example * per_replica / device.peak_flops

    def exchange(replicas: int, per: int, link: planning.Link, *, traffic: float = 1.0,
                 stage: int = 0) -> tuple[float, float]:
        """(bytes per rank, seconds) of one step's gradient exchange.

        The dense gradients are ring all-reduced (x `traffic`: a sharding stage
        or a compression); IndexedSlices ones are all-gathered as they are, except
        where a sharding stage >= 2 densifies them into its reduce-scatter (their
        variables' bytes then join the ring's).
        """
        dense = k if stage >= 2 else stats.dense_gradient_bytes
        ring = planning.ring_allreduce_bytes_per_rank(dense, replicas)
        ring_time = planning.ring_allreduce_time(dense, replicas, link)
        if stage >= 2 or not stats.sparse_gradients:
            return traffic * ring, traffic * ring_time
        gathered_time, gathered = planning.sparse_exchange(
            stats.sparse_gradients, per_replica_batch_size=per, num_replicas=replicas, link=link)
        if stage == 1:  # the all-reduce of stage 0, then an all-gather of the updated shards
            extra = traffic - 1.0
            return (ring + gathered + extra * planning.ring_allreduce_bytes_per_rank(k, replicas),
                    ring_time + gathered_time
                    + extra * planning.ring_allreduce_time(k, replicas, link))
        return traffic * ring + gathered, traffic * ring_time + gathered_time

    def data_parallel(preset: str, replicas: int, link: planning.Link, note: str,
                      workers: int = 1) -> Candidate:
        if batch % replicas:
            return Candidate(
                preset=preset, num_replicas=replicas, per_replica_batch_size=None, memory=None,
                device_memory=device.memory, registered=preset in registered,
                note=f"global batch {batch} does not divide over {replicas} replicas")
        per = batch // replicas
        memory = dataclasses.replace(
            planning.replica_memory(stats, per_replica_batch_size=per, optimizer=opt),
            exchange=planning.exchange_bytes(k, num_replicas=replicas))
        moved, seconds = exchange(replicas, per, link)
        return Candidate(
            preset=preset, num_replicas=replicas, per_replica_batch_size=per, memory=memory,
            device_memory=device.memory, communication_bytes=moved, communication_time=seconds,
            compute_time=compute(per), registered=preset in registered, note=note,
            parallelism=Parallelism(replicas=replicas, workers=workers))

    candidates = [Candidate(
        preset="default", num_replicas=1, per_replica_batch_size=batch,
        memory=planning.replica_memory(stats, per_replica_batch_size=batch, optimizer=opt),
        device_memory=device.memory, compute_time=compute(batch),
        registered="default" in registered, note="one device, no communication",
        parallelism=Parallelism())]
    if d > 1:
        central = planning.central_reducer_time(k, d, cluster.machine.link)
        candidates.append(data_parallel(
            "mirrored", d, cluster.machine.link,
            f"{d} replicas on one machine, ring all-reduce (a central reducer would move "
            f"{format_bytes(planning.central_reducer_bytes(k, d))} through one device, "
            f"~{format_seconds(central)})"))
    if h > 1:
        candidates.append(data_parallel(
            "multi_worker_mirrored", n, cluster.slowest_link,
            f"{n} replicas on {h} machines, ring all-reduce limited by the network",
            workers=h))
        ps = num_ps or max(1, h // 4)
        per_worker = batch // h if batch % h == 0 else None
        network = cluster.network
        assert network is not None
        candidates.append(Candidate(
            preset="parameter_server", num_replicas=h, per_replica_batch_size=per_worker,
            memory=None if per_worker is None else planning.replica_memory(
                stats, per_replica_batch_size=per_worker, optimizer=planning.OptimizerState(
                    name=opt.name, slots_per_variable=0, scalar_bytes=0)),
            device_memory=device.memory,
            communication_bytes=planning.parameter_server_bytes(k, num_workers=h, num_ps=ps),
            communication_time=planning.parameter_server_time(k, num_workers=h, num_ps=ps,
                                                              link=network),
            compute_time=None if per_worker is None else compute(per_worker),
            registered="parameter_server" in registered,
            note=(f"{h} workers (one per machine) and {ps} parameter server(s), each holding "
                  f"{format_bytes(stats.trainable_bytes * (1 + opt.slots_per_variable) / ps)}"
                  " of variables and optimizer state (server memory is not checked: it is "
                  "not recommended, only compared); asynchronous updates"
                  if per_worker is not None else
                  f"global batch {batch} does not divide over {h} workers")))

    for base in [c for c in candidates
                 if c.preset in ("mirrored", "multi_worker_mirrored") and c.memory is not None]:
        link = cluster.machine.link if base.preset == "mirrored" else cluster.slowest_link
        for variant in VARIANTS:
            registered_variant = variant_available(base.preset, variant)
            host = variant.host_traffic * k / base.num_replicas
            moved, seconds = exchange(base.num_replicas, base.per_replica_batch_size, link,
                                      traffic=variant.traffic, stage=_STAGES[variant.state])
            candidates.append(dataclasses.replace(
                base, options=variant.options, registered=registered_variant,
                parallelism=base.parallelism.replace(**dict(variant.options)),
                memory=_variant_memory(base.memory, variant, base.num_replicas, stats, opt),
                communication_bytes=moved + host,
                communication_time=seconds + host * link.seconds_per_byte,
                compute_time=None if base.compute_time is None
                else base.compute_time * (3 + variant.recompute) / 3,
                note=variant.summary + ("" if registered_variant else
                                        " (not available in this installation)")))

    candidates.extend(_sequence_parallel_candidates(stats, cluster, batch, opt, device))

    reasons: list[str] = []
    per_example_act = stats.activation_bytes_per_example
    reasons.append(
        f"Model: {stats.num_params:,} trainable parameters = "
        f"{format_bytes(stats.trainable_bytes)} of weights and as much in gradients; "
        f"{opt.name} keeps {opt.slots_per_variable} slot(s) per weight "
        f"({format_bytes(opt.slots_per_variable * stats.trainable_bytes)}); activations "
        f"~{format_bytes(per_example_act)} per example.")
    fitting = [c for c in candidates if c.fits]
    split: SplitSuggestion | None = None
    recommended: str | None = None
    recommended_options: tuple[tuple[str, Any], ...] = ()
    sync_presets = ("default", "mirrored", "multi_worker_mirrored")
    sync = [c for c in fitting if c.preset in sync_presets and not c.options]
    variants = [c for c in fitting if c.preset in sync_presets and c.options and c.registered]
    if any(not c.options and c.preset in ("mirrored", "multi_worker_mirrored")
           for c in fitting):  # data parallelism fits: sequence parallelism is not needed
        variants = [c for c in variants if "sequence_parallel" not in dict(c.options)]
    if not sync and variants:
        # Cheapest variant that fits: the fastest estimated step, else the least traffic,
        # else the fewest changes (table order).
        best = min(variants, key=lambda c: (
            c.step_time if c.step_time is not None else 0.0, c.communication_bytes,
            candidates.index(c)))
        recommended, recommended_options = best.preset, best.options
        plain = next(c for c in candidates if c.preset == best.preset and not c.options)
        if "sequence_parallel" in dict(best.options):
            how = ("tfdist.split.sequence_parallel(model, parallelism=recommendation."
                   f"parallelism) ({best.parallelism!r}; flag --sequence_parallel)")
        else:
            how = (f"tfdist.make_strategy({best.preset!r}, "
                   f"{', '.join(f'{k}={v!r}' for k, v in best.options)}) (or "
                   f"tfdist.make_strategy(recommendation.parallelism): {best.parallelism!r})")
        reasons.append(
            f"{best.preset} does not fit as it is (needs {format_bytes(plain.memory.total)}"
            f" per device of {format_bytes(best.device_memory)}), but with "
            f"{', '.join(f'{k}={v!r}' for k, v in best.options)} ({best.note}) each of its "
            f"{best.num_replicas} replicas needs {format_bytes(best.memory.total)} "
            f"({_parts(best.memory)}) and moves "
            f"{format_bytes(best.communication_bytes)} per step. Apply it with {how}.")
    elif sync:
        best = _choose(sync)
        recommended = best.preset
        reasons.append(_why(best, cluster, sync))
        compressed = _faster_compression(best, variants)
        if compressed is not None:
            recommended_options = compressed.options
            method = dict(compressed.options)["gradient_compression"]
            reasons.append(
                f"Compress the gradients: the all-reduce takes "
                f"{best.communication_time / best.step_time:.0%} of {best.preset}'s estimated "
                f"step; with gradient_compression={method!r} it moves "
                f"{format_bytes(compressed.communication_bytes)} instead of "
                f"{format_bytes(best.communication_bytes)} per step (estimated step "
                f"{format_seconds(compressed.step_time)} vs "
                f"{format_seconds(best.step_time)}). Apply it with "
                f"tfdist.make_strategy({best.preset!r}, gradient_compression={method!r}) "
                f"(or tfdist.make_strategy(tfdist.{compressed.parallelism!r})).")
        if best.preset == "multi_worker_mirrored":
            ps_candidate = next((c for c in candidates if c.preset == "parameter_server"), None)
            if ps_candidate is not None and ps_candidate.fits:
                reasons.append(
                    "parameter_server also fits (asynchronous; tolerates slow or lost workers) "
                    f"but moves {format_bytes(ps_candidate.communication_bytes)} through "
                    "each server per round of steps, growing with the number of workers, "
                    "while the ring's per-rank traffic "
                    f"({format_bytes(best.communication_bytes)}) does not.")
        unfit = [c for c in candidates if c.memory is not None and not c.fits and not c.options]
        for c in unfit:
            reasons.append(f"{c.preset} is ruled out: needs {format_bytes(c.memory.total)} "
                           f"per device, has {format_bytes(c.device_memory)}.")
    if recommended is None:
        unavailable = [c for c in fitting if c.options and not c.registered]
        if unavailable:
            reasons.append(
                "Would fit with " + ", ".join(c.name for c in unavailable[:4])
                + ", which this installation's presets do not offer: not recommended.")
        smallest = min((c for c in candidates if c.memory is not None and not c.options),
                       key=lambda c: c.memory.total, default=None)
        if smallest is not None:
            m = smallest.memory
            reasons.append(
                f"No data-parallel replica fits one device: the smallest ({smallest.preset}, "
                f"{smallest.per_replica_batch_size} examples per replica) needs "
                f"{format_bytes(m.total)} ({_parts(m)}) but a device has "
                f"{format_bytes(device.memory)}.")
        else:
            reasons.append(f"The global batch {batch} does not divide over the replicas of "
                           "any configuration.")
        split = _find_split(stats, cluster, batch, opt)
        if split is not None:
            recommended = "split"
            groups = split.data_parallel_groups
            stage_grads = k / split.stages  # each stage all-reduces its own gradients
            candidates.append(Candidate(
                preset="split", num_replicas=groups,
                per_replica_batch_size=batch // groups,
                memory=split.stage_memory, device_memory=device.memory,
                communication_bytes=planning.ring_allreduce_bytes_per_rank(stage_grads, groups),
                communication_time=planning.ring_allreduce_time(stage_grads, groups,
                                                                cluster.slowest_link),
                registered=True,  # tfdist.split_model ships with tfdist
                note=f"{split.stages} pipeline stages x {split.data_parallel_groups} "
                     "data-parallel group(s)",
                parallelism=Parallelism(replicas=groups, stages=split.stages,
                                        micro_batches=split.micro_batches)))
            where = (f"pipeline stages starting at layers {list(split.stage_boundaries)}"
                     if split.stage_boundaries else "balanced pipeline stages assumed: the "
                     "layers are unknown")
            reasons.append(
                f"Split the model over {split.stages} devices ({where}): the fullest stage needs "
                f"{format_bytes(split.stage_memory.total)} of "
                f"{format_bytes(device.memory)}. With {split.micro_batches} micro-batches "
                f"the bubble is {split.bubble:.0%} (ideal speed-up {split.ideal_speedup:.2f}x "
                f"over one device); {split.data_parallel_groups} data-parallel copies of the "
                "pipeline use the devices. Apply it with tfdist.split_model(model, "
                f"parallelism=recommendation.parallelism) ({candidates[-1].parallelism!r}; "
                "split_model balances the layers by their parameters).")
        else:
            reasons.append(
                f"Even split over all {n} devices the model does not fit: use a smaller "
                "global batch, an optimizer with fewer slots (SGD keeps none), more or "
                "larger devices, or shard the training state over more replicas (ZeRO: "
                f"{planning.zero_bytes_per_param(n, 3):.2f} bytes/parameter at stage 3 over "
                f"{n} devices for mixed-precision Adam).")
    return Recommendation(stats=stats, cluster=cluster, global_batch_size=batch, optimizer=opt,
                          candidates=tuple(candidates), recommended=recommended,
                          reasons=tuple(reasons), split=split,
                          recommended_options=recommended_options)


def _find_split(stats: planning.ModelStats, cluster: planning.HardwareCluster, batch: int,
                opt: planning.OptimizerState) -> SplitSuggestion | None:
    n = cluster.num_devices
    memory = cluster.machine.device.memory
    for stages in range(2, min(n, MAX_STAGES) + 1):
        groups = n // stages
        # Prefer using all devices; a group needs an equal share of the batch.
        while groups > 1 and batch % groups:
            groups -= 1
        per_group = batch // groups
        if stats.layers:
            found = _stage_partition(stats, stages, batch=per_group, optimizer=opt)
            if found is None:
                return None  # fewer layers than stages: cannot split further
            boundaries, stage = found
        else:
            boundaries = ()
            stage = planning.replica_memory(
                stats, per_replica_batch_size=per_group, optimizer=opt, stages=stages)
        if stage.total <= memory:
            micro = _micro_batches(stages, per_group)
            return SplitSuggestion(
                stages=stages, micro_batches=micro, data_parallel_groups=groups,
                stage_boundaries=boundaries, stage_memory=stage,
                bubble=planning.pipeline_bubble(stages=stages, micro_batches=micro),
                ideal_speedup=planning.pipeline_speedup(stages=stages, micro_batches=micro))
    return None


def _faster_compression(best: Candidate, variants: list[Candidate]) -> Candidate | None:
    """A gradient-compression variant of `best` predicted faster, where the exchange matters.

    Only with a compute estimate (a device peak): without one the share of the step
    spent in the all-reduce is unknown, and compression is not free (rounding).
    """
    from tfdist.comm.planning import MIN_COMM_SHARE

    if best.step_time is None or not best.step_time or best.num_replicas < 2:
        return None
    if best.communication_time / best.step_time < MIN_COMM_SHARE:
        return None
    compressed = [c for c in variants
                  if c.preset == best.preset and c.num_replicas == best.num_replicas
                  and {k for k, _ in c.options} == {"gradient_compression"}
                  and c.registered
                  and c.step_time is not None and c.step_time < best.step_time]
    return min(compressed, key=lambda c: c.step_time, default=None)


def _choose(fitting: list[Candidate]) -> Candidate:
    """Fastest estimated step when compute can be estimated, else the most replicas."""
    if all(c.step_time is not None for c in fitting):
        return min(fitting, key=lambda c: (c.step_time, -c.num_replicas))
    return max(fitting, key=lambda c: c.num_replicas)


def _parts(m: planning.MemoryEstimate) -> str:
    text = (f"weights {format_bytes(m.parameters)}, gradients {format_bytes(m.gradients)}, "
            f"optimizer {format_bytes(m.optimizer)}, activations {format_bytes(m.activations)}")
    if m.exchange:
        text += f", the gradient exchange's buffers {format_bytes(m.exchange)}"
    return text


def _why(best: Candidate, cluster: planning.HardwareCluster, fitting: list[Candidate]) -> str:
    m = best.memory
    assert m is not None
    text = (f"{best.preset}: {best.num_replicas} replica(s) x {best.per_replica_batch_size} "
            f"examples; each needs {format_bytes(m.total)} of "
            f"{format_bytes(best.device_memory)} ({_parts(m)})")
    if best.num_replicas > 1:
        text += (f"; ring all-reduce sends {format_bytes(best.communication_bytes)} per "
                 f"rank per step, ~{format_seconds(best.communication_time)}")
    if best.step_time is not None:
        text += (f"; estimated step {format_seconds(best.step_time)} at peak FLOP/s "
                 "with no overlap of communication and compute")
        others = [c for c in fitting if c is not best and c.step_time is not None]
        if others:
            text += " (" + ", ".join(f"{c.preset} {format_seconds(c.step_time)}"
                                     for c in others) + ")"
    elif best.num_replicas > 1:
        text += "; no device peak FLOP/s given, so it uses the most devices that fit"
    if not best.registered:
        text += (f". Note: preset {best.preset!r} is not registered in this installation "
                 f"(available: {', '.join(_registered())})")
    return text + "."


# --- this machine ------------------------------------------------------------------------

# Assumed when the machine cannot tell us (shown in the plan's cluster section).
DEFAULT_LOCAL_LINK = planning.Link(bandwidth=10e9, latency=20e-6)


def _total_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _nvidia_memory() -> list[int]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True).stdout
        return [int(float(line)) * 2**20 for line in out.split() if line.strip()]
    except (subprocess.SubprocessError, ValueError, OSError):
        return []


def this_machine(*, device_memory: int | None = None, link: planning.Link | None = None
                 ) -> planning.Machine:
    """The local machine: its GPUs (memory from nvidia-smi), else one CPU with the RAM.

    Raises:
      ValueError: GPUs whose memory cannot be read and no `device_memory`.
    """
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    gpus = tf.config.list_physical_devices("GPU")
    link = link or DEFAULT_LOCAL_LINK
    if gpus:
        memories = _nvidia_memory()
        memory = device_memory or (min(memories) if memories else None)
        if memory is None:
            raise ValueError(
                f"Found {len(gpus)} GPU(s) but could not read their memory (no nvidia-smi). "
                "Pass it: --device_memory=80GB (API: this_machine(device_memory=...)).")
        return planning.Machine(device=planning.Device(kind="GPU", memory=memory),
                                num_devices=len(gpus), link=link)
    memory = device_memory or _total_ram()
    if not memory:
        raise ValueError("Could not read this machine's RAM. Pass --device_memory=16GB.")
    return planning.Machine(device=planning.Device(kind="CPU", memory=memory), num_devices=1,
                            link=link)


def __getattr__(name: str):
    if name == "Plan":  # Recommendation's former name (tfdist.split had a Plan too)
        import warnings

        warnings.warn("tfdist.planning.planner.Plan is now Recommendation.", DeprecationWarning,
                      stacklevel=2)
        return Recommendation
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
