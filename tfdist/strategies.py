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
import importlib
import logging
import os
from typing import TYPE_CHECKING, Any, Callable

from tfdist import config as config_lib
from tfdist import state as state_lib
from tfdist._tf import import_tensorflow

if TYPE_CHECKING:
    from tfdist.parallelism import Parallelism

logger = logging.getLogger("tfdist")


@dataclasses.dataclass(frozen=True)
class Feature:
    """One thing a preset adds to the strategies it makes (Lightning's plug-ins, as data).

    Attributes:
      name: short name, listed in the strategy's `StrategyState.features`.
      summary: what it changes, in one line.
      when: when it applies, in words (`applies`, read from the options).
      fixes: the tfdist.compat modules whose fixes it installs.
      attach: `attach(strategy, options, state)`: installs the fixes and records
        on the strategy's `StrategyState` what they read.
      applies: `applies(options) -> bool`; default: always.
    """

    name: str
    summary: str
    when: str
    fixes: tuple[str, ...]
    attach: Callable[[Any, Any, state_lib.StrategyState], None]
    applies: Callable[[Any], bool] = lambda options: True


@dataclasses.dataclass(frozen=True)
class Preset:
    """One registry row.

    Attributes:
      name: what users type (`--strategy=name`).
      options: the frozen dataclass holding this preset's options.
      factory: builds the bare strategy from validated options (imports TF
        lazily); a callable or "module:function".
      summary: one line for `--help`, the README and error messages.
      needs: the resources it needs, in words ("2+ devices", "TF_CONFIG ...").
      features: what `make_strategy` attaches to the strategy, in order.
      fixes: the tfdist.compat modules the factory itself uses.
    """

    name: str
    options: type[config_lib.PresetOptions]
    factory: Callable[[Any], Any] | str
    summary: str
    needs: str
    features: tuple[Feature, ...] = ()
    fixes: tuple[str, ...] = ()

    def build(self, options: config_lib.PresetOptions):
        """The bare strategy from `options` (no feature attached)."""
        factory = self.factory
        if isinstance(factory, str):
            module, _, name = factory.partition(":")
            factory = getattr(importlib.import_module(module), name)
        return factory(options)


_REGISTRY: dict[str, Preset] = {}


def register_preset(name: str, *, options: type[config_lib.PresetOptions], summary: str,
                    needs: str, features: tuple[Feature, ...] = (), fixes: tuple[str, ...] = (),
                    factory: Callable[[Any], Any] | str | None = None):
    """Registers a preset: `factory(options) -> tf.distribute.Strategy` and what it adds.

    Used as a decorator on the factory, or called with `factory=` (a callable
    or "module:function", imported on first use).

    Raises:
      ValueError: the name is taken, or the options class belongs to another preset.
    """

    def decorator(function):
        if name in _REGISTRY:
            raise ValueError(f"Preset {name!r} is already registered.")
        if options.preset != name:
            raise ValueError(f"{options.__name__}.preset is {options.preset!r}, expected {name!r}.")
        _REGISTRY[name] = Preset(name, options, function, summary, needs, tuple(features),
                                 tuple(fixes))
        return function

    if factory is not None:
        return decorator(factory)
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


def _options(preset: "str | config_lib.PresetOptions | Parallelism", options: dict
             ) -> config_lib.PresetOptions:
    from tfdist.parallelism import Parallelism

    if isinstance(preset, Parallelism):
        return preset.resolve().preset_options(**options)
    if isinstance(preset, config_lib.PresetOptions):
        if options:
            raise ValueError(
                "Pass options either inside the options object or as keywords, not both. "
                f"Received: {type(preset).__name__} and {sorted(options)}."
            )
        return preset
    return make_options(preset, **options)


