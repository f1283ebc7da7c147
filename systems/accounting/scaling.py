"""Parallelism arithmetic (CS336 assignment 2, after the scaling book's training chapter): a model reduced to
its feed-forward matmuls, sharded over TPU v5p or H100 devices."""

from __future__ import annotations

import math
from dataclasses import dataclass

from systems.accounting.transformer import GB, H100_BYTES
from systems.precision import FP32

TPU_V5P_BYTES = 95 * GB
# The handout's TPU v5p figures for the scaling-book arithmetic.
TPU_V5P_ICI_BANDWIDTH = 2 * 9e10  # bytes/s
TPU_V5P_FLOPS = 4.6e14  # bf16 FLOP/s


@dataclass(frozen=True)
class FFNStack:
    """A model reduced to its feed-forward matmuls: `num_blocks` blocks of d_model -> d_ff -> d_model."""

    d_model: int
    d_ff: int
    num_blocks: int

    @property
    def num_parameters(self) -> int:
        return self.num_blocks * 2 * self.d_model * self.d_ff

    def state_bytes(self) -> int:
        """fp32 master weights, accumulated gradients and AdamW's two moments: 16 bytes per parameter."""
        return 4 * FP32 * self.num_parameters

    def activation_bytes(self, tokens: int) -> int:
        """bf16 activations saved for backward: each linear layer's input, for every token."""
        return 2 * tokens * self.num_blocks * (self.d_model + self.d_ff)

    def fsdp_bytes_per_device(self, tokens: int, devices: int) -> float:
        """Weights, optimizer state, gradients and half the activations sharded N ways."""
        if devices < 1:
            raise ValueError(f"devices must be positive, got {devices}")
        acts = self.activation_bytes(tokens)
        return self.state_bytes() / devices + acts / 2 + acts / (2 * devices)

    def min_fsdp_devices(self, tokens: int, device_bytes: float = TPU_V5P_BYTES) -> int:
        """The smallest N whose per-device memory fits in `device_bytes`."""
        acts = self.activation_bytes(tokens)
        if acts / 2 >= device_bytes:
            raise ValueError(f"the unsharded half of the activations, {acts / 2 / GB:.1f} GB, "
                             f"alone exceeds {device_bytes / GB:.1f} GB")
        return math.ceil((self.state_bytes() + acts / 2) / (device_bytes - acts / 2))


XXL = FFNStack(d_model=16384, d_ff=53248, num_blocks=126)


def devices_to_hold(nbytes: float, device_bytes: float = H100_BYTES) -> int:
    return math.ceil(nbytes / device_bytes)


@dataclass(frozen=True)
class ComputeBoundBatch:
    per_device: float  # tokens per device
    total: float  # global batch, tokens


def fsdp_tp_compute_bound_batch(stack: FFNStack, *, ici_bandwidth: float, flops_per_s: float,
                                fsdp_axes: int, tp_axes: int, fsdp: int, tp: int) -> ComputeBoundBatch:
    """Smallest batch at which a forward pass with X-way FSDP and Y-way tensor parallelism is compute-bound.

    The scaling book's model: the forward's matmuls take 4·B·D·F / (N·C); FSDP all-gathers weights,
    4·D·F / (Y·W·M_X), and TP moves activations, 4·B·D / (X·W·M_Y); communication overlaps compute,
    so the batch must make the math at least as long as both together. D cancels out.
    """
    f, n = stack.d_ff, fsdp * tp
    math_per_token = f / flops_per_s  # per-device time per token of per-device batch, over 4·D
    tp_per_token = tp / (ici_bandwidth * tp_axes)
    if math_per_token <= tp_per_token:
        return ComputeBoundBatch(per_device=math.inf, total=math.inf)
    per_device = (f / (tp * ici_bandwidth * fsdp_axes)) / (math_per_token - tp_per_token)
    return ComputeBoundBatch(per_device=per_device, total=per_device * n)
