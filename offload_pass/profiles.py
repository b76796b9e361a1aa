"""Device profiles: the rates the cost model prices a graph with.

Built-in profiles are chosen from the CUDA device name. The H200's copy bandwidths were
measured on the hardware (pinned buffers of 256 MiB), and its matrix rate is that of one
large product (bf16, 8192^3: 790 to 805 TFLOP/s). Planned on the device present, matrix
products, convolutions and attention are timed there instead (timing.py); the rates price them only
when a chunk is planned for another device. The H100 and A100 figures are conservative
shares of the vendor figures. ``calibrate`` measures the device actually present.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Sustained rates of one device. Bandwidths in bytes/s, rates in FLOP/s.

    ``copies_overlap_compute`` is False where copies run on the compute thread (CPU):
    every copy then adds its whole duration to the step. ``both_directions`` (both
    copies at once, in total) is reported, not planned with: within one step a chunk's
    offloads run in forward and its reloads in backward, never at once.
    """

    name: str
    matmul_flops: float
    fp32_flops: float
    memory_bandwidth: float
    device_to_host: float
    host_to_device: float
    both_directions: float
    copies_overlap_compute: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float) and not value > 0:
                raise ValueError(f"DeviceProfile.{field.name} must be positive, got {value!r}")

    def matrix_rate(self, dtype: torch.dtype) -> float:
        return self.fp32_flops if dtype in (torch.float32, torch.float64) else self.matmul_flops


GB = 1e9
TFLOPS = 1e12

BUILT_IN: dict[str, DeviceProfile] = {
    "h200": DeviceProfile(
        "h200", 790 * TFLOPS, 50 * TFLOPS, 4000 * GB, 54.6 * GB, 55.3 * GB, 96.3 * GB
    ),
    "h100": DeviceProfile("h100", 650 * TFLOPS, 45 * TFLOPS, 2800 * GB, 50 * GB, 50 * GB, 90 * GB),
    "a100": DeviceProfile("a100", 250 * TFLOPS, 17 * TFLOPS, 1600 * GB, 24 * GB, 24 * GB, 40 * GB),
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