def make_strategy(preset: "str | config_lib.PresetOptions | Parallelism" = "mirrored",
                  **options: Any):
    """Builds a `tf.distribute.Strategy` from a preset name and its options.

    The preset's factory builds the strategy; each of the preset's features
    whose condition holds is attached to it (`installs()` lists them).

    Args:
      preset: a registered name (see `available_presets()`), an options
        object such as `tfdist.MirroredOptions(num_devices=2)`, or a
        `tfdist.Parallelism`: the strategy its replicas run under (checked
        against this process's devices; recorded on the strategy's
        `StrategyState.parallelism`, which `split_model(model, strategy=)`
        reads). One replica is TensorFlow's default strategy.
      **options: that preset's options (with a name), e.g. `num_devices=2`;
        with a Parallelism, the preset's other options (e.g. `sync_batch_norm=True`).

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
    from tfdist.parallelism import Parallelism

    dims = preset.resolve() if isinstance(preset, Parallelism) else None  # once, here
    opts = dims.preset_options(**options) if dims is not None else _options(preset, options)
    from tfdist.compat import _versions

    # Before any fix or private TensorFlow/Keras code runs: a clear error outside the range.
    _versions.check_supported()
    strategy = _build(get_preset(opts.preset), opts)
    state = state_lib.state_of(strategy)
    if dims is not None and state is not None:
        state.parallelism = dims
    return strategy


def _build(preset: Preset, options: config_lib.PresetOptions):
    """The preset's strategy with its features attached (the default strategy: none)."""
    from tfdist.compat import _owner

    _check_tf_config()
    strategy = preset.build(options)
    if _owner.is_default_strategy(strategy) or state_lib.state_of(strategy) is not None:
        return strategy  # TensorFlow's own (never changed), or built by the preset auto chose
    # tfdist's compat fixes apply to this strategy (and only to strategies made here).
    state = state_lib.adopt(strategy, preset=preset.name, options=options)
    for feature in preset.features:
        if feature.applies(options):
            feature.attach(strategy, options, state)
            state.features += (feature.name,)
    logger.debug("tfdist: preset %s -> %s (%s)", preset.name, describe(strategy),
                 ", ".join(state.features))
    return strategy


@dataclasses.dataclass(frozen=True)
class Installs:
    """What `make_strategy(preset, **options)` adds to the strategy it builds.

    Attributes:
      preset: the preset that builds it (for "auto": the one it chooses here).
      features: the preset's features whose condition holds, in order.
      fixes: every tfdist.compat module installed (the factory's, then the features').
    """

    preset: str
    features: tuple[Feature, ...]
    fixes: tuple[str, ...]


def installs(preset: "str | config_lib.PresetOptions | Parallelism" = "mirrored",
             **options: Any) -> Installs:
    """What this preset with these options installs, without building anything.

    Example:
      >>> [f.name for f in tfdist.installs("mirrored", shard="gradients").features]
      ['optimizer_update', 'keras_build', 'batch_norm', 'keras_multi_step', 'loss_scale',
       'keras_backup', 'sharding']

    For "auto" this asks TensorFlow for the GPU count (see `choose_preset`).
    """
    opts = _options(preset, options)
    row = get_preset(opts.preset)
    if row.name == "auto":
        row = get_preset(choose_preset()[0])
        opts = row.options()
    features = tuple(f for f in row.features if f.applies(opts))
    fixes = tuple(dict.fromkeys(row.fixes + tuple(x for f in features for x in f.fixes)))
    return Installs(preset=row.name, features=features, fixes=fixes)


def _check_tf_config() -> None:
    """A bad TF_CONFIG is a clear error before any preset starts TensorFlow.

    TensorFlow reads TF_CONFIG while building strategies that never use a
    cluster too (MirroredStrategy does), and fails on a broken one with
    TypeError, JSONDecodeError or RecursionError. The one place tfdist turns a
    blank TF_CONFIG into "no cluster" for TensorFlow.
    """
    from tfdist import cluster as cluster_lib

    if cluster_lib.tf_config_from_env() is None and os.environ.get("TF_CONFIG") not in (
            None, "{}"):
        # tfdist reads a blank TF_CONFIG as "no cluster"; TensorFlow's resolver
        # cannot parse it. Say the same thing in TensorFlow's words.
        os.environ["TF_CONFIG"] = "{}"


# The names users know (tf.distribute's public classes), most specific first:
# MultiWorkerMirroredStrategy's class is CollectiveAllReduceStrategy, and
# ParameterServerStrategy's is ParameterServerStrategyV2.
_PUBLIC_STRATEGIES = ("MultiWorkerMirroredStrategy", "MirroredStrategy", "OneDeviceStrategy",
                      "ParameterServerStrategy", "experimental.CentralStorageStrategy",
                      "TPUStrategy")


def strategy_name(strategy) -> str:
    """The strategy's name as `tf.distribute` exports it ("MultiWorkerMirroredStrategy").

    TensorFlow's default strategy (no distribution) is "default strategy";
    a class tfdist does not know keeps its own name.
    """
    tf = import_tensorflow()
    for name in _PUBLIC_STRATEGIES:
        cls = tf.distribute
        for part in name.split("."):
            cls = getattr(cls, part, None)
        if isinstance(cls, type) and isinstance(strategy, cls):
            return name.rsplit(".", 1)[-1]
    if strategy is tf.distribute.get_strategy() and not tf.distribute.has_strategy():
        return "default strategy"
    return type(strategy).__name__


