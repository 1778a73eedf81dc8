"""The preset registry: a name, its options type, a lazy factory, what it needs.

    strategy = tfdist.make_strategy("mirrored", num_devices=2)
    with strategy.scope():
        model = build_model(); model.compile(...)
    model.fit(dataset, epochs=3)

Adding a preset is one decorated factory; an unknown name lists the valid
ones, an unknown option lists the preset's options. No preset is registered
unless it trains a Keras 3 model end to end.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

from tfdist import config as config_lib
from tfdist._tf import import_tensorflow

logger = logging.getLogger("tfdist")


@dataclasses.dataclass(frozen=True)
class Preset:
    """One registry row.

    Attributes:
      name: what users type (`--strategy=name`).
      options: the frozen dataclass holding this preset's options.
      factory: builds the strategy from validated options (imports TF lazily).
      summary: one line for `--help`, the README and error messages.
      needs: the resources it needs, in words ("2+ devices", "TF_CONFIG ...").
    """

    name: str
    options: type[config_lib.PresetOptions]
    factory: Callable[[Any], Any]
    summary: str
    needs: str


_REGISTRY: dict[str, Preset] = {}


def register_preset(name: str, *, options: type[config_lib.PresetOptions], summary: str,
                    needs: str):
    """Decorator registering `factory(options) -> tf.distribute.Strategy` as `name`."""

    def decorator(factory):
        if name in _REGISTRY:
            raise ValueError(f"Preset {name!r} is already registered.")
        if options.preset != name:
            raise ValueError(f"{options.__name__}.preset is {options.preset!r}, expected {name!r}.")
        _REGISTRY[name] = Preset(name, options, factory, summary, needs)
        return factory

    return decorator


def available_presets() -> tuple[str, ...]:
    """Names of the registered presets, in registration order."""
    return tuple(_REGISTRY)


def get_preset(name: str) -> Preset:
    """The registry row for `name`.

    Raises:
      ValueError: unknown name, listing the valid ones.
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unknown preset {name!r}. Valid presets: {', '.join(available_presets())}."
        ) from None


def make_options(preset: str, **options: Any) -> config_lib.PresetOptions:
    """Validated options for `preset` (no TensorFlow needed)."""
    return get_preset(preset).options.from_kwargs(**options)


def make_strategy(preset: "str | config_lib.PresetOptions" = "mirrored", **options: Any):
    """Builds a `tf.distribute.Strategy` from a preset name and its options.

    Args:
      preset: a registered name (see `available_presets()`), or an options
        object such as `tfdist.MirroredOptions(num_devices=2)`.
      **options: that preset's options (with a name), e.g. `num_devices=2`.

    Returns:
      The strategy. Build and compile the Keras model under `strategy.scope()`
      and call `model.fit` as usual.

    Raises:
      ValueError: unknown preset or option, a bad option value, or a request
        this machine cannot meet (a missing device, NCCL without GPUs).
      tfdist.compat.UnsupportedVersionError: TensorFlow or Keras outside the
        supported range (`tfdist.compat.SUPPORTED`).

    Example:
      >>> strategy = tfdist.make_strategy("mirrored", num_devices=2)
      >>> strategy.num_replicas_in_sync
      2
    """
    if isinstance(preset, config_lib.PresetOptions):
        if options:
            raise ValueError(
                "Pass options either inside the options object or as keywords, not both. "
                f"Received: {type(preset).__name__} and {sorted(options)}."
            )
        opts = preset
    else:
        opts = make_options(preset, **options)
    _check_tf_config()
    from tfdist.compat import _owner, _versions

    # Before any fix or private TensorFlow/Keras code runs: a clear error outside the range.
    _versions.check_supported()
    strategy = get_preset(opts.preset).factory(opts)

    if not _owner.is_default_strategy(strategy):
        # tfdist's compat fixes apply to this strategy (and only to strategies made here).
        _owner.adopt(strategy)
        from tfdist.compat import optimizer_update

        optimizer_update.install()
        from tfdist.compat import keras_build

        keras_build.install()  # first batch: no reduce (several workers, string/bool inputs)
        from tfdist.compat import batch_norm

        # Replica copies of BN statistics stay equal under every tfdist strategy ("auto"
        # too); global-batch statistics where the preset's options ask for them.
        batch_norm.configure(strategy,
                             sync_batch_norm=getattr(opts, "sync_batch_norm", False))
        if getattr(opts, "shard", "none") != "none":
            from tfdist import sharding

            sharding.attach(strategy, opts)
        from tfdist.compat import keras_multi_step

        keras_multi_step.install()  # steps_per_execution > 1 with several replicas
        from tfdist.compat import loss_scale

        loss_scale.install()  # mixed_float16: skip a step when any replica overflows
        from tfdist import comm

        if comm.wants_sync(opts):
            comm.attach(strategy, opts)  # gradient compression / buckets (tfdist.comm)
    logger.debug("tfdist: preset %s -> %s", opts.preset, describe(strategy))
    return strategy


