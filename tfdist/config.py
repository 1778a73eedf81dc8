"""Frozen, validated option objects for every tfdist preset.

This module imports no TensorFlow: configs can be built, checked and printed
in a process that never starts a runtime (the CLI, the planner, tests).
Each preset owns one options dataclass; `make_strategy(name, **options)`
builds it from keyword arguments, so an unknown option or a bad value fails
here with a message that names the value and the fix.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar, Literal

from tfdist import parallelism as parallelism_lib
from tfdist.devices import check_device_name

CrossDeviceOps = Literal[
    "auto", "ring", "reduction_to_one_device", "hierarchical_copy", "nccl"
]
CROSS_DEVICE_OPS: tuple[str, ...] = (
    "auto",
    "ring",
    "reduction_to_one_device",
    "hierarchical_copy",
    "nccl",
)

def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False. Received: {name}={value!r}")


def _check_positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1. Received: {name}={value!r}")


def _check_count(name: str, value: Any, zero_means: str) -> None:
    """An integer >= 0, where 0 means `zero_means` (said in the error)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0 (0: {zero_means}). Received: "
                         f"{name}={value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PresetOptions:
    """Base class: options shared by every preset (none yet)."""

    preset: ClassVar[str] = ""

    @classmethod
    def option_fields(cls) -> tuple[dataclasses.Field, ...]:
        """The options, the preset's own first, then those it shares with other presets."""
        own = cls.__dict__.get("__annotations__", {})
        fields = dataclasses.fields(cls)
        return tuple(sorted(fields, key=lambda f: f.name not in own))  # stable: keeps order

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in cls.option_fields())

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "PresetOptions":
        """Builds the options, rejecting names this preset does not take."""
        unknown = sorted(set(kwargs) - set(cls.option_names()))
        if unknown:
            valid = ", ".join(cls.option_names()) or "(none)"
            elsewhere = [_misplaced(name, cls.preset) for name in unknown
                         if _presets_taking(name)]
            hint = f" ({'; '.join(elsewhere)}.)" if elsewhere else ""
            raise ValueError(
                f"Unknown option(s) for preset '{cls.preset}': {', '.join(unknown)}. "
                f"Valid options: {valid}.{hint}"
            )
        return cls(**kwargs)


def _presets_taking(option: str) -> list[str]:
    """Names of the presets (options classes defined here or registered) taking `option`."""
    found, stack = [], list(PresetOptions.__subclasses__())
    while stack:
        klass = stack.pop(0)
        stack.extend(klass.__subclasses__())
        if klass.preset and option in klass.option_names() and klass.preset not in found:
            found.append(klass.preset)
    return found


@dataclasses.dataclass(frozen=True, kw_only=True)
class DefaultOptions(PresetOptions):
    """No distribution: TensorFlow's default strategy on its default device."""

    preset: ClassVar[str] = "default"


@dataclasses.dataclass(frozen=True, kw_only=True)
class OneDeviceOptions(PresetOptions):
    """Everything on one named device (`tf.distribute.OneDeviceStrategy`).

    Attributes:
      device: the device to place variables and compute on; default: the first
        GPU if there is one, else "/cpu:0".
    """

    preset: ClassVar[str] = "one_device"
    device: str | None = dataclasses.field(default=None, metadata={
        "help": "one_device: the device to use, e.g. /gpu:0 (default: first GPU, else /cpu:0)."})

    def __post_init__(self):
        if self.device is not None:
            check_device_name(self.device)


# --- sharded data parallelism and host offload (tfdist/sharding/) -----------------------

# The shard and compression rules are the Parallelism's (tfdist/parallelism.py): one home.
Shard = parallelism_lib.Shard
SHARD_STAGES = parallelism_lib.SHARD_STAGES
Offload = parallelism_lib.Offload
OFFLOADS = parallelism_lib.OFFLOADS
# Variables smaller than this stay replicated under sharding: biases and norms of up to
# 16384 fp32 channels. Sharding them saves at most this much per variable and costs a
# collective launch each (per layer call at shard="parameters"); see docs/sharding.md.
DEFAULT_SHARD_MIN_BYTES = 65536

_SHARD_HELP = {
    "shard": "mirrored, multi_worker_mirrored: ZeRO-style sharding of the training state over "
             "the replicas: none; optimizer (stage 1: each replica keeps 1/N of every "
             "optimizer slot); gradients (stage 2: also reduce-scatters gradients); "
             "parameters (stage 3: also stores 1/N of each large weight, gathered layer by "
             "layer).",
    "offload": "mirrored, multi_worker_mirrored: optimizer (with --shard): keep the optimizer "
               "state and run its update on the host CPU instead of the replicas' devices "
               "(ZeRO-Offload); none.",
    "shard_min_bytes": "mirrored, multi_worker_mirrored with --shard: variables smaller than "
                       f"this many bytes stay replicated (default {DEFAULT_SHARD_MIN_BYTES}).",
    "shard_remat": "mirrored, multi_worker_mirrored with --shard=parameters: true (default): a "
                   "layer drops the weights it gathered after its forward pass and gathers "
                   "them again in the backward pass, recomputing its forward (keras.remat); "
                   "false: it keeps them until its backward pass (no second gather, no "
                   "recomputation; each layer's whole weights live in between, like FSDP's "
                   "reshard_after_forward=False).",
}


