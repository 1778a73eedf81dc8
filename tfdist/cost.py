"""Memory and communication cost model for data- and model-parallel training.

The arithmetic here imports no TensorFlow: it works on plain numbers (a
parameter count, bytes, a device count, link bandwidth and latency), so the
planner and the CLI answer in milliseconds. `model_stats(model)` is the one
function that reads a built Keras model (its variables' shapes and its
layers' output shapes); everything else takes the `ModelStats` it returns
or one built by hand with `ModelStats.from_param_count(...)`.

The formulas (K = gradient bytes, N = replicas, B = global batch):

- per-replica batch: B / N (512 over 8 replicas is 64 each);
- memory per replica: parameters + gradients + optimizer slots (SGD 0,
  momentum 1, Adam/AdamW 2, ...) + non-trainable state + activations
  (the layers' output sizes x the per-replica batch);
- ring all-reduce: each rank sends (and receives) 2(N-1)/N * K bytes,
  nearly independent of N; time T = 2(N-1)a + 2(N-1)/N * K * b
  (a = latency per message, b = seconds per byte = 1 / bandwidth);
- central reducer (reduce to one device, or one parameter server):
  2(N-1) * K bytes pass through the reducer, T = 2(N-1)(a + K b);
- pipeline of S stages with M micro-batches: bubble (S-1)/(M+S-1), ideal
  speed-up S*M/(M+S-1);
- ZeRO-style sharding of mixed-precision Adam state: 16 bytes/parameter
  (2 fp16 weights + 2 fp16 grads + 12 fp32 master/m/v) -> 16/N per device
  at stage 3.

Example:
  >>> from tfdist import cost
  >>> cost.ring_allreduce_bytes_per_rank(100e6, 8)
  175000000.0
  >>> cost.pipeline_bubble(stages=4, micro_batches=12)
  0.2
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Iterable, Literal, Sequence

# --- units ---------------------------------------------------------------------

DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "uint32": 4, "uint64": 8, "uint16": 2, "complex64": 8, "complex128": 16,
}

_BYTE_UNITS = {
    "": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_RATE_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)"


def parse_bytes(text: str | float | int, *, what: str = "memory") -> int:
    """'80GB' -> 80e9, '16GiB' -> 16 * 2**30, '512MB', '1024' (bytes).

    Raises:
      ValueError: unparsable or not positive, naming the received value.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(_NUMBER + r"\s*([a-z]*)", str(text).strip().lower())
        if not match or match.group(2) not in _BYTE_UNITS:
            raise ValueError(
                f"{what} must be a size such as 80GB, 16GiB or 512MB. Received: {what}={text!r}"
            )
        value = float(match.group(1)) * _BYTE_UNITS[match.group(2)]
    _check_finite(what, value, text, example="80GB")
    if value <= 0:
        raise ValueError(f"{what} must be > 0. Received: {what}={text!r}")
    return int(value)


def _check_finite(what: str, value: float, text: Any, *, example: str) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number such as {example}; {text!r} is "
                         f"{'not a number' if math.isnan(value) else 'too large to represent'}."
                         f" Received: {what}={text!r}")


def parse_bandwidth(text: str | float | int, *, what: str = "bandwidth") -> float:
    """Link bandwidth in bytes/s: '25Gbps' / '25Gb/s' (bits) -> 3.125e9, '10GB/s' -> 1e10.

    A bare number is bytes per second.

    Raises:
      ValueError: unparsable, zero or negative, naming the received value.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        raw = str(text).strip()
        match = re.fullmatch(_NUMBER + r"\s*([kKmMgGtT]?)(bps|b/s|Bps|B/s|bit/s|byte/s)?",
                             raw.replace("ytes", "yte"))
        if not match or (match.group(2) and not match.group(3)):
            raise ValueError(
                f"{what} must be a rate such as 25Gbps (bits/s), 25Gb/s, or 10GB/s "
                f"(bytes/s). Received: {what}={text!r}"
            )
        unit = match.group(3) or "B/s"
        bits = unit in ("bps", "b/s", "bit/s")
        value = float(match.group(1)) * _RATE_PREFIX[match.group(2).lower()]
        value = value / 8 if bits else value
    _check_finite(what, value, text, example="25Gbps")
    if value <= 0:
        raise ValueError(f"{what} must be > 0. Received: {what}={text!r}")
    return value


def parse_duration(text: str | float | int, *, what: str = "latency") -> float:
    """Seconds from '5us', '0.2ms', '1e-5s' or a bare number of seconds (may be 0).

    Raises:
      ValueError: unparsable or negative, naming the received value.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(_NUMBER + r"\s*(s|ms|us|µs|ns)?", str(text).strip().lower())
        if not match:
            raise ValueError(
                f"{what} must be a duration such as 5us, 0.2ms or 1e-5s. Received: {what}={text!r}"
            )
        value = float(match.group(1)) * _TIME_UNITS[match.group(2) or "s"]
    _check_finite(what, value, text, example="5us")
    if value < 0:
        raise ValueError(f"{what} must be >= 0. Received: {what}={text!r}")
    return value


