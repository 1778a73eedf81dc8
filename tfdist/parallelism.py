"""One description of parallelism: replicas x ZeRO shards x pipeline x tensor x sequence.

    dims = tfdist.Parallelism(replicas=2, stages=2, micro_batches=4)   # 4 devices
    split = tfdist.split_model(model, parallelism=dims)               # 2 pipelines of 2 stages

    dims = tfdist.Parallelism(replicas=4, shard="gradients")           # ZeRO-2 over 4 replicas
    with tfdist.make_strategy(dims).scope():
        model = build_model(); model.compile(...)

A `Parallelism` is frozen and checked when it is made: every degree, every
combination tfdist supports, and the rules that make one invalid live here
(torchtitan's `ParallelDims`, accelerate's `ParallelismConfig`), with errors
that name what was received, what is allowed and the fix. It is checked once
more, against this process's devices, by `resolve()`: `make_strategy`,
`split_model` and `sequence_parallel` call it once and use its device groups.
The preset options (`tfdist.config`) read the shard, offload and compression
rules from here too.

Devices are laid out replica-major: replica r runs on
`devices[r*G:(r+1)*G]` (G = stages x tensor x sequence devices per replica);
inside a replica, pipeline stage k has the `tensor` devices
`group[k*T:(k+1)*T]` and its layers run on the first of them; with sequence
parallelism the group's devices hold the sequence's slices in order.

This module imports no TensorFlow: a `Parallelism` can be made and printed
anywhere (the planner, the CLI, tests); `resolve()` asks TensorFlow for the
devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from tfdist.devices import canonical_device

Shard = Literal["none", "optimizer", "gradients", "parameters"]
SHARD_STAGES: tuple[str, ...] = ("none", "optimizer", "gradients", "parameters")
Offload = Literal["none", "optimizer"]
OFFLOADS: tuple[str, ...] = ("none", "optimizer")
GradientCompression = Literal["none", "fp16", "bf16", "powersgd"]
GRADIENT_COMPRESSIONS: tuple[str, ...] = ("none", "fp16", "bf16", "powersgd")
Schedule = Literal["free", "gpipe", "1f1b"]
SCHEDULES: tuple[str, ...] = ("free", "gpipe", "1f1b")

# The fields that are preset options of the data-parallel presets too.
DATA_PARALLEL_FIELDS: tuple[str, ...] = ("shard", "offload", "gradient_compression")


# --- the rules, shared with the preset options (tfdist.config) ------------------------------

def check_degree(name: str, value: Any) -> None:
    """A degree (replicas, stages, ...) is an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1. Received: {name}={value!r}")


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}. Received: "
                         f"{name}={value!r}")


def check_sharding(shard: Any, offload: Any) -> None:
    """The ZeRO stage and host offload: known values, and offload only with a shard."""
    check_choice("shard", shard, SHARD_STAGES)
    check_choice("offload", offload, OFFLOADS)
    if offload != "none" and shard == "none":
        raise ValueError(
            "offload='optimizer' keeps each replica's shard of the optimizer state on the "
            "host CPU, so it needs sharding. Received: shard='none', offload='optimizer'. "
            "Add shard='optimizer' (or 'gradients', as ZeRO-Offload does), or drop offload.")


def check_shard_remat(shard_remat: Any, shard: str) -> None:
    """shard_remat is a bool, and False only with shard='parameters'."""
    if not isinstance(shard_remat, bool):
        raise ValueError(f"shard_remat must be True or False. Received: "
                         f"shard_remat={shard_remat!r}")
    if not shard_remat and shard != "parameters":
        raise ValueError(
            "shard_remat=False keeps the weights a layer gathered until its backward pass, so "
            "it only applies to shard='parameters' (stage 3, the only stage that gathers "
            f"weights per layer). Received: shard={shard!r}, shard_remat=False. Fix: "
            "shard='parameters', or drop shard_remat.")


def check_exchange_with_shard(what: str, shard: str) -> None:
    """Compression or buckets (`what`, e.g. "gradient_compression='bf16'") exclude a shard."""
    if shard != "none":
        # Sharding reduce-scatters the gradients in its own GradientSync.
        raise ValueError(
            f"{what} cannot be combined with shard={shard!r}: sharding reduce-scatters the "
            f"gradients itself and does not compress them. Received: {what}, "
            f"shard={shard!r}. Use one of the two: drop "
            "gradient_compression/bucket_bytes, or shard='none'.")