_CANNOT_SHARD = {
    "parameter_server": "asynchronous workers and keeps the variables on ps tasks (split "
                        "them there with shard_count or min_shard_bytes)",
    "default": "one replica: nothing to shard over",
    "one_device": "one replica: nothing to shard over",
    "auto": "no sharding of its own (name the preset to shard)",
}


def _misplaced(option: str, preset: str) -> str:
    """Why `option` is not an option of `preset`, and the fix."""
    takers = ", ".join(_presets_taking(option))
    if option in ("shard", "offload", "shard_min_bytes", "shard_remat"):
        why = _CANNOT_SHARD.get(preset, "no synchronous replicas")
        return (f"{option} shards the training state over replicas that step together, so only "
                f"{takers} take it; '{preset}' has {why}. Use --strategy=mirrored (one "
                f"machine) or multi_worker_mirrored, or drop {option}")
    return f"{option} is an option of {takers}: pick one of those presets or drop it"


def _check_sharding(options: Any) -> None:
    """Validates the shard/offload/shard_min_bytes/shard_remat fields of a synchronous preset."""
    parallelism_lib.check_sharding(options.shard, options.offload)
    _check_count("shard_min_bytes", options.shard_min_bytes, "shard every variable")
    parallelism_lib.check_shard_remat(options.shard_remat, options.shard)


# --- gradient compression and buckets (tfdist/comm/) -----------------------------------

GradientCompression = parallelism_lib.GradientCompression
GRADIENT_COMPRESSIONS = parallelism_lib.GRADIENT_COMPRESSIONS
DEFAULT_POWERSGD_RANK = 4
DEFAULT_POWERSGD_WARMUP_STEPS = 100

_COMM_HELP = {
    "gradient_compression": "mirrored, multi_worker_mirrored: compress gradients before the "
                            "all-reduce: none; fp16 or bf16 (half the bytes: cast, sum, cast "
                            "back); powersgd (low-rank P, Q with error feedback, Vogels et al. "
                            "2019). Sparse (IndexedSlices) gradients are never compressed.",
    "powersgd_rank": "mirrored, multi_worker_mirrored with --gradient_compression=powersgd: rank "
                     f"of the approximation (default {DEFAULT_POWERSGD_RANK}); a weight matrix "
                     "with a smaller dimension is sent whole.",
    "powersgd_warmup_steps": "mirrored, multi_worker_mirrored with "
                             "--gradient_compression=powersgd: optimizer steps all-reduced "
                             f"uncompressed first (default {DEFAULT_POWERSGD_WARMUP_STEPS}).",
    "bucket_bytes": "mirrored, multi_worker_mirrored: all-reduce gradients in buckets of about "
                    "this many bytes, last layers first and cut at layer boundaries, each "
                    "launched as soon as its own "
                    "gradients exist so communication overlaps the backward pass (0: one "
                    "all-reduce of every gradient, as Keras does).",
    "bucket_priority": "mirrored, multi_worker_mirrored with --bucket_bytes: true (default): "
                       "a layer's weight gradients are computed before the backward pass "
                       "moves on to the layers below, so each bucket's all-reduce starts "
                       "sooner (control dependencies; values unchanged); false: TensorFlow's "
                       "own order.",
}

# Presets that reduce gradients some other way than TensorFlow's collectives.
_NOT_COLLECTIVE = {"reduction_to_one_device": "sums on one device",
                   "hierarchical_copy": "copies between GPUs",
                   "nccl": "calls NCCL"}


def _comm_field(name: str, default: Any) -> Any:
    return dataclasses.field(default=default, metadata={"help": _COMM_HELP[name]})


