"""tfdist: distributed training of Keras 3 models on TensorFlow that works.

    import tfdist
    strategy = tfdist.make_strategy("mirrored")
    with strategy.scope():
        model = ...; model.compile(...)
    model.fit(dataset, epochs=3)

Names are loaded on first use: `import tfdist` and the config/flags modules
do not import TensorFlow, so the CLI and the planner start fast and
`configure_logical_devices` can still run before the runtime starts.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    # presets
    "make_strategy": "tfdist.strategies",
    "make_options": "tfdist.strategies",
    "available_presets": "tfdist.strategies",
    "get_preset": "tfdist.strategies",
    "register_preset": "tfdist.strategies",
    "describe": "tfdist.strategies",
    "replica_devices": "tfdist.strategies",
    "Preset": "tfdist.strategies",
    "Feature": "tfdist.strategies",
    "installs": "tfdist.strategies",
    "Installs": "tfdist.strategies",
    # what tfdist attached to a strategy it made; how its replicas exchange gradients
    "StrategyState": "tfdist.state",
    "state_of": "tfdist.state",
    "GradientSync": "tfdist.sync",
    # configuration
    "DefaultOptions": "tfdist.config",
    "OneDeviceOptions": "tfdist.config",
    "MirroredOptions": "tfdist.config",
    "StepOptions": "tfdist.config",
    "per_replica_batch_size": "tfdist.config",
    # TensorFlow without its C++ start-up lines
    "import_tensorflow": "tfdist._tf",
    # devices
    "configure_logical_devices": "tfdist.devices",
    "configure_threads": "tfdist.devices",
    "logical_device_names": "tfdist.devices",
    "RuntimeAlreadyInitializedError": "tfdist.devices",
    # cluster: TF_CONFIG parse / validate / generate (no TensorFlow)
    "TASK_TYPES": "tfdist.cluster",
    "Cluster": "tfdist.cluster",
    "TFConfig": "tfdist.cluster",
    "TFConfigError": "tfdist.cluster",
    "TFConfigWarning": "tfdist.cluster",
    "parse_tf_config": "tfdist.cluster",
    "tf_config_from_env": "tfdist.cluster",
    "tf_config_for": "tfdist.cluster",
    "tf_configs": "tfdist.cluster",
    "free_ports": "tfdist.cluster",
    "local_cluster": "tfdist.cluster",
    "hosts_cluster": "tfdist.cluster",
    "slurm_tf_config": "tfdist.cluster",
    "kubernetes_tfjob": "tfdist.cluster",
    "kubernetes_trainjob": "tfdist.cluster",
    "kubernetes_training_runtime": "tfdist.cluster",
    "kubernetes_cluster": "tfdist.cluster",
    "to_yaml": "tfdist.cluster",
    "check_cluster_for": "tfdist.cluster",
    "check_local_ports": "tfdist.cluster",
    # multi-worker: preset options, chief-only writing, launcher, exact resume
    "MultiWorkerMirroredOptions": "tfdist.config",
    "is_chief": "tfdist.chief",
    "chief_path": "tfdist.chief",
    "fit_verbose": "tfdist.chief",
    "LaunchResult": "tfdist.launch",
    "BackupAndRestore": "tfdist.checkpoint",
    # notebooks
    "notebook_launcher": "tfdist.launch.notebook",
    "NotebookLaunchError": "tfdist.launch.notebook",
    # parameter-server training
    "ParameterServerOptions": "tfdist.config",
    "ParameterServerError": "tfdist.ps",
    "PerWorkerDataset": "tfdist.ps",

    # one description of parallelism: replicas x shards x stages x tensor x sequence
    "Parallelism": "tfdist.parallelism",

    # model splitting (tfdist/split/)
    "split_model": "tfdist.split.pipeline",
    "SplitModel": "tfdist.split.pipeline",
    "placement_report": "tfdist.split.report",
    "plan_balanced": "tfdist.split.balance",
    "plan_from_rules": "tfdist.split.balance",

    # cost model and planner (tfdist.planning), auto preset, monitoring
    "plan": "tfdist.planning.planner",
    "Recommendation": "tfdist.planning.planner",
    "this_machine": "tfdist.planning.planner",
    "model_stats": "tfdist.planning.stats",
    "AutoOptions": "tfdist.config",
    "choose_preset": "tfdist.strategies",
    "ThroughputMonitor": "tfdist.callbacks",
    # training like one device (docs/numerics.md)
    "sum_duplicate_sparse_gradients": "tfdist.numerics",
    "keep_duplicate_sparse_slices": "tfdist.numerics",
    "replica_spread": "tfdist.numerics",
}

# former public name -> (its new name, the module that defines it); a DeprecationWarning on use
_DEPRECATED = {
    "Plan": ("Recommendation", "tfdist.planning.planner"),
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _DEPRECATED:
        import warnings

        new, module = _DEPRECATED[name]
        warnings.warn(f"tfdist.{name} is deprecated: use tfdist.{new}.", DeprecationWarning,
                      stacklevel=2)
        return getattr(importlib.import_module(module), new)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tfdist' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