def describe(strategy, global_batch_size: int | None = None) -> str:
    """One line: strategy, replicas, devices and the per-replica batch.

        MirroredStrategy: 2 replica(s) on /job:localhost/.../CPU:0, /job:localhost/.../CPU:1;
          global batch 64 = 2 x 32 per replica
        MultiWorkerMirroredStrategy: 2 replica(s) on 2 workers (worker:0 here:
          /job:worker/replica:0/task:0/device:CPU:0); global batch 64 = 2 x 32 per replica

    Raises:
      ValueError: if `global_batch_size` does not divide over the replicas.
    """
    replicas = strategy.num_replicas_in_sync
    from tfdist.compat import tf_state

    name = strategy_name(strategy)
    resolver = tf_state.cluster_resolver(strategy)
    jobs = resolver.cluster_spec().as_dict() if resolver is not None else {}
    if "ps" in jobs:
        # Asynchronous: each worker step uses the whole global batch.
        text = (f"{name}: {len(jobs.get('worker', []))} worker(s), "
                f"{len(jobs['ps'])} ps, asynchronous; coordinator "
                f"{'chief' if 'chief' in jobs else 'in this process'}")
        if global_batch_size is not None:
            text += f"; batch {global_batch_size} per worker step"
        return text
    devices = ", ".join(replica_devices(strategy)) or "the default device"
    workers = len(jobs.get("worker", [])) + len(jobs.get("chief", []))
    if workers > 1:
        task = f"{resolver.task_type}:{resolver.task_id}"
        text = f"{name}: {replicas} replica(s) on {workers} workers ({task} here: {devices})"
    else:
        text = f"{name}: {replicas} replica(s) on {devices}"
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


# --- features: what presets add to the strategies they make --------------------------


def _installs(module: str) -> Callable[[Any, Any, Any], None]:
    """A feature's `attach` that only installs the fixes of `tfdist.compat.<module>`."""

    def attach(strategy, options, state) -> None:
        importlib.import_module(f"tfdist.compat.{module}").install()

    attach.__qualname__ = attach.__name__ = f"install_{module}"
    return attach


def _batch_norm(strategy, options, state) -> None:
    from tfdist.compat import batch_norm

    batch_norm.configure(strategy, sync_batch_norm=getattr(options, "sync_batch_norm", False))


def _sharding(strategy, options, state) -> None:
    from tfdist import sharding

    sharding.attach(strategy, options)  # records state.sharding_plan and its gradient sync


def _keras_backup(strategy, options, state) -> None:
    from tfdist.compat import keras_backup

    keras_backup.install_or_warn()


def _comm(strategy, options, state) -> None:
    from tfdist import comm

    comm.attach(strategy, options)  # records state.gradient_sync (a CommSync)


def _wants_comm(options) -> bool:
    from tfdist import comm

    return comm.wants_sync(options)


# Every strategy tfdist makes (the default strategy excepted), in this order.
COMMON_FEATURES: tuple[Feature, ...] = (
    Feature("optimizer_update", "duplicate sparse-gradient indices summed, clipping after the "
            "all-reduce, gradient accumulation; the update runs the strategy's GradientSync",
            when="always", fixes=("optimizer_update",), attach=_installs("optimizer_update")),
    Feature("keras_build", "the symbolic build reads shapes and dtypes from the dataset's "
            "element spec: no batch read (generators, shuffled input), no reduce (several "
            "workers, string and bool inputs)",
            when="always", fixes=("keras_build",), attach=_installs("keras_build")),
    Feature("batch_norm", "BatchNormalization's replica copies stay equal; global-batch "
            "statistics with sync_batch_norm", when="always", fixes=("batch_norm",),
            attach=_batch_norm),
    Feature("keras_multi_step", "steps_per_execution > 1 with several replicas",
            when="always", fixes=("keras_multi_step",), attach=_installs("keras_multi_step")),
    # After keras_multi_step: its _make_function runs the step keras_losses marks.
    Feature("keras_losses", "inside fit/evaluate, every loss as one device computes it (add_loss, "
            "a train_step's own losses) and the replicas' gradients averaged",
            when="always (acts with several synchronous replicas)", fixes=("keras_losses",),
            attach=_installs("keras_losses")),
    Feature("keras_xla", "a model's jit_compile reads False where XLA cannot compile the step "
            "(several CPU replicas), with one warning",
            when="always (acts with several CPU replicas)", fixes=("keras_xla",),
            attach=_installs("keras_xla")),
    Feature("loss_scale", "mixed_float16: a step is skipped when any replica overflows",
            when="always", fixes=("loss_scale",), attach=_installs("loss_scale")),
    # Last: under multi_worker_mirrored it wraps keras_files's BackupAndRestore fixes, so
    # every worker (not only the chief, whose calls keras_files passes through) saves.
    Feature("keras_backup", "keras.callbacks.BackupAndRestore: SIGTERM is a save point, "
            "mid-epoch resume", when="always", fixes=("keras_backup",), attach=_keras_backup),
)

