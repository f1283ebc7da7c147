"""Section 8 of the CS336 2026 handout ("Analyzing parallelism strategies") as arithmetic: one SwiGLU feed-forward
layer laid out over devices by data parallelism (DP), FSDP, tensor parallelism (TP) and FSDP x TP; each device's
matmul FLOPs, the bytes it sends, and how many devices a layout takes before communication outlasts the math.

`SwiGLULayer(B, D, F)` and `Accelerator(C, W)` (matmul FLOP/s, egress bytes/s) are the inputs; `dp_step`,
`fsdp_step`, `tp_step` and `fsdp_tp_step` give a layout's `StepCost` (each pass's FLOPs and ring collectives), and
`largest_dp_devices`, `largest_fsdp_devices`, `largest_tp_devices` and `largest_fsdp_tp_grid` the most devices
before a pass is communication-bound. docs/design-notes.md has the derivation (handout eqs. 20-59).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

# Bytes each device sends in a ring collective over n devices, per byte of the whole tensor.
_SENT_PER_BYTE = {
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "alternate-all-reduce": lambda n: n - 1,
}
RING_COLLECTIVES = tuple(_SENT_PER_BYTE)


def _check_count(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


def _check_rate(name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be positive and finite, got {value}")


@dataclass(frozen=True)
class SwiGLULayer:
    """One SwiGLU feed-forward layer and its input: B rows (tokens) of width D, hidden width F, b bytes an element."""

    batch: int  # B
    d_model: int  # D
    d_ff: int  # F
    bytes_per_element: int = 2  # b: the handout's FP16 weights, activations and gradients

    def __post_init__(self):
        for name in ("batch", "d_model", "d_ff", "bytes_per_element"):
            _check_count(name, getattr(self, name))

    @property
    def weight_bytes(self) -> int:
        """One of W1, W2, W3: D x F elements."""
        return self.bytes_per_element * self.d_model * self.d_ff


@dataclass(frozen=True)
class Accelerator:
    """A device: C, its matmul FLOP/s, and W, the bytes/s it sends (measured, or a datasheet's)."""

    flops_per_s: float  # C
    egress_bandwidth: float  # W

    def __post_init__(self):
        _check_rate("flops_per_s", self.flops_per_s)
        _check_rate("egress_bandwidth", self.egress_bandwidth)


@dataclass(frozen=True)
class Collective:
    """A ring collective over `devices` devices of a tensor of `nbytes` (S: the whole tensor)."""

    kind: str
    nbytes: float
    devices: int

    def __post_init__(self):
        if self.kind not in _SENT_PER_BYTE:
            raise ValueError(f"unknown collective {self.kind!r}; choose from {', '.join(RING_COLLECTIVES)}")
        _check_count("devices", self.devices)
        if not self.nbytes >= 0:
            raise ValueError(f"nbytes must be zero or more, got {self.nbytes}")

    @property
    def bytes_sent(self) -> float:
        """What each device sends."""
        return _SENT_PER_BYTE[self.kind](self.devices) * self.nbytes

    def seconds(self, device: Accelerator) -> float:
        return self.bytes_sent / device.egress_bandwidth


@dataclass(frozen=True)
class PassCost:
    """A forward or backward pass on one device: its matmul FLOPs and its collectives, by axis of the layout."""

    flops: float
    collectives: Mapping[str, tuple[Collective, ...]]  # "dp", "fsdp" or "tp" -> those on that axis, in order

    @property
    def bytes_sent(self) -> float:
        return sum(c.bytes_sent for axis in self.collectives.values() for c in axis)

    def compute_seconds(self, device: Accelerator) -> float:
        return self.flops / device.flops_per_s

    def axis_seconds(self, device: Accelerator) -> dict[str, float]:
        """Each axis's collectives one after another."""
        return {name: sum(c.seconds(device) for c in axis) for name, axis in self.collectives.items()}

    def comm_seconds(self, device: Accelerator, overlap_axes: bool = False) -> float:
        """The axes' times added up, or with `overlap_axes` the longest (each axis on its own links)."""
        times = self.axis_seconds(device).values()
        return max(times, default=0.0) if overlap_axes else sum(times)

    def communication_bound(self, device: Accelerator, overlap_axes: bool = False) -> bool:
        """The collectives take longer than the math, so they cannot all hide behind it."""
        return self.comm_seconds(device, overlap_axes) > self.compute_seconds(device)


@dataclass(frozen=True)
class StepCost:
    forward: PassCost
    backward: PassCost


def _flops(layer: SwiGLULayer, devices: int) -> tuple[float, float]:
    """Forward (three matmuls of 2BDF) and backward (six) FLOPs, split evenly over the devices."""
    matmul = 2 * layer.batch * layer.d_model * layer.d_ff
    return 3 * matmul / devices, 6 * matmul / devices


def dp_step(layer: SwiGLULayer, devices: int) -> StepCost:
    """Data parallel: the backward all-reduces the three weight gradients."""
    _check_count("devices", devices)
    forward, backward = _flops(layer, devices)
    gradients = tuple(Collective("all-reduce", layer.weight_bytes, devices) for _ in range(3))
    return StepCost(PassCost(forward, {}), PassCost(backward, {"dp": gradients}))


def fsdp_step(layer: SwiGLULayer, devices: int) -> StepCost:
    """FSDP: each pass all-gathers the three weights; the backward reduce-scatters their gradients too."""
    _check_count("devices", devices)
    forward, backward = _flops(layer, devices)
    gathers = tuple(Collective("all-gather", layer.weight_bytes, devices) for _ in range(3))
    scatters = tuple(Collective("reduce-scatter", layer.weight_bytes, devices) for _ in range(3))
    return StepCost(PassCost(forward, {"fsdp": gathers}), PassCost(backward, {"fsdp": gathers + scatters}))


def tp_step(layer: SwiGLULayer, devices: int) -> StepCost:
    """Tensor parallel, W1 and W2 by columns and W3 by rows: the forward all-reduces y's partial sums, the
    backward dx's; each (B, D)."""
    _check_count("devices", devices)
    forward, backward = _flops(layer, devices)
    rows = (Collective("all-reduce", layer.bytes_per_element * layer.batch * layer.d_model, devices),)
    return StepCost(PassCost(forward, {"tp": rows}), PassCost(backward, {"tp": rows}))


def fsdp_tp_step(layer: SwiGLULayer, fsdp: int, tp: int) -> StepCost:
    """FSDP x TP on an fsdp x tp grid: weights gathered over the FSDP axis, activations all-reduced over TP's."""
    _check_count("fsdp", fsdp)
    _check_count("tp", tp)
    forward, backward = _flops(layer, fsdp * tp)
    # A TP rank's slice of a weight, F/tp of F, gathered from its FSDP axis.
    gathers = tuple(Collective("all-gather", layer.weight_bytes / tp, fsdp) for _ in range(3))
    scatters = tuple(Collective("reduce-scatter", layer.weight_bytes / tp, fsdp) for _ in range(3))
    # y (forward) or dx (backward) of an FSDP rank's B/fsdp rows, summed over the TP axis.
    rows = (Collective("all-reduce", layer.bytes_per_element * layer.batch / fsdp * layer.d_model, tp),)
    return StepCost(PassCost(forward, {"fsdp": gathers, "tp": rows}),
                    PassCost(backward, {"fsdp": gathers + scatters, "tp": rows}))


@dataclass(frozen=True)
class DeviceBound:
    """The most devices a layout takes before a pass is communication-bound: N <= these (inf: no limit)."""

    forward: float
    backward: float

    @property
    def step(self) -> float:
        return min(self.forward, self.backward)


def _ratio(layer: SwiGLULayer, device: Accelerator) -> float:
    """W/(bC): the elements a device sends in the time of one FLOP; every bound grows with it."""
    return device.egress_bandwidth / (layer.bytes_per_element * device.flops_per_s)


def largest_dp_devices(layer: SwiGLULayer, device: Accelerator) -> DeviceBound:
    """N <= 1 + 2BW/(bC) for the backward; the forward communicates nothing."""
    return DeviceBound(forward=math.inf, backward=1 + 2 * layer.batch * _ratio(layer, device))


def largest_fsdp_devices(layer: SwiGLULayer, device: Accelerator) -> DeviceBound:
    """N <= 1 + 2BW/(bC) in both passes: the backward sends twice the forward's bytes over twice its math."""
    bound = 1 + 2 * layer.batch * _ratio(layer, device)
    return DeviceBound(forward=bound, backward=bound)


def largest_tp_devices(layer: SwiGLULayer, device: Accelerator) -> DeviceBound:
    """N <= 1 + 3FW/(bC) forward, 1 + 6FW/(bC) backward: B cancels out."""
    return DeviceBound(forward=1 + 3 * layer.d_ff * _ratio(layer, device),
                       backward=1 + 6 * layer.d_ff * _ratio(layer, device))


def smallest_batch_per_device(device: Accelerator, devices: int, bytes_per_element: int = 2) -> float:
    """DP and FSDP: the fewest rows per device, B/N, at which N devices' communication still hides behind the
    math, bC/(2W) (N-1)/N (bC/(2W), C/W for FP16, as N grows)."""
    _check_count("devices", devices)
    _check_count("bytes_per_element", bytes_per_element)
    return bytes_per_element * device.flops_per_s / (2 * device.egress_bandwidth) * (devices - 1) / devices


@dataclass(frozen=True)
class FSDPTPGrid:
    """An FSDP x TP grid, its axes as real numbers: the bound a grid of whole numbers stays within."""

    fsdp: float
    tp: float

    @property
    def devices(self) -> float:
        return self.fsdp * self.tp


def largest_fsdp_tp_grid(layer: SwiGLULayer, device: Accelerator, overlap_axes: bool) -> FSDPTPGrid:
    """The grid with the most devices whose forward (the pass that asks more) is not communication-bound."""
    r = _ratio(layer, device)
    if overlap_axes:  # each axis on its own: FSDP's bound and TP's
        return FSDPTPGrid(fsdp=1 + 2 * layer.batch * r, tp=1 + 3 * layer.d_ff * r)
    # Under the line 3bF N_F + 2bB N_T <= K (in units of b, which cancels), the product peaks where both terms are
    # K/2, unless that puts an axis below one device.
    f_cost, t_cost = 3 * layer.d_ff, 2 * layer.batch
    budget = 6 * layer.batch * layer.d_ff * r + f_cost + t_cost
    fsdp = min(max(budget / (2 * f_cost), 1.0), (budget - t_cost) / f_cost)
    return FSDPTPGrid(fsdp=fsdp, tp=(budget - f_cost * fsdp) / t_cost)