def _check_comm_options(options: Any, *, reducer_option: str) -> None:
    """Validates the gradient compression and bucket options of a synchronous preset.

    Args:
      options: MirroredOptions or MultiWorkerMirroredOptions.
      reducer_option: the option naming how that preset reduces (cross_device_ops or
        communication: "ring", "auto", "nccl", ...).
    """
    compression = options.gradient_compression
    reducer = getattr(options, reducer_option)
    parallelism_lib.check_choice("gradient_compression", compression, GRADIENT_COMPRESSIONS)
    powersgd = compression == "powersgd"
    for name in ("powersgd_rank", "powersgd_warmup_steps"):
        if getattr(options, name) is not None and not powersgd:
            raise ValueError(
                f"{name} only applies with gradient_compression='powersgd'. Received: "
                f"{name}={getattr(options, name)!r}, gradient_compression={compression!r}. "
                f"Add gradient_compression='powersgd' or drop {name}.")
    if powersgd:
        rank = options.powersgd_rank
        if rank is not None:
            _check_positive_int("powersgd_rank", rank)
        if options.powersgd_warmup_steps is not None:
            _check_count("powersgd_warmup_steps", options.powersgd_warmup_steps,
                         "compress from the first step")
    bucket = options.bucket_bytes
    _check_count("bucket_bytes", bucket, "one all-reduce")
    _check_bool("bucket_priority", options.bucket_priority)
    if not options.bucket_priority and not bucket:
        raise ValueError(
            "bucket_priority=False only applies with bucket_bytes > 0 (it orders the backward "
            "pass for the buckets' all-reduces). Received: bucket_priority=False, "
            f"bucket_bytes={bucket}. Set bucket_bytes, or drop bucket_priority.")
    if compression == "none" and not bucket:
        return
    what = (f"gradient_compression={compression!r}" if compression != "none"
            else f"bucket_bytes={bucket}")
    if reducer in _NOT_COLLECTIVE:
        raise ValueError(
            f"{what} runs on TensorFlow's collective all-reduce, and "
            f"{reducer_option}={reducer!r} {_NOT_COLLECTIVE[reducer]} instead. Use "
            f"{reducer_option}='ring' "
            "(or 'auto' on CPUs), or drop gradient_compression and bucket_bytes.")
    parallelism_lib.check_exchange_with_shard(what, options.shard)


def powersgd_rank_of(options: Any) -> int:
    """The PowerSGD rank of validated options (the default when unset)."""
    return options.powersgd_rank or DEFAULT_POWERSGD_RANK


def powersgd_warmup_of(options: Any) -> int:
    """The PowerSGD warm-up steps of validated options (the default when unset)."""
    steps = options.powersgd_warmup_steps
    return DEFAULT_POWERSGD_WARMUP_STEPS if steps is None else steps


