"""Hardware the cost model plans for: links, devices, machines, groups of machines.

    link = Link(bandwidth=parse_bandwidth("25Gbps"), latency=10e-6)
    machine = Machine(device=Device(kind="GPU", memory=80e9), num_devices=8, link=link)
    cluster = HardwareCluster(machine=machine, num_machines=4, network=link)

All frozen and validated at construction (the alpha-beta model: a link is a
latency per message and a bandwidth). `HardwareCluster` is named apart from
`tfdist.Cluster`, the TF_CONFIG cluster spec. No TensorFlow.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from tfdist.planning.units import check_positive


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
        check_positive("bandwidth", self.bandwidth)
        check_positive("latency", self.latency, allow_zero=True)

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
        check_positive("memory", self.memory)
        if self.peak_flops is not None:
            check_positive("peak_flops", self.peak_flops)


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
                f"device must be a tfdist.planning.Device. Received: device={self.device!r}")
        check_positive("num_devices", self.num_devices, integer=True)
        if not isinstance(self.link, Link):
            raise ValueError(f"link must be a tfdist.planning.Link. Received: link={self.link!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareCluster:
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
                f"machine must be a tfdist.planning.Machine. Received: machine={self.machine!r}")
        check_positive("num_machines", self.num_machines, integer=True)
        if self.num_machines > 1 and self.network is None:
            raise ValueError(
                f"A cluster of {self.num_machines} machines needs the network between them: "
                "pass network=Link(bandwidth=..., latency=...) (CLI: --network_bandwidth=25Gbps "
                "--network_latency=10us). Received: network=None"
            )
        if self.network is not None and not isinstance(self.network, Link):
            raise ValueError(
                f"network must be a tfdist.planning.Link. Received: network={self.network!r}")

    @property
    def num_devices(self) -> int:
        return self.num_machines * self.machine.num_devices

    @property
    def slowest_link(self) -> Link:
        """The link a ring over all devices is limited by."""
        if self.num_machines == 1:
            return self.machine.link
        return self.network  # type: ignore[return-value]


def as_cluster(hardware: Machine | HardwareCluster) -> HardwareCluster:
    """A Machine is a one-machine Cluster."""
    if isinstance(hardware, HardwareCluster):
        return hardware
    if isinstance(hardware, Machine):
        return HardwareCluster(machine=hardware)
    raise ValueError(
        "machine must be a tfdist.planning.Machine or tfdist.planning.HardwareCluster. "
        f"Received: {type(hardware).__name__} {hardware!r}"
    )