def check_device_list(devices: Any, *, what: str = "devices", fix: str = "") -> tuple[str, ...]:
    """Canonical names of a list of distinct device names.

    Raises:
      ValueError: a string instead of a list, an empty list, a name that is not
        a device, or a device listed twice.
    """
    if isinstance(devices, str):
        raise ValueError(
            f"{what} must be a list of device names, e.g. ['/cpu:0', '/cpu:1']. Received the "
            f"string {what}={devices!r}. Pass {what}=[{devices!r}, ...].")
    try:
        given = list(devices)
    except TypeError:
        raise ValueError(f"{what} must be a list of device names such as ['/cpu:0', '/cpu:1']. "
                         f"Received: {what}={devices!r}") from None
    if not given:
        raise ValueError(f"{what} must name at least one device. Received: {what}=[]")
    canon = [canonical_device(d) for d in given]
    seen, repeated = set(), []
    for name, c in zip(given, canon):
        if c in seen and name not in repeated:
            repeated.append(name)
        seen.add(c)
    if repeated:
        raise ValueError(
            f"Each device may appear once in {what} (each runs one replica, stage or slice). "
            f"Received: {what}={given!r}; repeated: {repeated}." + (f" {fix}" if fix else ""))
    return tuple(canon)


def _split_names(dims: "Parallelism") -> list[str]:
    """The model-splitting degrees above 1, as "name=value" (for the errors)."""
    return [f"{name}={getattr(dims, name)}" for name in ("stages", "micro_batches", "tensor",
                                                         "sequence")
            if getattr(dims, name) > 1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parallelism:
    """How a model's training uses several devices, validated when made (frozen).

    Attributes:
      replicas: data-parallel copies of the model; each takes an equal share of
        the global batch and the gradients are all-reduced over them.
      workers: processes (machines) the replicas span (multi_worker_mirrored,
        started with `tfdist launch`); 1: this process's devices (mirrored).
      shard: ZeRO stage over the replicas: "none", "optimizer" (1),
        "gradients" (2), "parameters" (3) (tfdist.sharding).
      offload: "optimizer": the optimizer state and update on the host CPU
        (needs a shard); "none".
      gradient_compression: what the replicas' all-reduce sends: "none",
        "fp16", "bf16", "powersgd" (tfdist.comm).
      shard_remat: with shard="parameters", True (default) gathers each weight
        again in the backward pass and recomputes the layer's forward
        (keras.remat); False keeps the gathered weights until the backward
        pass (one gather per weight, no recomputation, more memory).
      stages: pipeline stages each replica's layers are cut into (split_model).
      micro_batches: micro-batches each replica's batch is cut into.
      schedule: how micro-batches go through the stages: "free", "gpipe", "1f1b".
      tensor: devices each pipeline stage splits its tensor-parallel layers
        over (the layers named in split_model's `tensor_parallel=`).
      sequence: devices each sequence is cut over (sequence_parallel).
      devices: the devices, replica-major (see the module docstring); None:
        the first `num_devices` of this process (GPUs, else logical CPUs).

    Example:
      >>> dims = tfdist.Parallelism(replicas=2, stages=2, micro_batches=4)
      >>> dims.num_devices, str(dims)
      (4, '2 replicas x 2 stages (4 micro-batches, free schedule)')
    """

    replicas: int = 1
    workers: int = 1
    shard: Shard = "none"
    offload: Offload = "none"
    gradient_compression: GradientCompression = "none"
    stages: int = 1
    micro_batches: int = 1
    schedule: Schedule = "free"
    tensor: int = 1
    sequence: int = 1
    devices: tuple[str, ...] | None = None
    shard_remat: bool = True

    def __post_init__(self):
        for name in ("replicas", "workers", "stages", "micro_batches", "tensor", "sequence"):
            check_degree(name, getattr(self, name))
        check_sharding(self.shard, self.offload)
        check_choice("gradient_compression", self.gradient_compression, GRADIENT_COMPRESSIONS)
        check_shard_remat(self.shard_remat, self.shard)
        check_choice("schedule", self.schedule, SCHEDULES)
        if self.gradient_compression != "none":
            check_exchange_with_shard(f"gradient_compression={self.gradient_compression!r}",
                                      self.shard)
        self._check_data_parallel_options()
        self._check_split()
        self._check_workers()
        if self.devices is not None:
            devices = check_device_list(self.devices)
            if len(devices) != self.num_devices:
                raise ValueError(
                    f"{self.describe_devices()} use {self.num_devices} device(s), but devices "
                    f"lists {len(devices)}. Received: devices={list(self.devices)!r}. Give "
                    f"{self.num_devices} devices, or leave devices unset to use the first "
                    f"{self.num_devices} of this process.")
            object.__setattr__(self, "devices", devices)

    def _check_data_parallel_options(self) -> None:
        chosen = [f"{name}={getattr(self, name)!r}" for name in DATA_PARALLEL_FIELDS
                  if getattr(self, name) != "none"]
        if not chosen:
            return
        if self.replicas < 2:
            raise ValueError(
                f"{', '.join(chosen)} changes how replicas exchange or divide their training "
                f"state, and replicas=1 has no other replica. Received: replicas=1, "
                f"{', '.join(chosen)}. Use replicas >= 2, or drop {chosen[0].split('=')[0]}.")
        split = _split_names(self)
        if split:
            raise ValueError(
                f"{', '.join(chosen)} applies to data parallelism (a model built under the "
                "strategy's scope); this version does not combine it with a model split. "
                f"Received: {', '.join(chosen + split)}. Use one of the two: drop "
                f"{chosen[0].split('=')[0]}, or set {split[0].split('=')[0]}=1.")

    def _check_split(self) -> None:
        if self.sequence > 1:
            other = [n for n in _split_names(self) if not n.startswith("sequence")]
            if self.schedule != "free":
                other.append(f"schedule={self.schedule!r}")
            if other:
                raise ValueError(
                    "Sequence parallelism and a pipeline or tensor split are separate ways to "
                    "use several devices; this version runs one at a time. Received: "
                    f"sequence={self.sequence}, {', '.join(other)}. Drop one of them.")
        if self.schedule == "1f1b":
            if self.micro_batches < self.stages:
                raise ValueError(
                    "schedule='1f1b' needs at least as many micro-batches as stages (its steady "
                    "state runs one forward and one backward per stage). Received: "
                    f"micro_batches={self.micro_batches} for {self.stages} stages. Use "
                    f"micro_batches >= {self.stages}, or schedule='gpipe'.")
            if self.replicas > 1:
                raise ValueError(
                    "schedule='1f1b' runs one pipeline (replicas=1); for replicas x stages use "
                    f"schedule='gpipe' or 'free'. Received: replicas={self.replicas}, "
                    "schedule='1f1b'.")

    def _check_workers(self) -> None:
        if self.workers == 1:
            return
        if self.replicas % self.workers:
            raise ValueError(
                f"replicas={self.replicas} do not divide over workers={self.workers} (each "
                "worker runs the same number of replicas). Received: "
                f"replicas={self.replicas}, workers={self.workers}. Use a multiple of "
                f"{self.workers} replicas.")
        split = _split_names(self)
        if split:
            raise ValueError(
                "split_model and sequence_parallel run in one process; this version does not "
                f"split a model across workers. Received: workers={self.workers}, "
                f"{', '.join(split)}. Use workers=1 to split the model, or drop the split.")
        if self.devices is not None:
            raise ValueError(
                f"devices names this process's devices; with workers={self.workers} every "
                "worker uses its own (MultiWorkerMirroredStrategy picks them). Received: "
                f"devices={list(self.devices)!r}. Drop devices.")

    # --- derived ----------------------------------------------------------------------------
    @property
    def devices_per_replica(self) -> int:
        """Devices one replica runs on: stages x tensor x sequence."""
        return self.stages * self.tensor * self.sequence

    @property
    def num_devices(self) -> int:
        """Devices of all replicas (over every worker): replicas x devices_per_replica."""
        return self.replicas * self.devices_per_replica

    @property
    def splits_model(self) -> bool:
        """True when the model is applied from outside: `tfdist.split_model(model, parallelism=)`.

        False: data parallelism, a model built under `tfdist.make_strategy(self).scope()`.
        """
        return self.devices_per_replica > 1 or self.micro_batches > 1

    @property
    def preset(self) -> str:
        """The preset that runs the replicas: default, mirrored or multi_worker_mirrored."""
        if self.workers > 1:
            return "multi_worker_mirrored"
        return "mirrored" if self.replicas > 1 else "default"

    def replace(self, **changes: Any) -> "Parallelism":
        """A new, validated Parallelism with some fields changed."""
        return dataclasses.replace(self, **changes)

    def describe_devices(self) -> str:
        """'replicas=2 x stages=2': the degrees that multiply to `num_devices`."""
        parts = [f"{name}={getattr(self, name)}"
                 for name in ("replicas", "stages", "tensor", "sequence")
                 if getattr(self, name) > 1]
        return " x ".join(parts) or "replicas=1"

    def __repr__(self) -> str:
        """The constructor call with the fields that differ from the defaults."""
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                   if getattr(self, f.name) != f.default]
        return f"Parallelism({', '.join(changed)})"

    def __str__(self) -> str:
        def count(n: int, word: str, plural: str | None = None) -> str:
            return f"{n} {word if n == 1 else plural or word + 's'}"

        parts = [count(self.replicas, "replica")]
        if self.workers > 1:
            parts[0] += f" on {count(self.workers, 'worker')}"
        if self.stages > 1:
            parts.append(count(self.stages, "stage"))
        if self.tensor > 1:
            parts.append(f"{self.tensor}-way tensor")
        if self.sequence > 1:
            parts.append(f"{self.sequence}-way sequence")
        text = " x ".join(parts)
        extras = []
        if self.micro_batches > 1 or self.stages > 1:
            extras.append(f"{count(self.micro_batches, 'micro-batch', 'micro-batches')}, "
                          f"{self.schedule} schedule")
        if self.shard != "none":
            extras.append(f"shard={self.shard}")
        if not self.shard_remat:
            extras.append("shard_remat=False")
        if self.offload != "none":
            extras.append(f"offload={self.offload}")
        if self.gradient_compression != "none":
            extras.append(f"gradient_compression={self.gradient_compression}")
        return text + (f" ({', '.join(extras)})" if extras else "")

    # --- devices ------------------------------------------------------------------------------
    def resolve(self) -> "Parallelism":
        """This Parallelism checked against this process's devices, with its devices named.

        Returns:
          A Parallelism whose `devices` are existing, canonical names (the
          given ones, or the first `num_devices`); with workers > 1 the same
          Parallelism (each worker's strategy picks its devices) once the
          TF_CONFIG cluster was checked.

        Raises:
          ValueError: a device this process lacks, fewer devices than
            `num_devices` (naming `tfdist.configure_logical_devices`), or for
            workers > 1 no TF_CONFIG cluster of that many training tasks.
        """
        from tfdist import devices as devices_lib

        if self.workers > 1:
            self._check_cluster()
            return self
        if self.devices is not None:
            return self.replace(devices=devices_lib.resolve_devices(self.devices))
        available = devices_lib.resolve_devices(None)
        if len(available) < self.num_devices:
            kind = "GPU" if "GPU" in (available[0] if available else "") else "CPU"
            fix = (f"Call tfdist.configure_logical_devices({self.num_devices}) before TensorFlow "
                   f"starts (flag --logical_devices={self.num_devices})"
                   if kind == "CPU" else "Use a machine with more GPUs")
            raise ValueError(
                f"{self.describe_devices()} use {self.num_devices} devices, but this process "
                f"has {len(available)} logical {kind} device(s): {', '.join(available)}. "
                f"{fix}, or lower the degrees.")
        return self.replace(devices=tuple(available[:self.num_devices]))

    def _check_cluster(self) -> None:
        from tfdist import cluster as cluster_lib

        config = cluster_lib.tf_config_from_env()
        if config is None:
            raise ValueError(
                f"workers={self.workers} spans {self.workers} processes, but this process has "
                "no TF_CONFIG cluster. Start the script on every worker with tfdist launch "
                f"(e.g. `tfdist launch --num_workers={self.workers} -- python train.py`), or "
                "use workers=1.")
        tasks = config.cluster.num_training_tasks
        if tasks != self.workers:
            raise ValueError(
                f"workers={self.workers}, but TF_CONFIG describes {tasks} training task(s) "
                f"({config.cluster.sizes()}). Use workers={tasks}, or launch "
                f"{self.workers} workers.")
        local = self.replicas // self.workers
        from tfdist._tf import import_tensorflow

        gpus = len(import_tensorflow().config.list_physical_devices("GPU"))
        runs = gpus or 1
        if local != runs:
            raise ValueError(
                f"replicas={self.replicas} over workers={self.workers} is {local} per worker, "
                f"but MultiWorkerMirroredStrategy runs one replica per GPU of a worker, or one "
                f"on its CPU (this worker has {gpus} GPU(s): {runs} replica(s)). Use "
                f"replicas={runs * self.workers}.")

    def _require_devices(self) -> tuple[str, ...]:
        if self.devices is None:
            raise ValueError("This Parallelism names no devices yet: call resolve() first "
                             f"(received {self!r}).")
        return self.devices

    @property
    def replica_groups(self) -> tuple[tuple[str, ...], ...]:
        """The devices of each replica: ((replica 0's devices), ...) (needs `devices`)."""
        devices, size = self._require_devices(), self.devices_per_replica
        return tuple(devices[r * size:(r + 1) * size] for r in range(self.replicas))

    def stage_devices(self, replica: int = 0) -> tuple[str, ...]:
        """The device each pipeline stage of `replica` runs its layers on."""
        group = self.replica_groups[replica]
        return tuple(group[k * self.tensor] for k in range(self.stages))

    def tensor_devices(self, stage: int, replica: int = 0) -> tuple[str, ...]:
        """The `tensor` devices stage `stage` of `replica` splits its layers over."""
        group = self.replica_groups[replica]
        return group[stage * self.tensor:(stage + 1) * self.tensor]

    # --- presets --------------------------------------------------------------------------------
    def preset_options(self, **options: Any):
        """The options of the preset that runs these replicas (`tfdist.make_strategy`'s input).

        Args:
          **options: the preset's other options (cross_device_ops,
            sync_batch_norm, bucket_bytes, powersgd_rank, ...); the fields of a
            Parallelism (shard, offload, gradient_compression) are not taken here.

        Returns:
          DefaultOptions (one replica), MirroredOptions over this Parallelism's
          devices, or MultiWorkerMirroredOptions (workers > 1). For a model
          split, the replicas' strategy runs one replica on the first device of
          each replica's group.

        Raises:
          ValueError: an option that is a field of the Parallelism, an option
            the preset does not take, or options for a model split.
        """
        from tfdist import strategies

        inside = sorted(set(options) & ({f.name for f in dataclasses.fields(self)}
                                        | {"num_devices"}))
        if "shard_remat" in inside and self.shard_remat:
            inside.remove("shard_remat")  # the default here: the option decides
        if inside:
            raise ValueError(
                f"{', '.join(inside)}: the Parallelism says this (replicas and devices choose "
                "the devices); set it there, e.g. parallelism.replace(replicas=...), not as a "
                "preset option. Received: "
                + ", ".join(f"{k}={options[k]!r}" for k in inside) + ".")
        if options and self.splits_model:
            raise ValueError(
                f"A model split runs its replicas with the mirrored preset's defaults; options "
                f"apply to data parallelism only. Received: {self}, options "
                f"{', '.join(sorted(options))}. Drop the options.")
        own = {name: getattr(self, name) for name in DATA_PARALLEL_FIELDS
               if getattr(self, name) != "none"}
        if not self.shard_remat:
            own["shard_remat"] = False
        if self.replicas == 1:
            if options:
                raise ValueError(
                    "One replica runs on TensorFlow's default strategy, which takes no "
                    f"options. Received: options {', '.join(sorted(options))}. Drop them, or "
                    "use replicas >= 2.")
            return strategies.make_options("default")
        if self.workers > 1:
            return strategies.make_options(self.preset, **own, **options)
        if self.splits_model:
            # One replica per group, on the group's first device (stage 0's).
            devices = tuple(group[0] for group in self.replica_groups)  # needs resolve()
            return strategies.make_options("mirrored", devices=devices)
        placement = ({"num_devices": self.replicas} if self.devices is None
                     else {"devices": self.devices})
        return strategies.make_options("mirrored", **placement, **own, **options)