@dataclasses.dataclass(frozen=True, kw_only=True)
class _DataParallelOptions(PresetOptions):
    """The options every synchronous data-parallel preset takes (mirrored, multi_worker_mirrored).

    Attributes:
      sync_batch_norm: compute BatchNormalization's batch mean and variance
        over the global batch (every replica's slice; two small all-reduces
        per BN layer per step) instead of each replica's own slice. Either
        way the moving statistics stay identical on every replica. See
        docs/numerics.md.
      shard: ZeRO-style sharding over the replicas (tfdist.sharding): "none",
        "optimizer" (stage 1), "gradients" (stage 2), "parameters" (stage 3).
      offload: "optimizer" keeps the optimizer state and its update on the
        host CPU (needs `shard`); "none".
      shard_min_bytes: variables smaller than this stay replicated.
      shard_remat: at shard="parameters", True (default) runs each layer that
        owns sharded weights under keras.remat (gathered weights dropped after
        the forward pass, gathered again and the forward recomputed in the
        backward pass); False keeps the gathered weights until the backward
        pass (faster, more memory between the two passes).
      gradient_compression: "none", "fp16", "bf16" or "powersgd": what the
        all-reduce sends (tfdist.comm; docs/performance.md says when each helps).
      powersgd_rank: PowerSGD's rank (default 4).
      powersgd_warmup_steps: optimizer steps sent uncompressed first (default 100).
      bucket_bytes: all-reduce in buckets of at most this many bytes, last
        layers first (0: one all-reduce).
      bucket_priority: with bucket_bytes, True (default) computes each
        bucket's gradients before the backward pass moves on to the layers
        below (tfdist.compat.backward_priority), so its all-reduce starts
        sooner; False leaves the order to TensorFlow's executor.
    """

    sync_batch_norm: bool = dataclasses.field(default=False, metadata={
        "help": "mirrored, multi_worker_mirrored: BatchNormalization statistics over the "
                "global batch (two all-reduces per BN layer per step) instead of each "
                "replica's slice."})
    shard: Shard = dataclasses.field(default="none", metadata={"help": _SHARD_HELP["shard"]})
    offload: Offload = dataclasses.field(default="none",
                                         metadata={"help": _SHARD_HELP["offload"]})
    shard_min_bytes: int = dataclasses.field(default=DEFAULT_SHARD_MIN_BYTES, metadata={
        "help": _SHARD_HELP["shard_min_bytes"]})
    shard_remat: bool = dataclasses.field(default=True, metadata={
        "help": _SHARD_HELP["shard_remat"]})
    gradient_compression: GradientCompression = _comm_field("gradient_compression", "none")
    powersgd_rank: int | None = _comm_field("powersgd_rank", None)
    powersgd_warmup_steps: int | None = _comm_field("powersgd_warmup_steps", None)
    bucket_bytes: int = _comm_field("bucket_bytes", 0)
    bucket_priority: bool = _comm_field("bucket_priority", True)

    def _check_data_parallel(self, *, reducer_option: str) -> None:
        """The shared options' checks; `reducer_option` names the preset's all-reduce choice."""
        _check_bool("sync_batch_norm", self.sync_batch_norm)
        _check_sharding(self)
        _check_comm_options(self, reducer_option=reducer_option)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MirroredOptions(_DataParallelOptions):
    """Synchronous data parallelism on one machine (`MirroredStrategy`).

    Attributes:
      devices: explicit device names, e.g. ("/cpu:0", "/cpu:1"). Exclusive with
        `num_devices`.
      num_devices: use the first N devices (GPUs if any, else logical CPUs).
      cross_device_ops: how gradients are summed across replicas. "auto" lets
        TensorFlow choose (NCCL on GPUs, a collective ring on CPUs); "ring"
        is a collective ring all-reduce; "reduction_to_one_device" sums on one
        device and broadcasts back (a central reducer); "hierarchical_copy"
        and "nccl" are GPU algorithms ("nccl" needs GPUs).

    And the shared data-parallel options (sync_batch_norm, shard, offload,
    shard_min_bytes, shard_remat, gradient_compression, powersgd_rank,
    powersgd_warmup_steps, bucket_bytes, bucket_priority): see `_DataParallelOptions`.
    """

    preset: ClassVar[str] = "mirrored"
    devices: tuple[str, ...] | None = dataclasses.field(default=None, metadata={
        "help": "mirrored: comma-separated devices, e.g. /cpu:0,/cpu:1 (exclusive with "
                "--num_devices)."})
    num_devices: int | None = dataclasses.field(default=None, metadata={
        "help": "mirrored: use the first N devices (GPUs if any, else logical CPUs). "
                "Default: all of them."})
    cross_device_ops: CrossDeviceOps = dataclasses.field(default="auto", metadata={
        "help": "mirrored: gradient reduction. auto (TF picks), ring (collective ring "
                "all-reduce), reduction_to_one_device (central reducer), hierarchical_copy, "
                "nccl (GPUs only)."})

    def __post_init__(self):
        if self.devices is not None:
            if isinstance(self.devices, str):
                devices = tuple(d for d in self.devices.split(",") if d.strip())
            else:
                devices = tuple(self.devices)
            if not devices:
                raise ValueError(
                    "devices must name at least one device, e.g. ('/cpu:0', '/cpu:1'). "
                    f"Received: devices={self.devices!r}"
                )
            devices = tuple(check_device_name(d, what="devices entry") for d in devices)
            lowered = [d.lower() for d in devices]
            if len(set(lowered)) != len(lowered):
                raise ValueError(
                    f"devices lists a device more than once. Received: devices={devices!r}"
                )
            object.__setattr__(self, "devices", devices)
        _check_positive_int("num_devices", self.num_devices, allow_none=True)
        if self.devices is not None and self.num_devices is not None:
            raise ValueError(
                "Pass either devices or num_devices, not both. Received: "
                f"devices={self.devices!r}, num_devices={self.num_devices!r}"
            )
        if self.cross_device_ops not in CROSS_DEVICE_OPS:
            raise ValueError(
                f"cross_device_ops must be one of {', '.join(CROSS_DEVICE_OPS)}. "
                f"Received: cross_device_ops={self.cross_device_ops!r}"
            )
        self._check_data_parallel(reducer_option="cross_device_ops")


def per_replica_batch_size(global_batch_size: int, num_replicas: int) -> int:
    """Splits a global batch over replicas: 512 over 8 replicas is 64 each.

    Raises:
      ValueError: if the global batch is not a positive multiple of the
        replica count (each replica must see the same number of examples for
        the synchronous update to equal the single-device one).
    """
    _check_positive_int("global_batch_size", global_batch_size)
    _check_positive_int("num_replicas", num_replicas)
    if global_batch_size % num_replicas:
        lower = global_batch_size - global_batch_size % num_replicas
        higher = lower + num_replicas
        raise ValueError(
            f"global_batch_size must be divisible by the number of replicas "
            f"({num_replicas}) so every replica gets the same batch. Received: "
            f"global_batch_size={global_batch_size}. Use {lower or higher} or {higher}."
        )
    return global_batch_size // num_replicas


# --- multi_worker_mirrored ----------------------------------------------------

CommunicationImplementation = Literal["auto", "ring", "nccl"]
COMMUNICATION_IMPLEMENTATIONS: tuple[str, ...] = ("auto", "ring", "nccl")