def _check_tf_config() -> None:
    """A bad TF_CONFIG is a clear error before any preset starts TensorFlow.

    TensorFlow reads TF_CONFIG while building strategies that never use a
    cluster too (MirroredStrategy does), and fails on a broken one with
    TypeError, JSONDecodeError or RecursionError.
    """
    from tfdist import cluster as cluster_lib

    if cluster_lib.tf_config_from_env() is None and os.environ.get("TF_CONFIG") not in (
            None, "{}"):
        # tfdist reads a blank TF_CONFIG as "no cluster"; TensorFlow's resolver
        # cannot parse it. Say the same thing in TensorFlow's words.
        os.environ["TF_CONFIG"] = "{}"


def describe(strategy, global_batch_size: int | None = None) -> str:
    """One line: strategy type, replicas, devices and the per-replica batch.

    Raises:
      ValueError: if `global_batch_size` does not divide over the replicas.
    """
    replicas = strategy.num_replicas_in_sync
    from tfdist.compat import tf_state

    resolver = tf_state.cluster_resolver(strategy)
    jobs = resolver.cluster_spec().as_dict() if resolver is not None else {}
    if "ps" in jobs:
        # Asynchronous: each worker step uses the whole global batch.
        text = (f"{type(strategy).__name__}: {len(jobs.get('worker', []))} worker(s), "
                f"{len(jobs['ps'])} ps, asynchronous; coordinator "
                f"{'chief' if 'chief' in jobs else 'in this process'}")
        if global_batch_size is not None:
            text += f"; batch {global_batch_size} per worker step"
        return text
    devices = replica_devices(strategy)
    text = (f"{type(strategy).__name__}: {replicas} replica(s) on "
            f"{', '.join(devices) or 'the default device'}")
    if global_batch_size is not None:
        per_replica = config_lib.per_replica_batch_size(global_batch_size, replicas)
        text += f"; global batch {global_batch_size} = {replicas} x {per_replica} per replica"
    return text


def replica_devices(strategy) -> tuple[str, ...]:
    """The devices this process's replicas run on; () for the default strategy."""
    try:
        return tuple(strategy.extended.worker_devices)
    except (RuntimeError, NotImplementedError, AttributeError):
        return ()


# --- presets -----------------------------------------------------------------


@register_preset(
    "default",
    options=config_lib.DefaultOptions,
    summary="No distribution: TensorFlow's default strategy (plain model.fit).",
    needs="nothing",
)
def _default(options: config_lib.DefaultOptions):
    tf = import_tensorflow()
    return tf.distribute.get_strategy()


@register_preset(
    "one_device",
    options=config_lib.OneDeviceOptions,
    summary="Everything on one named device (OneDeviceStrategy).",
    needs="one device",
)
def _one_device(options: config_lib.OneDeviceOptions):
    tf = import_tensorflow()
    from tfdist import devices as devices_lib

    if options.device is None:
        device = devices_lib.resolve_devices(num_devices=1)[0]
    else:
        device = devices_lib.resolve_devices([options.device])[0]
    return tf.distribute.OneDeviceStrategy(device)


@register_preset(
    "mirrored",
    options=config_lib.MirroredOptions,
    summary="Synchronous data parallelism over this machine's devices (MirroredStrategy).",
    needs="1+ local devices (all GPUs, else all logical CPUs)",
)
def _mirrored(options: config_lib.MirroredOptions):
    tf = import_tensorflow()
    from tfdist import devices as devices_lib
    from tfdist.compat import collective_keys

    devices = devices_lib.resolve_devices(options.devices, options.num_devices)
    if options.cross_device_ops == "ring":
        # Collective ring all-reduce, as TF picks by default on CPUs; built
        # explicitly so it can be forced on GPUs too.
        return collective_keys.mirrored_strategy(devices, ring=True)
    return collective_keys.mirrored_strategy(
        devices, cross_device_ops=_cross_device_ops(tf, options.cross_device_ops, devices))


def _cross_device_ops(tf, name: str, devices: tuple[str, ...]):
    if name == "auto":
        return None  # TF picks: collective ring on CPUs, NCCL on physical GPUs
    if name == "reduction_to_one_device":
        return tf.distribute.ReductionToOneDevice()
    if name == "hierarchical_copy":
        return tf.distribute.HierarchicalCopyAllReduce(num_packs=1)
    if name == "nccl":
        cpus = [d for d in devices if "GPU" not in d.upper()]
        if cpus:
            raise ValueError(
                "cross_device_ops='nccl' needs every device to be a GPU; NCCL has no CPU "
                f"kernels, so training would fail at its first step. Received devices: "
                f"{', '.join(devices)}. Use cross_device_ops='ring' or 'auto' on CPUs."
            )
        return tf.distribute.NcclAllReduce()
    raise AssertionError(name)  # config validation makes this unreachable


# --- multi_worker_mirrored ------------------------------------------------------


