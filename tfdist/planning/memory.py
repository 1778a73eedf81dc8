"""Memory one replica (or one pipeline stage) needs, plain and under ZeRO-style sharding.

- optimizer state: slots per variable (SGD 0, momentum 1, Adam/AdamW 2, ...)
  and scalars, by name or read from a Keras optimizer;
- `replica_memory`: parameters + gradients + optimizer slots + non-trainable
  state + activations (the layers' output sizes x the per-replica batch),
  divided by pipeline stages and state shards;
- `exchange_bytes`: the gradient bytes a replica's exchange holds at its peak
  beside the reduced gradients, the way TensorFlow's all-reduce and
  tfdist.sharding's reduce-scatter allocate them;
- `zero_bytes_per_param`: mixed-precision Adam, 16 bytes per parameter
  (2 fp16 weights + 2 fp16 grads + 12 fp32 master/m/v) -> 16/N at stage 3;
- `sharded_state_bytes`: tfdist's own sharding (tfdist.sharding), variable by
  variable; tfdist.sharding.memory measures what it predicts.

No TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Sequence

from tfdist.planning.stats import ModelStats
from tfdist.planning.units import check_positive

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
        check_positive("slots_per_variable", self.slots_per_variable, integer=True,
                        allow_zero=True)
        check_positive("scalar_bytes", self.scalar_bytes, integer=True, allow_zero=True)


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


# --- memory ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes one replica (or one pipeline stage) needs.

    Attributes:
      parameters, gradients, optimizer, non_trainable, activations: the state
        and the layers' outputs (`gradients`: the reduced gradients the update
        receives).
      exchange: gradient bytes the exchange holds at the step's peak beside
        `gradients` (`exchange_bytes`; 0 where nothing is exchanged).
    """

    parameters: int
    gradients: int
    optimizer: int
    non_trainable: int
    activations: int
    exchange: int = 0

    @property
    def state(self) -> int:
        """Everything but activations and the exchange's buffers."""
        return self.parameters + self.gradients + self.optimizer + self.non_trainable

    @property
    def total(self) -> int:
        return self.state + self.activations + self.exchange

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
    check_positive("per_replica_batch_size", per_replica_batch_size, integer=True)
    check_positive("state_shards", state_shards, integer=True)
    check_positive("stages", stages, integer=True)
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


def exchange_bytes(gradient_bytes: int, *, num_replicas: int, stage: int = 0) -> int:
    """Gradient bytes a replica's exchange holds at its peak, beside the reduced gradients.

    With W = `gradient_bytes` (every trainable variable's gradient) and N =
    `num_replicas`:

    - stage 0 (and 1, which all-reduces the whole gradients too): TensorFlow's
      collective all-reduce concatenates the local gradients into one pack and
      splits the reduced pack back: the local gradients beside their pack, or
      the reduced pack beside its pieces: W;
    - stage 2 (`tfdist.sharding`): the local gradients are packed into one
      tensor of N blocks (a copy) and reduce-scattered by an all-to-all whose
      receive buffer holds N blocks of W/N before they are summed into the
      replica's W/N shard: the local gradients beside their packed copy, or the
      packed copy beside the receive buffer: 2W;
    - stage 3: each layer's gradient is reduce-scattered in the backward pass
      as it is produced (the replica keeps its shard): 0.

    One replica exchanges nothing: 0.

    Raises:
      ValueError: a stage outside 0-3, negative bytes or non-positive replicas.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3. Received: stage={stage!r}")
    check_positive("gradient_bytes", gradient_bytes, integer=True, allow_zero=True)
    check_positive("num_replicas", num_replicas, integer=True)
    if num_replicas == 1:
        return 0
    return {0: 1, 1: 1, 2: 2, 3: 0}[stage] * gradient_bytes


def zero_bytes_per_param(num_devices: int, stage: Literal[0, 1, 2, 3] = 3) -> float:
    """Mixed-precision Adam bytes per parameter on each device under ZeRO.

    16 bytes per parameter unsharded (2 fp16 weights + 2 fp16 gradients + 4
    fp32 master weights + 4 + 4 Adam moments). Stage 1 shards the 12 bytes
    of optimizer state, stage 2 also the gradients, stage 3 everything:
    16 -> 16/N.
    """
    check_positive("num_devices", num_devices, integer=True)
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
    check_positive("num_shards", num_shards, integer=True)
    check_positive("bytes_per_element", bytes_per_element, integer=True)
    check_positive("min_shard_bytes", min_shard_bytes, integer=True, allow_zero=True)
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
