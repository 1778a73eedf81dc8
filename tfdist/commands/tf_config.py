"""`tfdist tf-config`: check the TF_CONFIG of this environment, or generate TF_CONFIGs.

    tfdist tf-config --check [--strategy=multi_worker_mirrored]  # validate $TF_CONFIG
    tfdist tf-config --local --num_workers=2 [--num_ps=1] [--chief] [--evaluator]
    tfdist tf-config --hosts=node1,node2,node3 [--num_ps=1] [--chief] [--port=2222]
    tfdist tf-config --slurm [--num_ps=1] [--chief]  # inside `srun`: this task's TF_CONFIG
    tfdist tf-config --kubernetes --name=mnist --image=IMAGE --num_workers=2 -- python train.py
    tfdist tf-config --kubernetes --kind=trainjob --name=mnist --image=IMAGE --num_workers=2 \
        -- python train.py                          # Kubeflow Trainer v2 (runtime + TrainJob)

Exit codes of --check: 0 valid (one-line summary), 1 invalid (the message,
no traceback), 2 TF_CONFIG unset. The generators exit 1 on invalid input
(the message) and 2 on a usage error (e.g. no mode, a missing flag).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import warnings

from absl import flags

from tfdist import cluster as cluster_lib

_MODES = ("check", "local", "hosts", "slurm", "kubernetes")

flags.DEFINE_bool("check", False, "Validate $TF_CONFIG (or --tf_config) and print a summary.")
flags.DEFINE_string("tf_config", None, "With --check: the TF_CONFIG text to check "
                    "instead of the environment variable.")
flags.DEFINE_enum("strategy", None, list(cluster_lib.STRATEGY_KINDS),
                  "With --check: also check the roles this strategy needs.")
flags.DEFINE_bool("local", False, "Generate TF_CONFIGs for local tasks on free 127.0.0.1 ports.")
flags.DEFINE_list("hosts", None, "Generate TF_CONFIGs for these machines "
                  "('host' or 'host:port', comma-separated; order: chief, workers, ps, "
                  "evaluator).")
flags.DEFINE_bool("slurm", False, "Print this SLURM task's TF_CONFIG (run under srun).")
flags.DEFINE_bool("kubernetes", False, "Print a Kubernetes manifest (see --kind); the command "
                  "to run goes after `--`.")
flags.DEFINE_enum("kind", "tfjob", ["tfjob", "trainjob"],
                  "--kubernetes: 'tfjob' (Kubeflow training operator v1 TFJob: chief, workers, "
                  "ps, evaluator) or 'trainjob' (Kubeflow Trainer v2: a plain TrainingRuntime "
                  "and a TrainJob whose pods get TF_CONFIG from their index; workers only).")
flags.DEFINE_integer("num_workers", None, "Number of worker tasks (--local, --kubernetes; "
                     "with --slurm: the step must have exactly this many workers).")
flags.DEFINE_integer("num_ps", 0, "Number of parameter-server tasks.")
flags.DEFINE_bool("chief", False, "Add a chief task.")
flags.DEFINE_bool("evaluator", False, "Add an evaluator task.")
flags.DEFINE_integer("port", None, "Port: default 2222 for --hosts and --kubernetes, "
                     "8888 (first task on a node) for --slurm.")
flags.DEFINE_enum("slurm_addresses", "auto", ["auto", "name", "nodeaddr"],
                  "--slurm: the tasks' hosts: the node names ('name'), SLURM's NodeAddr of each "
                  "node from `scontrol show node` ('nodeaddr'), or the name where DNS resolves "
                  "it and the NodeAddr elsewhere ('auto').")
flags.DEFINE_string("rpc_layer", None, "Optional TF_CONFIG rpc_layer (e.g. grpc).")
flags.DEFINE_string("task", None, "Print only this task's TF_CONFIG, e.g. 'worker:1' "
                    "(--local, --hosts).")
flags.DEFINE_enum("format", None, ["env", "json", "yaml"],
                  "Output: 'env' (TF_CONFIG='...' lines, the default for TF_CONFIGs), "
                  "'json' (the value alone; the manifest as JSON for --kubernetes), "
                  "'yaml' (--kubernetes default).")
flags.DEFINE_string("name", None, "--kubernetes: the TFJob / TrainJob name.")
flags.DEFINE_string("image", None, "--kubernetes: the container image.")
flags.DEFINE_string("namespace", None, "--kubernetes: the namespace (omitted if unset).")
flags.DEFINE_enum("restart_policy", "OnFailure", ["Always", "OnFailure", "Never", "ExitCode"],
                  "--kubernetes --kind=tfjob: the replicas' restartPolicy.")
flags.DEFINE_string("runtime", "tfdist-tensorflow", "--kubernetes --kind=trainjob: the name of "
                    "the plain TrainingRuntime printed with the TrainJob.")

FLAGS = flags.FLAGS


class _UsageError(Exception):
    pass


def _err(message: str) -> None:
    # A message may quote hostile input (invalid UTF-8 from the environment):
    # it must still print.
    text = f"tfdist tf-config: {message}\n"
    sys.stderr.write(text.encode("ascii", "backslashreplace").decode("ascii"))
    sys.stderr.flush()


def _print_configs(configs: list[cluster_lib.TFConfig], fmt: str) -> None:
    if FLAGS.task:
        task_type, _, index = FLAGS.task.partition(":")
        if not re.fullmatch(r"[0-9]+", index):
            raise _UsageError(f"--task must look like 'worker:1'. Received: --task={FLAGS.task!r}")
        configs = [c for c in configs if (c.task_type, c.task_id) == (task_type, int(index))]
        if not configs:
            raise _UsageError(f"--task={FLAGS.task} is not a task of this cluster.")
    for config in configs:
        value = config.to_json()
        print(value if fmt == "json" else f"TF_CONFIG={shlex.quote(value)}")


def _check() -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", cluster_lib.TFConfigWarning)
        try:
            if FLAGS.tf_config is not None:
                config = cluster_lib.parse_tf_config(FLAGS.tf_config)
            else:
                config = cluster_lib.tf_config_from_env()
        except cluster_lib.TFConfigError as e:
            _err(f"error: {e}")
            return 1
    for w in caught:
        _err(f"warning: {w.message}")
    if config is not None and FLAGS.strategy:
        try:
            cluster_lib.check_cluster_for(config, FLAGS.strategy)
        except cluster_lib.TFConfigError as e:
            _err(f"error: {e}")
            return 1
    if config is None:
        _err("TF_CONFIG is not set (or is empty or '{}'): this process would train on "
             "its own. Set it, e.g. with `tfdist tf-config --local --num_workers=2`.")
        return 2
    print(f"TF_CONFIG OK: {config.summary()}")
    return 0


def _run(mode: str, extra: list[str]) -> int:
    if mode != "kubernetes" and extra:
        raise _UsageError(f"unexpected arguments: {' '.join(extra)}")
    if mode == "check":
        return _check()
    fmt = FLAGS.format
    if mode == "kubernetes":
        missing = [f"--{n}" for n in ("name", "image", "num_workers") if getattr(FLAGS, n) is None]
        if missing or not extra:
            raise _UsageError(
                "--kubernetes needs "
                f"{', '.join(missing + ([] if extra else ['a command after --']))}"
                f", e.g. tfdist tf-config --kubernetes --name=mnist --image=IMAGE "
                f"--num_workers=2 -- python train.py")
        port = 2222 if FLAGS.port is None else FLAGS.port
        if FLAGS.kind == "trainjob":
            unsupported = [f for f, on in (("--num_ps", FLAGS.num_ps), ("--chief", FLAGS.chief),
                                            ("--evaluator", FLAGS.evaluator)) if on]
            if unsupported:
                raise _UsageError(
                    f"--kind=trainjob runs workers only (Trainer v2 has one kind of pod); "
                    f"{', '.join(unsupported)} need --kind=tfjob.")
            manifests = [
                cluster_lib.kubernetes_training_runtime(name=FLAGS.runtime, port=port,
                                                        namespace=FLAGS.namespace),
                cluster_lib.kubernetes_trainjob(
                    name=FLAGS.name, image=FLAGS.image, command=extra,
                    num_workers=FLAGS.num_workers, port=port, namespace=FLAGS.namespace,
                    runtime=FLAGS.runtime)]
        else:
            manifests = [cluster_lib.kubernetes_tfjob(
                name=FLAGS.name, image=FLAGS.image, command=extra,
                num_workers=FLAGS.num_workers, num_ps=FLAGS.num_ps, chief=FLAGS.chief,
                evaluator=FLAGS.evaluator, port=port, namespace=FLAGS.namespace,
                restart_policy=FLAGS.restart_policy)]
        if fmt == "json":
            document = manifests[0] if len(manifests) == 1 else {
                "apiVersion": "v1", "kind": "List", "items": manifests}
            print(json.dumps(document, indent=2))
        else:
            print(cluster_lib.to_yaml(*manifests), end="")
        return 0
    if fmt == "yaml":
        raise _UsageError("--format=yaml is only for --kubernetes; use env or json.")
    fmt = fmt or "env"
    if mode == "slurm":
        config = cluster_lib.slurm_tf_config(
            port=8888 if FLAGS.port is None else FLAGS.port, num_ps=FLAGS.num_ps,
            chief=FLAGS.chief, evaluator=FLAGS.evaluator, num_workers=FLAGS.num_workers,
            addresses=FLAGS.slurm_addresses, rpc_layer=FLAGS.rpc_layer)
        _print_configs([config], fmt)
        return 0
    if mode == "local":
        if FLAGS.num_workers is None:
            raise _UsageError("--local needs --num_workers, e.g. --local --num_workers=2")
        cluster = cluster_lib.local_cluster(num_workers=FLAGS.num_workers, num_ps=FLAGS.num_ps,
                                            chief=FLAGS.chief, evaluator=FLAGS.evaluator)
    else:
        if FLAGS.num_workers is not None:
            raise _UsageError("--hosts takes no --num_workers: every host not used by "
                              "the chief, ps or evaluator is a worker.")
        cluster = cluster_lib.hosts_cluster(
            FLAGS.hosts, num_ps=FLAGS.num_ps, chief=FLAGS.chief, evaluator=FLAGS.evaluator,
            port=2222 if FLAGS.port is None else FLAGS.port)
    _print_configs(cluster_lib.tf_configs(cluster, rpc_layer=FLAGS.rpc_layer), fmt)
    return 0


def main(argv: list[str]) -> int:
    chosen = [m for m in _MODES if (FLAGS[m].value if m != "hosts" else FLAGS.hosts is not None)]
    if len(chosen) != 1:
        _err(f"choose exactly one of {', '.join('--' + m for m in _MODES)}. "
             f"Received: {', '.join('--' + m for m in chosen) or 'none'}. See --help.")
        return 2
    try:
        return _run(chosen[0], list(argv[1:]))
    except _UsageError as e:
        _err(str(e))
        return 2
    except cluster_lib.TFConfigError as e:
        _err(f"error: {e}")
        return 1