@register_preset(
    "multi_worker_mirrored",
    options=config_lib.MultiWorkerMirroredOptions,
    summary="Synchronous data parallelism over several processes/machines "
            "(MultiWorkerMirroredStrategy, ring all-reduce); Keras 3 fit fixed.",
    needs="TF_CONFIG with chief/worker tasks (set by `tfdist launch`); none for 1 worker",
)
def _multi_worker_mirrored(options: config_lib.MultiWorkerMirroredOptions):
    from tfdist import multi_worker

    return multi_worker.build_strategy(options)


# --- parameter_server (tfdist/ps/) ------------------------------------------------


@register_preset(
    "parameter_server",
    options=config_lib.ParameterServerOptions,
    summary="Asynchronous parameter-server training (ParameterServerStrategy + "
            "ClusterCoordinator) with plain model.fit.",
    needs="an in-process cluster (local_workers, local_ps) or a TF_CONFIG cluster with "
          "a chief, 1+ workers and 1+ ps",
)
def _parameter_server(options: config_lib.ParameterServerOptions):
    from tfdist import ps

    return ps.make_strategy(options)


# --- auto (cost model / planner) ---------------------------------------------------


def choose_preset(*, environ=None, num_gpus: int | None = None) -> tuple[str, str]:
    """The preset `auto` picks, and why (no TensorFlow needed when `num_gpus` is given).

    Args:
      environ: the environment to read TF_CONFIG from (default `os.environ`).
      num_gpus: this process's GPU count (default: ask TensorFlow).

    Returns:
      (preset name, reason). The preset may not be registered in this
      installation; `make_strategy("auto")` checks that.

    Raises:
      ValueError: TF_CONFIG is set but invalid (a `tfdist.TFConfigError`).
    """
    from tfdist import cluster as cluster_lib

    tf_config = cluster_lib.tf_config_from_env(environ)
    evaluator = tf_config is not None and tf_config.task_type == "evaluator"
    if evaluator:
        # The side-car evaluator trains nothing: it reads the chief's checkpoints.
        tf_config = None
    env = os.environ if environ is None else environ
    slurm_tasks = cluster_lib.step_num_tasks(env) if not env.get("TF_CONFIG", "").strip() else None
    if slurm_tasks is not None and slurm_tasks > 1:
        return "multi_worker_mirrored", (
            f"this process is one of the {slurm_tasks} tasks of a SLURM job step and "
            f"TF_CONFIG is unset (tfdist sets it from the step)")
    if tf_config is not None:
        c = tf_config.cluster
        if c.num_ps > 0:
            return "parameter_server", (
                f"TF_CONFIG describes a cluster with {c.num_ps} ps task(s) ({c.sizes()})")
        if c.num_training_tasks > 1:
            return "multi_worker_mirrored", (
                f"TF_CONFIG describes {c.num_training_tasks} training tasks and no ps "
                f"({c.sizes()})")
    if num_gpus is None:
        num_gpus = len(import_tensorflow().config.list_logical_devices("GPU"))
    where = ("this task is the TF_CONFIG evaluator" if evaluator else
             "no TF_CONFIG cluster" if tf_config is None else "TF_CONFIG has one training task")
    if num_gpus > 1:
        return "mirrored", f"{where} and {num_gpus} GPUs on this machine"
    gpus = "one GPU" if num_gpus == 1 else "no GPU"
    return "default", f"{where} and {gpus}: nothing to distribute over"


@register_preset(
    "auto",
    options=config_lib.AutoOptions,
    summary="Picks the preset from TF_CONFIG and the GPUs: parameter_server, "
            "multi_worker_mirrored, mirrored or default.",
    needs="nothing (uses what the environment provides)",
)
def _auto(options: config_lib.AutoOptions):
    from tfdist import cluster as cluster_lib

    name, reason = choose_preset()
    slurm_tasks = cluster_lib.step_num_tasks()
    if name == "multi_worker_mirrored" and slurm_tasks is not None and slurm_tasks > 1 and (
            cluster_lib.tf_config_from_env() is None):
        # The strategy reads TF_CONFIG from the environment; 'auto' was asked to
        # wire the step up, so it writes the step's TF_CONFIG there.
        os.environ["TF_CONFIG"] = cluster_lib.slurm_tf_config(
            port=options.slurm_port, addresses="auto").to_json()
    if name not in _REGISTRY:
        raise ValueError(
            f"Preset 'auto' chose {name!r} because {reason}, but preset {name!r} is not "
            f"registered in this installation (available: {', '.join(available_presets())}). "
            "Use a tfdist version that provides it, or pick a preset explicitly "
            "(--strategy=NAME) and unset TF_CONFIG if it is not meant for this process."
        )
    # WARNING: the one level Python shows without any logging set-up; the logger's
    # name already says tfdist.
    logger.warning("auto chose preset %r because %s.", name, reason)
    chosen = get_preset(name)
    return chosen.factory(chosen.options())
