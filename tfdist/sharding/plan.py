"""The sharding configuration of one strategy: stage, replicas and their ranks, host device.

`attach` (called by `tfdist.make_strategy` for `shard != "none"`) builds a
`ShardingPlan`, checks the machine can run it (collectives, a host device to
offload to), and registers it for the strategy; everything else in
tfdist.sharding looks the plan up with `plan_of(strategy)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfdist import state as state_lib
from tfdist.sharding import layout as layout_lib

STAGES = {"none": 0, "optimizer": 1, "gradients": 2, "parameters": 3}


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """How one strategy shards its training state.

    Attributes:
      shard: "optimizer", "gradients" or "parameters".
      offload: True to keep optimizer state (and run its update) on `host_device`.
      min_bytes: variables smaller than this stay replicated.
      num_replicas: N, replicas in sync (over every worker).
      local_devices: this process's replica devices, in replica order.
      ranks: each local replica's rank (which shard it owns), in replica order.
      host_device: this process's CPU (where offloaded state lives).
      remat: stage 3: layers owning sharded weights run under keras.remat
        (gathered weights dropped after the forward pass, gathered again in
        the backward pass); False keeps them until the backward pass.
    """

    shard: str
    offload: bool
    min_bytes: int
    num_replicas: int
    local_devices: tuple[str, ...]
    ranks: tuple[int, ...]
    host_device: str
    remat: bool = True

    @property
    def stage(self) -> int:
        """ZeRO stage: 1 optimizer state, 2 + gradients, 3 + parameters."""
        return STAGES[self.shard]

    @property
    def all_local(self) -> bool:
        """True when this process holds every shard (one worker)."""
        return len(self.local_devices) == self.num_replicas

    def shards(self, shape, dtype_bytes: int) -> bool:
        """True if a variable of this shape is split over the replicas."""
        return layout_lib.is_sharded(tuple(int(d) for d in shape), dtype_bytes,
                                     min_bytes=self.min_bytes)

    def layout(self, shape) -> layout_lib.ShardLayout:
        return layout_lib.ShardLayout(tuple(int(d) for d in shape), self.num_replicas)

    def state_device(self, replica: int) -> str:
        """Where local replica `replica`'s optimizer-state shard lives."""
        return self.host_device if self.offload else self.local_devices[replica]


def plan_of(strategy: Any) -> ShardingPlan | None:
    """The sharding plan of `strategy`, or None if it does not shard."""
    state = state_lib.state_of(strategy)
    return None if state is None else state.sharding_plan


def register(strategy: Any, plan: ShardingPlan) -> None:
    """Records `plan` on `strategy` (one tfdist made)."""
    state_lib.state_of(strategy).sharding_plan = plan


def host_device_for(local_devices: tuple[str, ...]) -> str:
    """This process's CPU:0 in the replicas' job and task (what ZeRO-Offload offloads to)."""
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    spec = tf.DeviceSpec.from_string(local_devices[0])
    return spec.replace(device_type="CPU", device_index=0).to_string()


def check_offload(local_devices: tuple[str, ...], host: str) -> None:
    """Raises ValueError if the host CPU is itself a replica (nothing to offload to)."""
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    host_spec = tf.DeviceSpec.from_string(host)
    for device in local_devices:
        if tf.DeviceSpec.from_string(device).to_string() == host_spec.to_string():
            raise ValueError(
                "offload='optimizer' moves the optimizer state off the replicas' devices to "
                f"the host CPU ({host}), but that CPU is itself a replica. Received: replicas "
                f"on {', '.join(local_devices)}. Expected: replicas on accelerators (GPUs), or "
                "logical CPUs other than CPU:0 standing in for them, e.g. "
                "--logical_devices=3 --devices=/cpu:1,/cpu:2. Fix: run the replicas there, or "
                "drop offload.")