def _check_seconds(name: str, value: Any, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        none_hint = " or None (no limit)" if allow_none else ""
        raise ValueError(
            f"{name} must be a number of seconds > 0{none_hint}. Received: {name}={value!r}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiWorkerMirroredOptions(_DataParallelOptions):
    """Synchronous data parallelism over several processes/machines (MultiWorkerMirroredStrategy).

    The cluster comes from TF_CONFIG (set by `tfdist launch`, SLURM or
    Kubernetes); without TF_CONFIG this is a 1-worker run on this machine.

    Attributes:
      communication: the cross-worker all-reduce. "auto" lets TensorFlow pick
        (ring on CPUs), "ring" is gRPC ring all-reduce, "nccl" needs GPUs on
        every worker.
      bytes_per_pack: pack gradients into chunks of about this many bytes
        per all-reduce (0: TensorFlow's default, one pack).
      collective_timeout: seconds after which a stuck collective fails
        instead of waiting (None: no limit; a dead peer is still detected by
        the heartbeat in ~10 s).
      join_timeout: seconds to wait for every task to join when the strategy
        is created. TensorFlow waits forever; tfdist stops the process with an
        error naming the tasks that never joined.

    And the shared data-parallel options (see `_DataParallelOptions`), over
    every replica of every worker: BatchNormalization statistics over the
    global batch of all workers, sharding over all replicas.
    """

    preset: ClassVar[str] = "multi_worker_mirrored"
    communication: CommunicationImplementation = dataclasses.field(default="auto", metadata={
        "help": "multi_worker_mirrored: cross-worker all-reduce: auto (TF picks; ring on CPUs), "
                "ring (gRPC ring), nccl (GPUs only)."})
    bytes_per_pack: int = dataclasses.field(default=0, metadata={
        "help": "multi_worker_mirrored: split gradients into all-reduce packs of about this "
                "many bytes (0: one pack)."})
    collective_timeout: float | None = dataclasses.field(default=None, metadata={
        "help": "multi_worker_mirrored: seconds before a stuck collective fails (default: "
                "no limit)."})
    join_timeout: float = dataclasses.field(default=120.0, metadata={
        "help": "multi_worker_mirrored: seconds to wait for every task to join before "
                "failing with the names of the missing tasks."})

    def __post_init__(self):
        if self.communication not in COMMUNICATION_IMPLEMENTATIONS:
            raise ValueError(
                f"communication must be one of {', '.join(COMMUNICATION_IMPLEMENTATIONS)}. "
                f"Received: communication={self.communication!r}"
            )
        _check_count("bytes_per_pack", self.bytes_per_pack, "one pack")
        _check_seconds("collective_timeout", self.collective_timeout, allow_none=True)
        _check_seconds("join_timeout", self.join_timeout, allow_none=False)
        self._check_data_parallel(reducer_option="communication")
        if self.bucket_bytes and self.bytes_per_pack:
            raise ValueError(
                "Pass either bucket_bytes (tfdist's buckets, launched as their gradients "
                "exist; works with gradient_compression) or bytes_per_pack (TensorFlow's "
                f"packs inside one all-reduce), not both. Received: bucket_bytes="
                f"{self.bucket_bytes}, bytes_per_pack={self.bytes_per_pack}.")


# --- parameter_server ----------------------------------------------------------


def _check_optional_int(name: str, value: Any, minimum: int, fix: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"{name} must be an integer >= {minimum}. Received: {name}={value!r}. {fix}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParameterServerOptions(PresetOptions):
    """Asynchronous parameter-server training (`ParameterServerStrategy`).

    With `local_workers`/`local_ps`, the workers and parameter servers are
    `tf.distribute.Server`s started inside this process on 127.0.0.1 (one
    machine, notebooks, tests). Without them, the cluster comes from
    TF_CONFIG: the chief runs the training script as coordinator, and worker
    and ps tasks that call `make_strategy` run their TensorFlow server until
    they are stopped.

    Attributes:
      local_workers: number of in-process workers (needs `local_ps` too).
      local_ps: number of in-process parameter servers.
      shard_count: split every variable into this many shards along its first
        axis (FixedShardsPartitioner). Exclusive with `min_shard_bytes`.
      min_shard_bytes: split variables into shards of at least this many
        bytes (MinSizePartitioner), at most `max_shards` of them.
      max_shards: upper bound on shards per variable with `min_shard_bytes`
        (default: the number of parameter servers).
      connect_timeout: seconds to wait for every worker and ps to accept
        connections before giving up with an error that names the address;
        also how long every worker may be lost before scheduled steps fail.
      skip_completed_reruns: when TensorFlow re-runs a train step whose worker
        died after the step completed (before reporting back), skip it. Costs
        one more ps write per step, after the step's own writes; off by
        default. Either way, re-run steps that had written are counted and
        reported.
    """

    preset: ClassVar[str] = "parameter_server"
    local_workers: int | None = dataclasses.field(default=None, metadata={
        "help": "parameter_server: run N workers in this process (with --local_ps); "
                "default: the cluster from TF_CONFIG."})
    local_ps: int | None = dataclasses.field(default=None, metadata={
        "help": "parameter_server: run N parameter servers in this process (with "
                "--local_workers)."})
    shard_count: int | None = dataclasses.field(default=None, metadata={
        "help": "parameter_server: split each variable into N shards along axis 0 "
                "(exclusive with --min_shard_bytes)."})
    min_shard_bytes: int | None = dataclasses.field(default=None, metadata={
        "help": "parameter_server: split variables into shards of at least this many "
                "bytes (at most --max_shards)."})
    max_shards: int | None = dataclasses.field(default=None, metadata={
        "help": "parameter_server: at most N shards per variable with --min_shard_bytes "
                "(default: the number of ps)."})
    connect_timeout: float = dataclasses.field(default=60.0, metadata={
        "help": "parameter_server: seconds to wait for every worker and ps to be reachable "
                "(and how long every worker may be lost before steps fail)."})
    skip_completed_reruns: bool = dataclasses.field(default=False, metadata={
        "help": "parameter_server: skip a train step TensorFlow re-runs after a worker "
                "failure if the failed run had completed (one more ps write per step)."})

    def __post_init__(self):
        _check_optional_int("local_workers", self.local_workers, 1,
                            "Pass local_workers=N (N >= 1) with local_ps=M, or neither to "
                            "use TF_CONFIG.")
        _check_optional_int("local_ps", self.local_ps, 1,
                            "Parameter-server training needs at least one ps.")
        if (self.local_workers is None) != (self.local_ps is None):
            raise ValueError(
                "Pass local_workers and local_ps together (an in-process cluster), or "
                "neither (the cluster from TF_CONFIG). Received: "
                f"local_workers={self.local_workers!r}, local_ps={self.local_ps!r}."
            )
        _check_optional_int("shard_count", self.shard_count, 1,
                            "Use shard_count=2 or more to split variables, or leave it unset.")
        _check_optional_int("min_shard_bytes", self.min_shard_bytes, 1,
                            "Use a size such as min_shard_bytes=262144 (256 KiB).")
        _check_optional_int("max_shards", self.max_shards, 1,
                            "Use max_shards=2 or more (usually the number of ps).")
        if self.shard_count is not None and (
                self.min_shard_bytes is not None or self.max_shards is not None):
            raise ValueError(
                "Pass either shard_count (a fixed number of shards) or min_shard_bytes "
                "[+ max_shards] (shards of a minimum size), not both. Received: "
                f"shard_count={self.shard_count!r}, min_shard_bytes={self.min_shard_bytes!r}, "
                f"max_shards={self.max_shards!r}."
            )
        if self.max_shards is not None and self.min_shard_bytes is None:
            raise ValueError(
                "max_shards only bounds min_shard_bytes sharding. Received: "
                f"max_shards={self.max_shards!r} without min_shard_bytes. Add "
                "min_shard_bytes=..., or use shard_count=N for a fixed count."
            )
        if not isinstance(self.skip_completed_reruns, bool):
            raise ValueError(
                "skip_completed_reruns must be True or False. Received: "
                f"skip_completed_reruns={self.skip_completed_reruns!r}.")
        if (isinstance(self.connect_timeout, bool)
                or not isinstance(self.connect_timeout, (int, float))
                or not self.connect_timeout > 0
                or self.connect_timeout == float("inf")):
            raise ValueError(
                "connect_timeout must be a finite number of seconds > 0. Received: "
                f"connect_timeout={self.connect_timeout!r}."
            )

    @property
    def is_local(self) -> bool:
        """True when the cluster runs inside this process."""
        return self.local_workers is not None

    @property
    def shards_variables(self) -> bool:
        """True when a variable partitioner is configured."""
        return self.shard_count is not None or self.min_shard_bytes is not None

# --- model splitting (tfdist/split/) -------------------------------------------------------
SplitBalance = Literal["params", "flops", "time"]
SPLIT_BALANCE: tuple[str, ...] = ("params", "flops", "time")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitOptions:
    """The split flags (--split, --stages, ...): how to cut a model, and a Parallelism to run.

    The degrees (stages, micro-batches, schedule, sequence) and which
    combinations are valid are `tfdist.Parallelism`'s: these options are
    checked by its rules, and `parallelism()` returns the one that
    `split_model` runs. What is not a degree stays here: where the cut comes
    from (`split`: balanced, or a plan file) and what the balance weighs.

    Attributes:
      split: "none" (no splitting), "auto" (balanced plan over `stages`
        devices) or the path of a plan file written by `SplitPlan.save`.
      stages: number of pipeline stages for split="auto" (default: every
        device of a replica).
      micro_batches: micro-batches per batch (M).
      schedule: how micro-batches go through the stages: free, gpipe, 1f1b.
      split_balance: what "auto" balances: params, flops or time.
      sequence_parallel: devices each sequence is cut over (1 = off); not
        combined with split (a pipeline) in one run.
    """

    split: str = dataclasses.field(default="none", metadata={
        "help": "Model splitting: none, auto (balanced over --stages devices) or the path "
                "of a plan file (JSON from tfdist.split.SplitPlan.save)."})
    stages: int | None = dataclasses.field(default=None, metadata={
        "help": "Pipeline stages for --split=auto (default: all of a replica's devices)."})
    micro_batches: int = dataclasses.field(default=1, metadata={
        "help": "Micro-batches per batch; the batch size must be a multiple."})
    schedule: parallelism_lib.Schedule = dataclasses.field(default="free", metadata={
        "help": "Pipeline schedule: free (TensorFlow runs any ready op), gpipe (each stage "
                "takes micro-batches in order) or 1f1b (needs --micro_batches >= stages)."})
    split_balance: SplitBalance = dataclasses.field(default="params", metadata={
        "help": "What --split=auto balances across stages: params, flops or time."})
    sequence_parallel: int = dataclasses.field(default=1, metadata={
        "help": "Cut each sequence over this many devices (transformer blocks: "
                "MultiHeadAttention, LayerNormalization, Dense); 1 = off. The sequence "
                "length must be a multiple."})

    def __post_init__(self):
        if not isinstance(self.split, str) or not self.split:
            raise ValueError("split must be 'none', 'auto' or a plan file path. "
                             f"Received: split={self.split!r}")
        _check_positive_int("stages", self.stages, allow_none=True)
        if self.split_balance not in SPLIT_BALANCE:
            raise ValueError(f"split_balance must be one of {', '.join(SPLIT_BALANCE)}. "
                             f"Received: split_balance={self.split_balance!r}")
        if self.split == "none" and (self.stages is not None or self.micro_batches != 1
                                     or self.schedule != "free"):
            raise ValueError(
                "stages, micro_batches and schedule only apply when the model is split. "
                f"Received: split='none', stages={self.stages!r}, "
                f"micro_batches={self.micro_batches!r}, schedule={self.schedule!r}. Pass "
                "--split=auto (or a plan file), or drop --stages/--micro_batches/--schedule.")
        if self.split not in ("none", "auto"):
            import os

            if not os.path.isfile(self.split):
                raise ValueError(
                    f"split must be 'none', 'auto' or an existing plan file. Received: "
                    f"split={self.split!r} (no such file). Write one with SplitPlan.save(path).")
            if self.stages is not None:
                raise ValueError(
                    f"stages comes from the plan file {self.split!r}; drop --stages. "
                    f"Received: stages={self.stages!r}")
        # The degrees and their combinations: the Parallelism's rules. Without --stages the
        # count is known once the devices are (parallelism()); 2 stand in for "a pipeline"
        # beside sequence parallelism, which excludes one.
        stages = self.stages or (2 if self.split != "none" and self.sequence_parallel > 1 else 1)
        self._dims(replicas=1, stages=stages, devices=None)

    @property
    def enabled(self) -> bool:
        return self.split != "none" or self.sequence_parallel > 1

    def _dims(self, *, replicas: int, stages: int, devices) -> parallelism_lib.Parallelism:
        try:
            return parallelism_lib.Parallelism(
                replicas=replicas, stages=stages, micro_batches=self.micro_batches,
                schedule=self.schedule, sequence=self.sequence_parallel, devices=devices)
        except ValueError as e:  # in the options' names
            text = re.sub(r"\bsequence(?= must|=)", "sequence_parallel", str(e))
            raise ValueError(text) from None

    def parallelism(self, devices, *, replicas: int = 1) -> parallelism_lib.Parallelism:
        """The `tfdist.Parallelism` these options describe over `devices`.

        Args:
          devices: the devices to use (e.g. this process's logical CPUs), in
            order; replica r takes the r-th group of them.
          replicas: data-parallel copies of the split model (the mirrored
            preset's replicas), each running its own pipeline.

        Returns:
          Parallelism(replicas, stages/micro-batches/schedule or sequence,
          devices): for split="auto", `stages` (default: len(devices) //
          replicas) devices per replica; for a plan file, replica 0 on the
          plan's devices and the others on the next devices in order.

        Raises:
          ValueError: options that are not a split, or more devices needed
            than `devices` holds (with the --logical_devices to ask for).
        """
        from tfdist.split import plan as plan_lib

        if not self.enabled:
            raise ValueError("These options split nothing (split='none', sequence_parallel=1); "
                             "there is no split to describe. Pass --split or --sequence_parallel.")
        pool = tuple(devices)
        if self.sequence_parallel > 1:
            per_replica = self.sequence_parallel
            what = f"sequence_parallel={per_replica}"
        elif self.split == "auto":
            per_replica = self.stages or max(1, len(pool) // replicas)
            what = f"stages={per_replica}"
        else:
            plan = plan_lib.SplitPlan.load(self.split)
            base = plan.devices
            rest = [d for d in pool if d not in base]
            pool = base + tuple(rest)
            per_replica, what = len(base), f"the plan file's {len(base)} device(s)"
        needed = replicas * per_replica
        if needed > len(pool):
            raise ValueError(
                f"{what} x replicas={replicas} needs {needed} devices, but only {len(pool)} "
                f"are available ({', '.join(pool)}). Use --logical_devices={needed}, fewer "
                "replicas, or a smaller split.")
        stages = 1 if self.sequence_parallel > 1 else per_replica
        return self._dims(replicas=replicas, stages=stages, devices=pool[:needed])


# --- per-step knobs, independent of the preset (tfdist/step_options.py) -----------------

MixedPrecision = Literal["none", "mixed_float16", "mixed_bfloat16"]
MIXED_PRECISIONS: tuple[str, ...] = ("none", "mixed_float16", "mixed_bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepOptions:
    """How each training step runs, under any preset (flags --mixed_precision, ...).

    Attributes:
      mixed_precision: "none" (float32), "mixed_float16" (float16 compute,
        float32 variables, dynamic loss scaling) or "mixed_bfloat16".
      loss_scale: initial dynamic loss scale for mixed_float16 (default:
        Keras's 2**15).
      steps_per_execution: training steps per call of the compiled function.
      jit_compile: compile the training step with XLA.
    """

    mixed_precision: MixedPrecision = dataclasses.field(default="none", metadata={
        "help": "Keras dtype policy for the model: none (float32), mixed_float16 (with dynamic "
                "loss scaling) or mixed_bfloat16."})
    loss_scale: float | None = dataclasses.field(default=None, metadata={
        "help": "--mixed_precision=mixed_float16: initial dynamic loss scale (default 32768)."})
    steps_per_execution: int = dataclasses.field(default=1, metadata={
        "help": "Training steps per call of the compiled training function."})
    jit_compile: bool = dataclasses.field(default=False, metadata={
        "help": "Compile the training step with XLA."})

    def __post_init__(self):
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise ValueError(
                f"mixed_precision must be one of {', '.join(MIXED_PRECISIONS)}. Received: "
                f"mixed_precision={self.mixed_precision!r}")
        if self.loss_scale is not None:
            if self.mixed_precision != "mixed_float16":
                raise ValueError(
                    "loss_scale only applies with mixed_precision='mixed_float16' (bfloat16 "
                    f"and float32 need no loss scaling). Received: loss_scale={self.loss_scale!r}"
                    f", mixed_precision={self.mixed_precision!r}.")
            if (isinstance(self.loss_scale, bool) or not isinstance(self.loss_scale, (int, float))
                    or not self.loss_scale > 0 or self.loss_scale != self.loss_scale
                    or self.loss_scale == float("inf")):
                raise ValueError("loss_scale must be a finite number > 0, e.g. 32768. Received: "
                                 f"loss_scale={self.loss_scale!r}")
        _check_positive_int("steps_per_execution", self.steps_per_execution)
        if not isinstance(self.jit_compile, bool):
            raise ValueError(f"jit_compile must be True or False. Received: "
                             f"jit_compile={self.jit_compile!r}")


# --- auto (cost model / planner) ---------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoOptions(PresetOptions):
    """Picks the preset from the environment (see `tfdist.strategies.choose_preset`).

    TF_CONFIG with ps tasks -> parameter_server; TF_CONFIG with several
    training tasks, or a SLURM job step of several tasks and no TF_CONFIG ->
    multi_worker_mirrored; several GPUs -> mirrored; else default. The chosen
    preset runs with its default options.

    Attributes:
      slurm_port: in a SLURM step without TF_CONFIG, the port of the first task
        on each host (the k-th task on a host listens on slurm_port + k).
    """

    preset: ClassVar[str] = "auto"
    slurm_port: int = dataclasses.field(default=8888, metadata={
        "help": "auto: in a SLURM job step without TF_CONFIG, the port of the first task "
                "on each host (task k on a host listens on slurm_port + k)."})

    def __post_init__(self):
        if isinstance(self.slurm_port, bool) or not isinstance(self.slurm_port, int) or not (
                1 <= self.slurm_port <= 65535):
            raise ValueError(
                f"slurm_port must be a port from 1 to 65535. Received: "
                f"slurm_port={self.slurm_port!r}")