def format_bytes(num_bytes: float) -> str:
    """Human-readable bytes with binary prefixes: 1536 -> '1.50 KiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError  # unreachable


def format_seconds(seconds: float) -> str:
    """'12.3 ms', '45.0 us', '1.20 s'."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


# --- hardware specs -------------------------------------------------------------


def _check_positive(name: str, value: Any, *, integer: bool = False, allow_zero: bool = False):
    if value is None:
        raise ValueError(f"{name} is required. Received: {name}=None")
    bad_type = isinstance(value, bool) or not isinstance(value, (int, float))
    if integer:
        bad_type = bad_type or not isinstance(value, int)
    if bad_type or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind} {bound}. Received: {name}={value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Link:
    """A communication link in the alpha-beta model.

    Attributes:
      bandwidth: bytes per second (use `parse_bandwidth('25Gbps')` for bits).
      latency: seconds per message (alpha), >= 0.
    """

    bandwidth: float
    latency: float = 0.0

    def __post_init__(self):
        _check_positive("bandwidth", self.bandwidth)
        _check_positive("latency", self.latency, allow_zero=True)

    @property
    def seconds_per_byte(self) -> float:
        """beta: the inverse bandwidth."""
        return 1.0 / self.bandwidth


@dataclasses.dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator or (logical) CPU.

    Attributes:
      kind: "CPU", "GPU" or "TPU".
      memory: bytes available for one replica's model state and activations.
      peak_flops: FLOP/s for matmuls, if known (enables compute-time estimates).
    """

    kind: Literal["CPU", "GPU", "TPU"] = "GPU"
    memory: int
    peak_flops: float | None = None

    def __post_init__(self):
        if self.kind not in ("CPU", "GPU", "TPU"):
            raise ValueError(f"kind must be 'CPU', 'GPU' or 'TPU'. Received: kind={self.kind!r}")
        _check_positive("memory", self.memory)
        if self.peak_flops is not None:
            _check_positive("peak_flops", self.peak_flops)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Machine:
    """One host: `num_devices` identical devices joined by `link`.

    Attributes:
      device: the device type (all devices of a machine are identical).
      num_devices: devices on this host (>= 1).
      link: the device-to-device link (NVLink, PCIe, shared memory).
    """

    device: Device
    num_devices: int = 1
    link: Link

    def __post_init__(self):
        if not isinstance(self.device, Device):
            raise ValueError(
                f"device must be a tfdist.cost.Device. Received: device={self.device!r}")
        _check_positive("num_devices", self.num_devices, integer=True)
        if not isinstance(self.link, Link):
            raise ValueError(f"link must be a tfdist.cost.Link. Received: link={self.link!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """`num_machines` identical machines joined by `network`.

    Attributes:
      machine: the host type.
      num_machines: hosts (>= 1).
      network: the host-to-host link; required when num_machines > 1.
    """

    machine: Machine
    num_machines: int = 1
    network: Link | None = None

    def __post_init__(self):
        if not isinstance(self.machine, Machine):
            raise ValueError(
                f"machine must be a tfdist.cost.Machine. Received: machine={self.machine!r}")
        _check_positive("num_machines", self.num_machines, integer=True)
        if self.num_machines > 1 and self.network is None:
            raise ValueError(
                f"A cluster of {self.num_machines} machines needs the network between them: "
                "pass network=Link(bandwidth=..., latency=...) (CLI: --network_bandwidth=25Gbps "
                "--network_latency=10us). Received: network=None"
            )
        if self.network is not None and not isinstance(self.network, Link):
            raise ValueError(
                f"network must be a tfdist.cost.Link. Received: network={self.network!r}")

    @property
    def num_devices(self) -> int:
        return self.num_machines * self.machine.num_devices

    @property
    def slowest_link(self) -> Link:
        """The link a ring over all devices is limited by."""
        if self.num_machines == 1:
            return self.machine.link
        return self.network  # type: ignore[return-value]


def as_cluster(hardware: Machine | Cluster) -> Cluster:
    """A Machine is a one-machine Cluster."""
    if isinstance(hardware, Cluster):
        return hardware
    if isinstance(hardware, Machine):
        return Cluster(machine=hardware)
    raise ValueError(
        "machine must be a tfdist.cost.Machine or tfdist.cost.Cluster. "
        f"Received: {type(hardware).__name__} {hardware!r}"
    )


# --- optimizers -----------------------------------------------------------------

# Slots per trainable variable (each the variable's shape and dtype) for Keras 3's
# optimizers with default settings. Options that add slots are handled in
# `optimizer_state`.
OPTIMIZER_SLOTS: dict[str, int] = {
    "sgd": 0, "momentum": 1, "adam": 2, "adamw": 2, "adamax": 2, "nadam": 2, "lamb": 2,
    "rmsprop": 1, "adagrad": 1, "adadelta": 2, "ftrl": 2, "lion": 1,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerState:
    """How much state an optimizer keeps.

    Attributes:
      name: lower-case optimizer name ("adam", "sgd", ...).
      slots_per_variable: copies of each trainable variable it keeps.
      scalar_bytes: its scalar variables (iteration counter, learning rate, ...).
    """

    name: str
    slots_per_variable: int
    scalar_bytes: int = 12  # int64 iterations + float32 learning rate

    def __post_init__(self):
        _check_positive("slots_per_variable", self.slots_per_variable, integer=True,
                        allow_zero=True)
        _check_positive("scalar_bytes", self.scalar_bytes, integer=True, allow_zero=True)


def optimizer_state(optimizer: Any = "adam", *, momentum: float = 0.0, amsgrad: bool = False,
                    centered: bool = False, use_ema: bool = False,
                    gradient_accumulation_steps: int | None = None,
                    schedule: bool = False) -> OptimizerState:
    """The state of an optimizer given by name or as a Keras optimizer object.

    Args:
      optimizer: a name ("sgd", "momentum", "adam", "adamw", "rmsprop", ...) or a
        `keras.optimizers.Optimizer` (its config supplies the options below).
      momentum: SGD/RMSprop momentum (> 0 adds a slot).
      amsgrad: Adam/AdamW/Lamb... AMSGrad adds a slot.
      centered: RMSprop centered adds a slot.
      use_ema: exponential moving average of the weights adds a slot.
      gradient_accumulation_steps: > 1 adds a slot (the accumulators).
      schedule: the learning rate is a schedule (no learning-rate variable).

    Raises:
      ValueError: an optimizer this model does not know, listing the known ones.
    """
    if not isinstance(optimizer, str):
        return _keras_optimizer_state(optimizer)
    name = optimizer.strip().lower()
    if name not in OPTIMIZER_SLOTS:
        raise ValueError(
            f"Unknown optimizer {optimizer!r}. Known: {', '.join(sorted(OPTIMIZER_SLOTS))}. "
            "For another optimizer build OptimizerState(name=..., slots_per_variable=...)."
        )
    slots = OPTIMIZER_SLOTS[name]
    scalar = 8 + (0 if schedule else 4)
    if name == "sgd" and momentum:
        slots += 1
    if name == "rmsprop":
        slots += int(bool(momentum)) + int(bool(centered))
    if amsgrad and name in ("adam", "adamw", "nadam", "adamax", "lamb"):
        slots += 1
    if name == "nadam":
        scalar += 4  # u_product
    if use_ema:
        slots += 1
    if gradient_accumulation_steps is not None and gradient_accumulation_steps > 1:
        slots += 1  # accumulators; Keras counts with `iterations`, no extra scalar
    return OptimizerState(name=name, slots_per_variable=slots, scalar_bytes=scalar)


def _keras_optimizer_state(optimizer: Any) -> OptimizerState:
    if hasattr(optimizer, "inner_optimizer"):  # LossScaleOptimizer
        inner = _keras_optimizer_state(optimizer.inner_optimizer)
        # its own iterations (int64) and learning rate (float32), plus the
        # step counter (int64) and the dynamic loss scale (float32)
        return dataclasses.replace(inner, scalar_bytes=inner.scalar_bytes + 24)
    try:
        config = optimizer.get_config()
    except Exception as error:  # noqa: BLE001 - report any failure the same way
        raise ValueError(
            f"Cannot read the optimizer's configuration ({error}). Received: {optimizer!r}. "
            "Pass the optimizer's name instead, e.g. optimizer='adam'."
        ) from None
    name = type(optimizer).__name__.lower()
    lr = config.get("learning_rate")
    return optimizer_state(
        name,
        momentum=float(config.get("momentum", 0.0) or 0.0) if name in ("sgd", "rmsprop") else 0.0,
        amsgrad=bool(config.get("amsgrad", False)),
        centered=bool(config.get("centered", False)),
        use_ema=bool(config.get("use_ema", False)),
        gradient_accumulation_steps=config.get("gradient_accumulation_steps"),
        schedule=isinstance(lr, dict),
    )


# --- model statistics -------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerStats:
    """One layer: its output shape (without batch), parameters and cost per example."""

    name: str
    class_name: str
    output_shape: tuple[int | None, ...]
    num_params: int
    activation_elements: int
    forward_flops: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelStats:
    """What the cost model needs to know about a model.

    Attributes:
      num_params: trainable parameters (Psi).
      trainable_bytes: bytes of the trainable variables (= gradient bytes K).
      non_trainable_bytes: other model state (batch-norm statistics, seeds).
      activation_bytes_per_example: layer outputs kept for the backward pass,
        per example.
      forward_flops_per_example: FLOPs of one forward pass per example (a
        training step is about 3x that).
      layers: per-layer detail (empty when built from a parameter count).
    """

    num_params: int
    trainable_bytes: int
    non_trainable_bytes: int = 0
    activation_bytes_per_example: int = 0
    forward_flops_per_example: float = 0.0
    layers: tuple[LayerStats, ...] = ()

    def __post_init__(self):
        _check_positive("num_params", self.num_params, integer=True)
        _check_positive("trainable_bytes", self.trainable_bytes, integer=True)
        for name in ("non_trainable_bytes", "activation_bytes_per_example"):
            _check_positive(name, getattr(self, name), integer=True, allow_zero=True)
        _check_positive("forward_flops_per_example", self.forward_flops_per_example,
                        allow_zero=True)

    @classmethod
    def from_param_count(cls, num_params: int, *, bytes_per_param: int = 4,
                         activation_bytes_per_example: int = 0,
                         forward_flops_per_example: float | None = None) -> "ModelStats":
        """Stats for a model known only by its size.

        FLOPs per example depend on the architecture (a dense layer does 2 per
        parameter per example, a transformer 2 per parameter per *token*), so
        they stay unknown (0) unless given; the planner then makes no
        compute-time estimate.
        """
        _check_positive("num_params", num_params, integer=True)
        _check_positive("bytes_per_param", bytes_per_param, integer=True)
        return cls(num_params=num_params, trainable_bytes=num_params * bytes_per_param,
                   activation_bytes_per_example=activation_bytes_per_example,
                   forward_flops_per_example=forward_flops_per_example or 0.0)

    @property
    def gradient_bytes(self) -> int:
        """K: bytes all-reduced per step (one gradient per trainable variable)."""
        return self.trainable_bytes

    @property
    def train_flops_per_example(self) -> float:
        """Forward + backward (about 2x forward): 3x the forward FLOPs."""
        return 3.0 * self.forward_flops_per_example


def _variable_bytes(variables: Iterable[Any]) -> tuple[int, int]:
    count = total = 0
    for variable in variables:
        dtype = str(getattr(variable.dtype, "name", variable.dtype))
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"Variable {variable.name!r} has dtype {dtype!r}, which the cost "
                             f"model does not know. Known: {', '.join(DTYPE_BYTES)}.")
        size = math.prod(int(d) for d in variable.shape)
        count += size
        total += size * DTYPE_BYTES[dtype]
    return count, total


def model_stats(model: Any, *, input_shapes: Any = None) -> ModelStats:
    """Reads a built Keras model: exact variable bytes, traced activations and FLOPs.

    Parameter, gradient and non-trainable bytes are exact (summed over the
    model's real variables). FLOPs and activations come from tracing the
    forward pass at the given input shapes, one layer call at a time
    (`tfdist.flops`): FLOPs count every op the pass runs (matmuls, einsums,
    convolutions, element-wise arithmetic), inside custom layers too;
    activations are the outputs of every layer call (the tensors the backward
    pass keeps), at the variables' dtype. Nested models are expanded into
    their layers.

    Args:
      model: a built Functional or Sequential keras.Model (KerasHub models
        included).
      input_shapes: shapes of one example's inputs without the batch
        dimension, where the model leaves dimensions unknown (text models: the
        sequence length): a tuple for one input, a list in input order, or
        {input name: shape}, e.g. {"token_ids": (128,), "padding_mask": (128,)}.

    Raises:
      ValueError: the model is not built, is subclassed (no graph to read), or
        has unknown input dimensions and no `input_shapes` (naming the input).

    Example:
      >>> stats = tfdist.model_stats(gpt2, input_shapes={"token_ids": (128,),
      ...                                                "padding_mask": (128,)})
    """
    if not hasattr(model, "trainable_variables") or not hasattr(model, "layers"):
        raise ValueError(
            f"model must be a keras.Model. Received: {type(model).__name__}. For a model known "
            "only by its size use ModelStats.from_param_count(num_params)."
        )
    if not model.built or not model.variables:
        raise ValueError(
            f"Model {model.name!r} is not built (it has no variables yet). Build it first: "
            "give it a keras.Input(shape=...) or call model.build(input_shape)."
        )
    num_params, trainable_bytes = _variable_bytes(model.trainable_variables)
    if num_params == 0:
        raise ValueError(f"Model {model.name!r} has no trainable variables: nothing to train.")
    _, non_trainable_bytes = _variable_bytes(model.non_trainable_variables)
    from tfdist import flops
    from tfdist.compat import keras_graph
    from tfdist.split import graph as graph_lib

    if keras_graph.functional_of(model) is None:
        raise ValueError(
            f"Cannot analyse subclassed model {model.name!r} ({type(model).__name__}): its "
            "layers have no symbolic graph, so their outputs and FLOPs are unknown. Build the "
            "model functionally or as a Sequential with keras.Input(shape=...), or pass a "
            "parameter count (ModelStats.from_param_count / tfdist plan --params=...).")
    graph = graph_lib.flatten(model)
    costs = flops.trace_costs(graph, input_shapes)
    dtype_bytes = trainable_bytes // num_params
    per_layer: dict[str, list] = {name: [0, 0.0, None] for name in graph.layers}
    current = next(iter(graph.layers), None)
    for node, node_cost in zip(graph.nodes, costs):
        if node.layer is not None and node.first_call:
            current = node.layer
            per_layer[current][2] = node_cost.output_shapes[0] if node_cost.output_shapes \
                else ()
        if current is None:
            continue
        # a keras op (x + y) or a shared layer's later call counts for the layer before it
        per_layer[current][0] += node_cost.output_elements
        per_layer[current][1] += node_cost.flops
    seen: set[int] = set()
    layers = []
    for name, layer in graph.layers.items():
        own = [w for w in layer.trainable_weights if id(w) not in seen]
        seen.update(id(w) for w in layer.weights)
        elements, layer_flops, shape = per_layer[name]
        layers.append(LayerStats(
            name=name, class_name=type(layer).__name__, output_shape=tuple(shape or ()),
            num_params=_variable_bytes(own)[0], activation_elements=int(elements),
            forward_flops=float(layer_flops)))
    return ModelStats(
        num_params=num_params,
        trainable_bytes=trainable_bytes,
        non_trainable_bytes=non_trainable_bytes,
        activation_bytes_per_example=sum(l.activation_elements for l in layers) * dtype_bytes,
        forward_flops_per_example=sum(c.flops for c in costs),
        layers=tuple(layers),
    )


# --- memory -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes one replica (or one pipeline stage) needs."""

    parameters: int
    gradients: int
    optimizer: int
    non_trainable: int
    activations: int

    @property
    def state(self) -> int:
        """Everything but activations."""
        return self.parameters + self.gradients + self.optimizer + self.non_trainable

    @property
    def total(self) -> int:
        return self.state + self.activations

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


def replica_memory(stats: ModelStats, *, per_replica_batch_size: int,
                   optimizer: OptimizerState | str = "adam", state_shards: int = 1,
                   stages: int = 1) -> MemoryEstimate:
    """Memory of one replica: parameters, gradients, optimizer slots, activations.

    Args:
      stats: the model (`model_stats(model)` or `ModelStats.from_param_count`).
      per_replica_batch_size: examples each replica processes per step.
      optimizer: an `OptimizerState`, an optimizer name or a Keras optimizer.
      state_shards: divide gradients and optimizer slots over this many
        devices (ZeRO stage 2 style; 1 = plain data parallelism).
      stages: pipeline stages the model is split into (balanced); each device
        holds 1/stages of the state and of the activations.

    Raises:
      ValueError: non-positive batch, shards or stages.
    """
    _check_positive("per_replica_batch_size", per_replica_batch_size, integer=True)
    _check_positive("state_shards", state_shards, integer=True)
    _check_positive("stages", stages, integer=True)
    if not isinstance(optimizer, OptimizerState):
        optimizer = optimizer_state(optimizer)  # a name or a Keras optimizer
    slots = optimizer.slots_per_variable * stats.trainable_bytes
    return MemoryEstimate(
        parameters=math.ceil(stats.trainable_bytes / stages),
        gradients=math.ceil(stats.trainable_bytes / stages / state_shards),
        optimizer=math.ceil(slots / stages / state_shards) + optimizer.scalar_bytes,
        non_trainable=math.ceil(stats.non_trainable_bytes / stages),
        activations=math.ceil(stats.activation_bytes_per_example * per_replica_batch_size
                              / stages),
    )


def zero_bytes_per_param(num_devices: int, stage: Literal[0, 1, 2, 3] = 3) -> float:
    """Mixed-precision Adam bytes per parameter on each device under ZeRO.

    16 bytes per parameter unsharded (2 fp16 weights + 2 fp16 gradients + 4
    fp32 master weights + 4 + 4 Adam moments). Stage 1 shards the 12 bytes
    of optimizer state, stage 2 also the gradients, stage 3 everything:
    16 -> 16/N.
    """
    _check_positive("num_devices", num_devices, integer=True)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3. Received: stage={stage!r}")
    n = num_devices
    return {0: 16.0, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}[stage]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardedStateBytes:
    """Bytes one replica's device holds of the training state under ZeRO-style sharding.

    Attributes:
      parameters: the trainable weights it stores.
      gradients: the reduced gradients the optimizer update receives.
      optimizer: optimizer slots and scalars on the replica's device.
      offloaded: optimizer slots this replica keeps on the host instead
        (offload="optimizer"; 0 otherwise).
    """

    parameters: int
    gradients: int
    optimizer: int
    offloaded: int = 0

    @property
    def total(self) -> int:
        """On the replica's device (offloaded bytes are on the host)."""
        return self.parameters + self.gradients + self.optimizer


# Bytes each replica moves per step, relative to a ring all-reduce of its gradients, by ZeRO
# stage (docs/sharding.md): stage 1 all-reduces the whole gradient, then all-gathers the
# updated shards (1 + 1/2); stage 2 reduce-scatters instead (the same bytes as the
# all-reduce's two halves: 1); stage 3 also all-gathers each sharded weight in the forward
# and again in the backward pass, but reduce-scatters its gradients (1.5).
SHARDED_TRAFFIC = {0: 1.0, 1: 1.5, 2: 1.0, 3: 1.5}


def relative_traffic(*, stage: int = 0, compression: str = "none") -> float:
    """Gradient-exchange bytes per step relative to plain data parallelism's all-reduce.

    `stage`: ZeRO stage 0-3 (`SHARDED_TRAFFIC`); `compression`: none, fp16 or
    bf16 (the ratio of `COMPRESSED_BYTES_PER_NUMBER`; powersgd depends on the
    shapes: use `compressed_gradient_bytes`).
    """
    if stage not in SHARDED_TRAFFIC:
        raise ValueError(f"stage must be 0, 1, 2 or 3. Received: stage={stage!r}")
    if compression not in ("none", "fp16", "bf16"):
        raise ValueError("compression must be none, fp16 or bf16 (powersgd's bytes depend on "
                         "the shapes: use compressed_gradient_bytes). Received: "
                         f"compression={compression!r}")
    ratio = COMPRESSED_BYTES_PER_NUMBER[compression] / COMPRESSED_BYTES_PER_NUMBER["none"]
    return SHARDED_TRAFFIC[stage] * ratio


def sharded_state_bytes(variable_sizes: Sequence[int], *, stage: int, num_shards: int,
                        optimizer: OptimizerState | str = "adam", bytes_per_element: int = 4,
                        min_shard_bytes: int = 0, offload: bool = False) -> ShardedStateBytes:
    """Per-replica state under ZeRO stage `stage` (0 none, 1 optimizer, 2 gradients, 3 params).

    Each trainable variable of n elements is split when n * b >= min_shard_bytes
    into N shards of ceil(n / N) elements (zero-padded); smaller ones stay whole
    on every replica. With s = sum over split variables of ceil(n/N) * b,
    w = the same variables whole (sum of n * b), r = the variables kept whole,
    k = optimizer slots per variable:

      parameters = (s if stage >= 3 else w) + r
      gradients  = (s if stage >= 2 else w) + r
      optimizer  = k * ((s if stage >= 1 else w) + r) + scalars

    With offload, the k * s bytes of split slots live on the host (`offloaded`).
    fp32 Adam (k = 2, b = 4), everything split, N dividing every n: 16 bytes
    per parameter -> 8 + 8/N (stage 1), 4 + 12/N (stage 2), 16/N (stage 3).

    Args:
      variable_sizes: element counts of the trainable variables.
      stage: ZeRO stage, 0-3.
      num_shards: N, the replicas in sync.
      optimizer: an `OptimizerState` or an optimizer name.
      bytes_per_element: b (4 for fp32).
      min_shard_bytes: variables smaller than this stay whole.
      offload: slots of split variables on the host (needs stage >= 1).

    Raises:
      ValueError: a stage outside 0-3, non-positive shards, offload at stage 0.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3. Received: stage={stage!r}")
    _check_positive("num_shards", num_shards, integer=True)
    _check_positive("bytes_per_element", bytes_per_element, integer=True)
    _check_positive("min_shard_bytes", min_shard_bytes, integer=True, allow_zero=True)
    if offload and stage == 0:
        raise ValueError("offload keeps the optimizer's shards on the host: it needs stage >= 1. "
                         "Received: stage=0, offload=True.")
    if isinstance(optimizer, str):
        optimizer = optimizer_state(optimizer)
    b, n = bytes_per_element, num_shards
    split = [int(size) for size in variable_sizes if int(size) * b >= max(min_shard_bytes, 1)]
    kept = [int(size) for size in variable_sizes if int(size) * b < max(min_shard_bytes, 1)]
    s = sum(-(-size // n) for size in split) * b
    w = sum(split) * b
    r = sum(kept) * b
    k = optimizer.slots_per_variable
    slots_split = k * (s if stage >= 1 else w)
    return ShardedStateBytes(
        parameters=(s if stage >= 3 else w) + r,
        gradients=(s if stage >= 2 else w) + r,
        optimizer=(0 if offload else slots_split) + k * r + optimizer.scalar_bytes,
        offloaded=slots_split if offload else 0,
    )


# --- communication --------------------------------------------------------------------


def _check_k_n(gradient_bytes: float, num_replicas: int) -> None:
    _check_positive("gradient_bytes", gradient_bytes, allow_zero=True)
    _check_positive("num_replicas", num_replicas, integer=True)


def ring_allreduce_bytes_per_rank(gradient_bytes: float, num_replicas: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce: 2(N-1)/N * K."""
    _check_k_n(gradient_bytes, num_replicas)
    n = num_replicas
    return 2.0 * (n - 1) / n * gradient_bytes


def central_reducer_bytes(gradient_bytes: float, num_replicas: int) -> float:
    """Bytes through one reducer: N-1 gradients in, N-1 results out: 2(N-1) * K."""
    _check_k_n(gradient_bytes, num_replicas)
    return 2.0 * (num_replicas - 1) * gradient_bytes


def parameter_server_bytes(gradient_bytes: float, *, num_workers: int, num_ps: int) -> float:
    """Bytes through each parameter server per round of one step on every worker.

    Each worker pushes K gradient bytes and pulls K parameter bytes, spread
    evenly over the servers: 2 * W * K / P through each.
    """
    _check_positive("gradient_bytes", gradient_bytes, allow_zero=True)
    _check_positive("num_workers", num_workers, integer=True)
    _check_positive("num_ps", num_ps, integer=True)
    return 2.0 * num_workers * gradient_bytes / num_ps


def ring_allreduce_time(gradient_bytes: float, num_replicas: int, link: Link) -> float:
    """alpha-beta ring all-reduce: T = 2(N-1) a + 2(N-1)/N * K * b (0 for one replica)."""
    _check_k_n(gradient_bytes, num_replicas)
    n = num_replicas
    return 2 * (n - 1) * link.latency + ring_allreduce_bytes_per_rank(gradient_bytes, n) \
        * link.seconds_per_byte


def central_reducer_time(gradient_bytes: float, num_replicas: int, link: Link) -> float:
    """alpha-beta central reducer: T = 2(N-1)(a + K b): its link carries every message."""
    _check_k_n(gradient_bytes, num_replicas)
    return 2 * (num_replicas - 1) * link.latency + central_reducer_bytes(
        gradient_bytes, num_replicas) * link.seconds_per_byte


def parameter_server_time(gradient_bytes: float, *, num_workers: int, num_ps: int,
                          link: Link) -> float:
    """alpha-beta time for one step of every worker through the busiest server."""
    volume = parameter_server_bytes(gradient_bytes, num_workers=num_workers, num_ps=num_ps)
    return 2 * num_workers * link.latency + volume * link.seconds_per_byte


def fit_alpha_beta(points: Sequence[tuple[float, float]], num_replicas: int, *,
                   relative: bool = True) -> Link:
    """Calibrates a ring all-reduce link from measured (bytes, seconds) points.

    Least squares for T = 2(N-1) a + 2(N-1)/N * K * b with a, b >= 0. With
    `relative` (default) each point's residual is divided by its measured
    time, so small and large messages count alike (the model is judged by
    relative error); otherwise large messages dominate.

    Raises:
      ValueError: fewer than two distinct sizes, a non-positive time, or a
        fit with no positive bandwidth.
    """
    _check_positive("num_replicas", num_replicas, integer=True)
    if num_replicas < 2:
        raise ValueError(
            f"An all-reduce needs >= 2 replicas. Received: num_replicas={num_replicas}")
    pts = [(float(k), float(t)) for k, t in points]
    if len({k for k, _ in pts}) < 2:
        raise ValueError(
            "fit_alpha_beta needs measurements at two or more message sizes. "
            f"Received: {len(pts)} point(s) at sizes {sorted({k for k, _ in pts})}"
        )
    if any(t <= 0 for _, t in pts):
        raise ValueError(f"Measured times must be > 0. Received: {pts}")
    n = num_replicas
    xs = [2 * (n - 1) / n * k for k, _ in pts]  # bytes per rank
    ts = [t for _, t in pts]
    ws = [1 / t**2 if relative else 1.0 for t in ts]

    def solve(with_intercept: bool) -> tuple[float, float]:
        sw = sum(ws)
        swx = sum(w * x for w, x in zip(ws, xs))
        swt = sum(w * t for w, t in zip(ws, ts))
        swxx = sum(w * x * x for w, x in zip(ws, xs))
        swxt = sum(w * x * t for w, x, t in zip(ws, xs, ts))
        if not with_intercept:
            return 0.0, swxt / swxx
        det = sw * swxx - swx * swx
        return (swxx * swt - swx * swxt) / det, (sw * swxt - swx * swt) / det

    intercept, beta = solve(True)
    if intercept < 0:  # refit through the origin: latency 0
        intercept, beta = solve(False)
    if beta <= 0:
        raise ValueError(
            "The measurements do not grow with message size, so no bandwidth can be fitted "
            f"(slope {beta:.3g} s/byte). Measure larger messages."
        )
    return Link(bandwidth=1.0 / beta, latency=intercept / (2 * (n - 1)))


# --- pipelines --------------------------------------------------------------------------


def _check_pipeline(stages: int, micro_batches: int) -> None:
    _check_positive("stages", stages, integer=True)
    _check_positive("micro_batches", micro_batches, integer=True)


def pipeline_bubble(*, stages: int, micro_batches: int) -> float:
    """Idle fraction of a synchronous (GPipe) pipeline: (S-1)/(M+S-1)."""
    _check_pipeline(stages, micro_batches)
    return (stages - 1) / (micro_batches + stages - 1)


def pipeline_speedup(*, stages: int, micro_batches: int) -> float:
    """Ideal speed-up of S balanced stages over one device: S*M/(M+S-1)."""
    _check_pipeline(stages, micro_batches)
    return stages * micro_batches / (micro_batches + stages - 1)


def micro_batches_for_bubble(stages: int, max_bubble: float) -> int:
    """Fewest micro-batches M with (S-1)/(M+S-1) <= max_bubble."""
    _check_positive("stages", stages, integer=True)
    if not 0 < max_bubble < 1:
        raise ValueError(f"max_bubble must be in (0, 1). Received: max_bubble={max_bubble!r}")
    if stages == 1:
        return 1
    return max(1, math.ceil((stages - 1) * (1 - max_bubble) / max_bubble - 1e-9))


# --- gradient compression (tfdist.comm) ---------------------------------------------------
# The bytes each method puts into the all-reduces,
# and the alpha-beta time of those all-reduces.

COMPRESSED_BYTES_PER_NUMBER = {"none": 4, "fp16": 2, "bf16": 2, "powersgd": 4}


def compressed_gradient_bytes(shapes: Sequence[Sequence[int]], *, compression: str = "none",
                              rank: int = 4) -> int:
    """Bytes one replica contributes to the all-reduces per step (float32 gradients).

    none: every gradient (4 bytes a number); fp16/bf16: 2 bytes a number;
    powersgd: (n + m) * rank numbers for each weight matrix it compresses
    (`tfdist.comm.powersgd.compresses`), the others whole.
    """
    from tfdist.comm import powersgd

    if compression not in COMPRESSED_BYTES_PER_NUMBER:
        raise ValueError(f"compression must be one of {', '.join(COMPRESSED_BYTES_PER_NUMBER)}. "
                         f"Received: compression={compression!r}")
    per_number = COMPRESSED_BYTES_PER_NUMBER[compression]
    if compression != "powersgd":
        return per_number * sum(math.prod(int(d) for d in s) for s in shapes)
    return per_number * sum(powersgd.wire_numbers(s, rank) for s in shapes)


def compressed_allreduce_time(shapes: Sequence[Sequence[int]], num_replicas: int, link: Link,
                              *, compression: str = "none", rank: int = 4) -> float:
    """alpha-beta time of one step's gradient exchange with `compression`.

    One ring all-reduce of the compressed bytes; PowerSGD runs two rounds
    (P with the uncompressed gradients, then Q), so pays the latency twice.
    """
    from tfdist.comm import powersgd

    total = compressed_gradient_bytes(shapes, compression=compression, rank=rank)
    rounds = 2 if compression == "powersgd" and any(
        powersgd.compresses(s, rank) for s in shapes) else 1
    if num_replicas < 2:
        return 0.0
    return (rounds - 1) * 2 * (num_replicas - 1) * link.latency + ring_allreduce_time(
        total, num_replicas, link)
