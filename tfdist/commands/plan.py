"""`tfdist plan`: cost a model on a machine or cluster and recommend a preset.

    tfdist plan --model=mlp --global_batch_size=512            # this machine
    tfdist plan --model=ResNet50 --input_shape=224,224,3       # keras.applications, no weights
    tfdist plan --model=my_pkg.models:build_gpt --input_shape=token_ids:512,padding_mask:512
    tfdist plan --model=trained.keras --devices=8 --device_memory=80GB --bandwidth=300GB/s
    tfdist plan --params=7e9 --devices=8 --device_memory=80GB \\
        --bandwidth=300GB/s --latency=5us --global_batch_size=512
    tfdist plan --params=1.3B --machines=4 --devices=8 --device_memory=40GB \\
        --bandwidth=300GB/s --network_bandwidth=25Gbps --network_latency=10us
    tfdist plan --params=350M --cluster='{"machines": 2, "devices": 4, ...}' --format=json

Exit status: 0 with a recommendation, 1 when no configuration fits the
device memory, 2 for bad input (the message says what to fix).
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags

from tfdist import planning
from tfdist.planning import planner

_MODEL = flags.DEFINE_string(
    "model", None, "The model to plan for: an example model from models/ (mlp, cnn, "
    "transformer), your own as package.module:function (called with no arguments, returns a "
    "built keras.Model), a saved .keras file, or a keras.applications name such as ResNet50 "
    "(built with weights=None: nothing is downloaded). Exclusive with --params.")
_INPUT_SHAPE = flags.DEFINE_list(
    "input_shape", None, "With --model: one example's input shape without the batch, e.g. "
    "28,28,1 (example models and keras.applications are built with it; default 28,28,1 and "
    "the application's own), or the lengths a text model's unknown dimensions take, per "
    "input as name:dims with x between dimensions, e.g. token_ids:512,padding_mask:512.")
_NUM_CLASSES = flags.DEFINE_integer("num_classes", 10, "With --model: the number of classes.")
_PARAMS = flags.DEFINE_string(
    "params", None, "Trainable parameter count instead of a model: 7e9, 7B, 350M, 125000.")
_ACTIVATIONS = flags.DEFINE_string(
    "activation_bytes", None, "With --params: activation bytes kept per example, e.g. 40MB "
    "(default 0: activations ignored).")
_FLOPS = flags.DEFINE_string(
    "flops_per_example", None, "With --params: forward FLOPs per example, e.g. 2.4G "
    "(enables step-time estimates with --device_flops).")
_BATCH = flags.DEFINE_integer("global_batch_size", 256, "Examples per step over all replicas.")
_OPTIMIZER = flags.DEFINE_string(
    "optimizer", "adam", f"Optimizer whose state to count: {', '.join(planning.OPTIMIZER_SLOTS)}.")
_CLUSTER = flags.DEFINE_string(
    "cluster", None, "The hardware as JSON (or a path to a .json file) with keys machines, "
    "devices, device_kind, device_memory, device_flops, bandwidth, latency, "
    "network_bandwidth, network_latency. Exclusive with the flags below.")
_MACHINES = flags.DEFINE_integer("machines", None, "Machines (hosts); default 1.")
_DEVICES = flags.DEFINE_integer("devices", None, "Devices per machine; default: this machine's.")
_DEVICE_KIND = flags.DEFINE_enum("device_kind", None, ["CPU", "GPU", "TPU"],
                                 "Device type; default GPU when --devices is given.")
_DEVICE_MEMORY = flags.DEFINE_string("device_memory", None, "Memory per device: 80GB, 16GiB.")
_DEVICE_FLOPS = flags.DEFINE_string(
    "device_flops", None, "Peak FLOP/s per device, e.g. 312T (enables step-time estimates).")
_BANDWIDTH = flags.DEFINE_string(
    "bandwidth", None, "Device-to-device bandwidth within a machine: 300GB/s, 25Gbps "
    "(bits), a bare number is bytes/s.")
_LATENCY = flags.DEFINE_string("latency", None, "Per-message latency within a machine: 5us.")
_NET_BANDWIDTH = flags.DEFINE_string("network_bandwidth", None,
                                     "Bandwidth between machines: 25Gbps, 100Gb/s.")
_NET_LATENCY = flags.DEFINE_string("network_latency", None, "Latency between machines: 10us.")
_NUM_PS = flags.DEFINE_integer("num_ps", None, "Parameter servers to cost (multi-machine).")
_FORMAT = flags.DEFINE_enum("format", "text", ["text", "json"], "Output format.")

_CLUSTER_KEYS = ("machines", "devices", "device_kind", "device_memory", "device_flops",
                 "bandwidth", "latency", "network_bandwidth", "network_latency")
_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12}


def parse_count(text: str, *, what: str) -> float:
    """'7e9', '7B', '350M', '2.4G', '125000' -> a positive number."""
    raw = str(text).strip()
    unit = raw[-1:].lower() if raw[-1:].isalpha() else ""
    try:
        value = float(raw[:-1] if unit else raw) * _SUFFIX[unit]
    except (ValueError, KeyError):
        value = float("nan")
    if value == float("inf"):
        raise ValueError(f"{what} must be a finite number such as 7e9, 7B, 350M or 125000; "
                         f"{text!r} is too large to represent. Received: {what}={text!r}")
    if not value > 0:
        raise ValueError(f"{what} must be a positive number such as 7e9, 7B, 350M or 125000. "
                         f"Received: {what}={text!r}")
    return value


def cluster_from_dict(spec: dict) -> planning.HardwareCluster:
    """Builds the hardware from a description such as the --cluster JSON.

    Raises:
      ValueError: unknown keys, missing device memory, unparsable values.
    """
    if not isinstance(spec, dict):
        raise ValueError(f"The cluster description must be a JSON object with keys "
                         f"{', '.join(_CLUSTER_KEYS)}. Received: {spec!r}")
    unknown = sorted(set(spec) - set(_CLUSTER_KEYS))
    if unknown:
        raise ValueError(f"Unknown key(s) in the cluster description: {', '.join(unknown)}. "
                         f"Valid keys: {', '.join(_CLUSTER_KEYS)}.")
    if "device_memory" not in spec:
        raise ValueError("The cluster description needs device_memory (e.g. \"80GB\"): the "
                         "planner checks every configuration against it.")
    machines = spec.get("machines", 1)
    devices = spec.get("devices", 1)
    for name, value in (("machines", machines), ("devices", devices)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1. Received: {name}={value!r}")
    if devices > 1 and "bandwidth" not in spec:
        raise ValueError(f"{devices} devices per machine need the bandwidth between them "
                         "(e.g. \"300GB/s\" for NVLink, \"25GB/s\" for PCIe): the all-reduce "
                         "time depends on it. Received: bandwidth missing.")
    if machines > 1 and "network_bandwidth" not in spec:
        raise ValueError(f"{machines} machines need network_bandwidth (e.g. \"25Gbps\"). "
                         "Received: network_bandwidth missing.")
    link = planning.Link(
        bandwidth=planning.parse_bandwidth(spec["bandwidth"]) if "bandwidth" in spec
        else planner.DEFAULT_LOCAL_LINK.bandwidth,
        latency=planning.parse_duration(spec.get("latency", 0)))
    network = None
    if "network_bandwidth" in spec:
        network = planning.Link(
            bandwidth=planning.parse_bandwidth(spec["network_bandwidth"], what="network_bandwidth"),
            latency=planning.parse_duration(spec.get("network_latency", 0), what="network_latency"))
    flops = spec.get("device_flops")
    device = planning.Device(
        kind=spec.get("device_kind", "GPU"),
        memory=planning.parse_bytes(spec["device_memory"], what="device_memory"),
        peak_flops=None if flops is None else parse_count(flops, what="device_flops"))
    machine = planning.Machine(device=device, num_devices=devices, link=link)
    return planning.HardwareCluster(machine=machine, num_machines=machines, network=network)


def _cluster_from_flags() -> planning.HardwareCluster:
    given = {name: getattr(flags.FLAGS, name) for name in _CLUSTER_KEYS}
    given = {k: v for k, v in given.items() if v is not None}
    if _CLUSTER.value is not None:
        if given:
            raise ValueError("Pass the hardware either as --cluster or as --devices/"
                             f"--device_memory/... flags, not both. Received: --cluster and "
                             f"{', '.join('--' + k for k in sorted(given))}.")
        text = _CLUSTER.value
        if os.path.exists(text):
            with open(text) as f:
                text = f.read()
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"--cluster is not valid JSON ({error.msg} at line {error.lineno} column "
                f"{error.colno}) nor an existing file. Received: --cluster={_CLUSTER.value!r}. "
                'Example: --cluster=\'{"machines": 2, "devices": 8, "device_memory": "80GB", '
                '"bandwidth": "300GB/s", "network_bandwidth": "25Gbps"}\'') from None
        return cluster_from_dict(spec)
    if not given or set(given) <= {"latency", "bandwidth"}:
        local = planner.this_machine()
        link = local.link
        if given:
            link = planning.Link(
                bandwidth=planning.parse_bandwidth(given.get("bandwidth", link.bandwidth)),
                latency=planning.parse_duration(given.get("latency", link.latency)))
        return planning.HardwareCluster(machine=planning.Machine(
            device=local.device, num_devices=local.num_devices, link=link))
    if "device_memory" not in given:
        raise ValueError("--device_memory is required when describing other hardware "
                         "(e.g. --devices=8 --device_memory=80GB): the planner checks every "
                         "configuration against it.")
    return cluster_from_dict(given)


def _stats():
    if (_MODEL.value is None) == (_PARAMS.value is None):
        raise ValueError("Pass exactly one of --model=NAME (from models/) or --params=N. "
                         f"Received: --model={_MODEL.value!r}, --params={_PARAMS.value!r}.")
    if _PARAMS.value is not None:
        if _INPUT_SHAPE.value is not None:
            raise ValueError("--input_shape goes with --model. Received: --params and "
                             f"--input_shape={','.join(_INPUT_SHAPE.value)}.")
        return planning.ModelStats.from_param_count(
            int(parse_count(_PARAMS.value, what="params")),
            activation_bytes_per_example=0 if _ACTIVATIONS.value is None else planning.parse_bytes(
                _ACTIVATIONS.value, what="activation_bytes"),
            forward_flops_per_example=None if _FLOPS.value is None else parse_count(
                _FLOPS.value, what="flops_per_example"))
    for name, value in (("activation_bytes", _ACTIVATIONS.value),
                        ("flops_per_example", _FLOPS.value)):
        if value is not None:
            raise ValueError(f"--{name} goes with --params; with --model it is read from the "
                             f"model. Received: --{name}={value!r}.")
    shape, per_input = parse_input_shape(_INPUT_SHAPE.value)
    model, built_with_shape = load_model(_MODEL.value, shape, _NUM_CLASSES.value)
    input_shapes = per_input if per_input is not None else (
        None if built_with_shape or shape is None else shape)
    return planning.model_stats(model, input_shapes=input_shapes)


def parse_input_shape(value: list[str] | None):
    """(shape, None) from 28,28,1; (None, {name: shape}) from token_ids:512,mask:512.

    Raises:
      ValueError: not positive integers, or a mix of both forms.
    """
    if value is None:
        return None, None
    text = ",".join(value)
    if any(":" in item for item in value):
        shapes = {}
        for item in value:
            name, _, dims = item.partition(":")
            try:
                shape = tuple(int(d) for d in dims.split("x"))
            except ValueError:
                shape = ()
            if not name or not shape or min(shape) < 1 or name in shapes:
                raise ValueError(
                    "input_shape per input must be name:dims with positive integers joined by "
                    f"x, each input once, e.g. token_ids:512,image:32x32x3. Received: "
                    f"--input_shape={text}")
            shapes[name] = shape
        return None, shapes
    try:
        shape = tuple(int(d) for d in value)
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise ValueError("input_shape must be positive integers such as 28,28,1 (or name:dims "
                         f"per input). Received: --input_shape={text}")
    return shape, None


def load_model(spec: str, shape: tuple | None, num_classes: int):
    """The model --model names; returns (model, whether it was built with `shape`).

    Raises:
      ValueError: a spec that names nothing loadable, saying which forms exist.
    """
    import importlib
    import os

    from tfdist._tf import import_tensorflow

    # Before anything imports keras (the example models, the user's module):
    # TensorFlow without its C++ start-up lines, so stdout/stderr stay clean.
    import_tensorflow()
    if ":" in spec and not os.path.exists(spec):
        module_name, _, function = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ValueError(f"--model={spec}: cannot import module {module_name!r} ({error}). "
                             "Run from the directory that holds it, or put it on PYTHONPATH."
                             ) from None
        builder = getattr(module, function, None)
        if not callable(builder):
            raise ValueError(f"--model={spec}: module {module_name!r} has no function "
                             f"{function!r}. Give package.module:function.")
        try:
            built = builder()
        except Exception as error:  # noqa: BLE001 - the user's function failed: say so
            raise ValueError(f"--model={spec}: calling {function}() failed "
                             f"({type(error).__name__}: {str(error)[:300]}). It must take no "
                             "arguments and return a built keras.Model.") from None
        return _check_model(built, spec), False
    if spec.endswith((".keras", ".h5")) or os.path.exists(spec):
        if not os.path.isfile(spec):
            raise ValueError(f"--model={spec}: no such file. Give a saved .keras file, "
                             "package.module:function, an example model or a "
                             "keras.applications name.")
        import keras

        try:
            model = keras.saving.load_model(spec, compile=False)
        except Exception as error:  # noqa: BLE001 - any loading failure, reported the same way
            raise ValueError(f"--model={spec}: cannot load this file "
                             f"({type(error).__name__}: {str(error)[:300]}).") from None
        return _check_model(model, spec), False
    examples = _example_models()
    if spec in examples:
        import models

        return models.build_model(spec, shape or (28, 28, 1), num_classes), True
    name = spec.removeprefix("keras.applications.")
    import keras

    application = getattr(keras.applications, name, None)
    if callable(application) and name[:1].isupper():
        kwargs = {"weights": None, "classes": num_classes}
        if shape is not None:
            kwargs["input_shape"] = shape
        try:
            return application(**kwargs), True
        except ValueError as error:
            raise ValueError(f"--model={spec}: keras.applications.{name} refused "
                             f"--input_shape={shape}: {error}") from None
    known = ", ".join(examples) if examples else "none: the repository's models/ is not importable"
    raise ValueError(
        f"Unknown model {spec!r}. Give an example model ({known}), package.module:function, "
        "a saved .keras file, or a keras.applications name such as ResNet50.")


def _example_models() -> list[str]:
    try:
        import models
    except ImportError:
        return []
    return list(models.MODELS)


def _check_model(model, spec: str):
    if not hasattr(model, "trainable_variables") or not hasattr(model, "layers"):
        raise ValueError(f"--model={spec} gave {type(model).__name__}, not a keras.Model.")
    return model


def format_plan(plan: planner.Recommendation) -> str:
    """The plan as text: the hardware, one line per candidate, the recommendation."""
    c = plan.cluster
    m = c.machine
    dev = m.device
    lines = [
        f"hardware: {c.num_machines} machine(s) x {m.num_devices} {dev.kind}(s), "
        f"{planning.format_bytes(dev.memory)} each"
        + (f", {dev.peak_flops / 1e12:.1f} TFLOP/s peak" if dev.peak_flops else "")
        + f"; link {m.link.bandwidth / 1e9:.2f} GB/s, {planning.format_seconds(m.link.latency)}"
        + ("" if c.network is None else
           f"; network {c.network.bandwidth / 1e9:.3f} GB/s, "
           f"{planning.format_seconds(c.network.latency)}"),
        f"model: {plan.stats.num_params:,} parameters, "
        f"{planning.format_bytes(plan.stats.trainable_bytes)}; optimizer {plan.optimizer.name} "
        f"({plan.optimizer.slots_per_variable} slot(s)); global batch {plan.global_batch_size}",
        "",
        f"{'candidate':<44} {'replicas':>8} {'batch/rep':>9} {'memory/dev':>12} {'fits':>4} "
        f"{'comm/step':>12} {'comm time':>10} {'step':>10}",
    ]
    for cand in plan.candidates:
        mem = "-" if cand.memory is None else planning.format_bytes(cand.memory.total)
        step = "-" if cand.step_time is None else planning.format_seconds(cand.step_time)
        name = cand.name + ("" if cand.registered else "*")
        lines.append(
            f"{name:<44} {cand.num_replicas:>8} {cand.per_replica_batch_size or '-':>9} "
            f"{mem:>12} {'yes' if cand.fits else 'no':>4} "
            f"{planning.format_bytes(cand.communication_bytes):>12} "
            f"{planning.format_seconds(cand.communication_time):>10} {step:>10}")
    if any(not cand.registered for cand in plan.candidates):
        lines.append("(* not available in this installation: costed, never recommended)")
    options = "".join(f", {k}={v!r}" for k, v in plan.recommended_options)
    lines += ["", f"recommended: {plan.recommended or 'nothing fits'}{options}"]
    lines += [f"  - {reason}" for reason in plan.reasons]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"tfdist plan: unexpected arguments {argv[1:]}", file=sys.stderr)
        return 2
    try:
        stats = _stats()
        cluster = _cluster_from_flags()
        result = planner.plan(stats=stats, global_batch_size=_BATCH.value, machine=cluster,
                              optimizer=_OPTIMIZER.value, num_ps=_NUM_PS.value)
    except ValueError as error:
        print(f"tfdist plan: {error}", file=sys.stderr)
        return 2
    if _FORMAT.value == "json":
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(format_plan(result))
    return 0 if result.recommended else 1
