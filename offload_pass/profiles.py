"""Device profiles: the rates the cost model prices a graph with.

Built-in profiles are chosen from the CUDA device name. The H200's copy bandwidths were
measured on the hardware (pinned buffers of 256 MiB), and its matrix rate is that of one
large product (bf16, 8192^3: 790 to 805 TFLOP/s). Planned on the device present, matrix
products, convolutions and attention are timed there instead (timing.py); the rates price
them only when a chunk is planned for another device. The H100 and A100 figures are
conservative shares of the vendor figures. ``calibrate`` measures the device actually
present.

The host costs are those of the H200 machine's host (``python -m benchmarks.op_overhead
--device cuda``, docs/gpu-validation.md, run 38): they depend on the host CPU and on
Python, not on the GPU, so the other CUDA profiles share them.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class HostScale:
    """How many times as long as a profile prices it the host took to issue a chunk's
    forward, and its backward, measured on its first steps (:mod:`offload_pass.host_clock`)."""

    forward: float = 1.0
    backward: float = 1.0

    def __post_init__(self) -> None:
        for phase in ("forward", "backward"):
            value = getattr(self, phase)
            if not (isinstance(value, float | int) and value > 0):
                raise ValueError(f"HostScale.{phase} must be a positive number, got {value!r}")

    def __str__(self) -> str:
        return f"{self.forward:.2f}x in forward, {self.backward:.2f}x in backward"


UNMEASURED = HostScale()
"""The profile's own host prices."""


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Sustained rates of one device. Bandwidths in bytes/s, rates in FLOP/s.

    ``copies_overlap_compute`` is False where copies run on the compute thread (CPU):
    every copy then adds its whole duration to the step. ``both_directions`` (both
    copies at once, in total) is reported, not planned with: within one step a chunk's
    offloads run in forward and its reloads in backward, never at once.

    Host costs, in seconds: what the host spends issuing one kernel of compiled code
    (``kernel_launch_seconds``), an offload with its wait moving one storage
    (``offload_host_seconds``), a reload with its wait moving one
    (``reload_host_seconds``), and what each further storage adds to one such pair of ops
    (``bucketed_offload_host_seconds``, ``bucketed_reload_host_seconds``). A kernel cannot
    start before the host has issued it, so where kernels are short the step is the
    host's, and every transfer op lengthens it. Zero where the host is the device (CPU):
    there, the host's time is the compute time already. ``backward_host_scale``: what
    each host cost takes in backward over what it takes in forward (backward's autograd
    engine accumulates each parameter's gradient beside the compiled code); 1 until a
    host is measured (:meth:`with_host_measured`).

    ``kernel_floor_seconds``: the least time the device takes for one kernel when
    kernels run back to back, however little each one computes (launching its grid and
    draining it): a step of many small kernels (a mixture of experts' routing, a ViT's
    normalizations) takes that long per kernel, not its traffic over the bandwidth.
    """

    name: str
    matmul_flops: float
    fp32_flops: float
    memory_bandwidth: float
    device_to_host: float
    host_to_device: float
    both_directions: float
    copies_overlap_compute: bool = True
    kernel_launch_seconds: float = 0.0
    offload_host_seconds: float = 0.0
    reload_host_seconds: float = 0.0
    bucketed_offload_host_seconds: float = 0.0
    bucketed_reload_host_seconds: float = 0.0
    backward_host_scale: float = 1.0
    kernel_floor_seconds: float = 0.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _HOST_COSTS or field.name == "kernel_floor_seconds":
                if not (isinstance(value, float | int) and value >= 0):
                    raise ValueError(
                        f"DeviceProfile.{field.name} must be a number of seconds >= 0, "
                        f"got {value!r}"
                    )
            elif isinstance(value, float) and not value > 0:
                raise ValueError(f"DeviceProfile.{field.name} must be positive, got {value!r}")

    def under_cuda_graphs(self) -> DeviceProfile:
        """The rates of a graph that holds transfers as Inductor captures it in CUDA graphs
        (``mode="reduce-overhead"``): it runs the transfers after the compute that does not
        read them, so copies overlap no compute, and it replays the kernels between them
        from captured graphs, so the host issues none of them one by one. A profile already
        so is returned as it is."""
        if not self.copies_overlap_compute and self.kernel_launch_seconds == 0:
            return self
        return dataclasses.replace(
            self,
            name=f"{self.name} under CUDA graphs",
            copies_overlap_compute=False,
            kernel_launch_seconds=0.0,
        )

    def with_host_measured(self, scale: HostScale) -> DeviceProfile:
        """The same device on a host that takes ``scale`` times as long to issue work as
        this profile prices it."""
        host = {name: getattr(self, name) * scale.forward for name in _HOST_COSTS}
        return dataclasses.replace(
            self,
            name=f"{self.name}, host measured at {scale}",
            backward_host_scale=self.backward_host_scale * scale.backward / scale.forward,
            **host,
        )

    @property
    def backward_launch_seconds(self) -> float:
        """What the host takes to issue one kernel in backward."""
        return self.kernel_launch_seconds * self.backward_host_scale

    def matrix_rate(self, dtype: torch.dtype) -> float:
        return self.fp32_flops if dtype in (torch.float32, torch.float64) else self.matmul_flops


_HOST_COSTS = frozenset(
    {
        "kernel_launch_seconds",
        "offload_host_seconds",
        "reload_host_seconds",
        "bucketed_offload_host_seconds",
        "bucketed_reload_host_seconds",
    }
)

GB = 1e9
TFLOPS = 1e12
US = 1e-6
CUDA_HOST = {
    "kernel_launch_seconds": 43.8 * US,
    "offload_host_seconds": 144.3 * US,
    "reload_host_seconds": 134.5 * US,
    "bucketed_offload_host_seconds": 22.9 * US,
    "bucketed_reload_host_seconds": 21.6 * US,
}
"""Measured on the H200 machine's host (``python -m benchmarks.op_overhead --device
cuda``): a kernel launch inside a compiled step, as the cost model counts launches (a
stack twice as deep against the same stack: run 49's 4.91 ms more over the 112 more
launches counted now; the step's buffer allocations, wrappers and autograd engine spread
over its launches, about 3 times one kernel's cost in a bare chain); an offload with its wait
and a reload with its wait, each moving one storage; what a further storage adds to
each (run 38). Hosts differ: runs 31 to 38 measured one offload pair at 94 to 165 us."""

H100_KERNEL_FLOOR = 2.1 * US
H200_KERNEL_FLOOR = 1.74 * US
"""Each device's time per kernel in a chain of one-element in-place adds, queued behind a
spin so that the host is not what the device waits on, as
``calibration.kernel_floor_seconds`` measures it (docs/gpu-validation.md): an H100's
2.12 to 2.16 us for 1 to 1,024 elements (run 188; 2.32 for 262,144 and 5.15 for
4,194,304, where the traffic's time takes over), an H200's 1.74 (run 189). The A100's is
not measured and taken as the H100's; ``calibrate`` measures the device present."""

BUILT_IN: dict[str, DeviceProfile] = {
    "h200": DeviceProfile(
        "h200",
        790 * TFLOPS,
        50 * TFLOPS,
        4000 * GB,
        54.6 * GB,
        55.3 * GB,
        96.3 * GB,
        **CUDA_HOST,
        kernel_floor_seconds=H200_KERNEL_FLOOR,
    ),
    "h100": DeviceProfile(
        "h100",
        650 * TFLOPS,
        45 * TFLOPS,
        2800 * GB,
        50 * GB,
        50 * GB,
        90 * GB,
        **CUDA_HOST,
        kernel_floor_seconds=H100_KERNEL_FLOOR,
    ),
    "a100": DeviceProfile(
        "a100",
        250 * TFLOPS,
        17 * TFLOPS,
        1600 * GB,
        24 * GB,
        24 * GB,
        40 * GB,
        **CUDA_HOST,
        kernel_floor_seconds=H100_KERNEL_FLOOR,
    ),
    "cpu": DeviceProfile(
        "cpu", 0.2 * TFLOPS, 0.1 * TFLOPS, 20 * GB, 10 * GB, 10 * GB, 10 * GB, False
    ),
}


def built_in_for_name(device_name: str) -> DeviceProfile | None:
    """The built-in profile whose key appears in a CUDA device name, if any."""
    lowered = device_name.lower()
    for key, profile in BUILT_IN.items():
        if key != "cpu" and key in lowered:
            return profile
    return None


CALIBRATE = "calibrate"


def check_profile_spec(spec: object) -> DeviceProfile | str | None:
    if spec is None or isinstance(spec, DeviceProfile):
        return spec
    if spec == CALIBRATE and not torch.cuda.is_available():
        raise ValueError("profile='calibrate' measures a CUDA device, and none is available")
    if spec == CALIBRATE or spec in BUILT_IN:
        return spec  # type: ignore[return-value]
    choices = ", ".join(repr(k) for k in (*BUILT_IN, CALIBRATE))
    raise ValueError(f"profile must be a DeviceProfile or one of {choices}, got {spec!r}")