# The synchronous data-parallel presets' options (mirrored, multi_worker_mirrored).
SYNC_FEATURES: tuple[Feature, ...] = (
    Feature("sharding", "ZeRO stages 1-3 and host offload (tfdist.sharding)",
            when="shard != 'none'", fixes=("sharding_variables", "sharding_collectives"),
            attach=_sharding, applies=lambda o: getattr(o, "shard", "none") != "none"),
    Feature("comm", "gradient compression and buckets (tfdist.comm)",
            when="gradient_compression != 'none' or bucket_bytes > 0",
            fixes=("comm_collectives",), attach=_comm, applies=_wants_comm),
)


def _keras_multi_worker(strategy, options, state) -> None:
    from tfdist.compat import keras_files, keras_multi_worker

    keras_multi_worker.install()
    keras_files.install_or_warn()  # Keras's own file writers: only the chief's file stays


MULTI_WORKER_FEATURES: tuple[Feature, ...] = (
    Feature("keras_multi_worker", "Keras 3 fit across workers (keras-team/keras#20585); "
            "Keras's own file writers leave one intact file, the chief's",
            when="always", fixes=("keras_multi_worker", "keras_files"),
            attach=_keras_multi_worker),
    Feature("initial_values", "variables of any dtype (bfloat16, int8, ...) start from worker "
            "0's value: their initial-value broadcast is widened exactly",
            when="always", fixes=("initial_values",), attach=_installs("initial_values")),
    Feature("keras_log_reduction", "a multi-worker step's scalar logs (loss, metrics) "
            "reduced in one collective instead of one each (keras-team/keras#20585)",
            # After keras_multi_worker's fix (so around it): one collective for the logs.
            when="always", fixes=("keras_log_reduction",), attach=_installs("keras_log_reduction")),
    Feature("keras_array_input", "fit/evaluate/predict on NumPy arrays: one order per epoch, "
            "the same on every worker (without a global seed each drew its own), and each "
            "worker gathers only its share of every global batch (not all of it)",
            when="always", fixes=("keras_array_input",), attach=_installs("keras_array_input")),
)


# Strategies whose fit reads a DistributedDataset (mirrored, multi_worker_mirrored).
ITERATOR_FEATURES: tuple[Feature, ...] = (
    Feature("keras_epoch_iterator", "fit without steps_per_epoch builds one distributed data "
            "iterator per epoch instead of two (Keras discards the end-of-epoch one; each costs "
            "a MultiDeviceIterator, across workers an auto-sharded one)",
            when="always", fixes=("keras_epoch_iterator",),
            attach=_installs("keras_epoch_iterator")),
)


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
    features=COMMON_FEATURES,
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
    features=ITERATOR_FEATURES + COMMON_FEATURES + SYNC_FEATURES,
    fixes=("collective_keys",),
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


register_preset(
    "multi_worker_mirrored",
    options=config_lib.MultiWorkerMirroredOptions,
    summary="Synchronous data parallelism over several processes/machines "
            "(MultiWorkerMirroredStrategy, ring all-reduce); Keras 3 fit fixed.",
    needs="TF_CONFIG with chief/worker tasks (set by `tfdist launch`); none for 1 worker",
    features=MULTI_WORKER_FEATURES + ITERATOR_FEATURES + COMMON_FEATURES + SYNC_FEATURES,
    factory="tfdist.multi_worker:build_strategy",
    fixes=("collective_keys",),  # a further strategy in a process that joined its cluster
)

def _ps_recovery(strategy, options, state) -> None:
    from tfdist.ps import strategy as ps_strategy

    ps_strategy.attach_recovery(strategy, options, state)


PS_FEATURES: tuple[Feature, ...] = (
    Feature("ps_recovery", "worker failures recovered one worker at a time (each re-run step "
            "counted, and skipped once applied with skip_completed_reruns); a clear error "
            "when every worker stays lost", when="always", fixes=("ps_recovery",),
            attach=_ps_recovery),
)

register_preset(
    "parameter_server",
    options=config_lib.ParameterServerOptions,
    summary="Asynchronous parameter-server training (ParameterServerStrategy + "
            "ClusterCoordinator) with plain model.fit.",
    needs="an in-process cluster (local_workers, local_ps) or a TF_CONFIG cluster with "
          "a chief, 1+ workers and 1+ ps",
    features=PS_FEATURES + COMMON_FEATURES,
    # Its factory installs the Keras fixes on the coordinator only (workers and ps
    # serve inside it and never return).
    fixes=("ps_keras", "ps_variables", "ps_tables", "ps_fit"),
    factory="tfdist.ps.strategy:make_strategy",
)


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
    return _build(chosen, chosen.options())  # the chosen preset's strategy and features
