"""The one precision registry: a name ("fp32", "bf16", "fp16", "bf16-weights") resolves once to a
`Precision`, which says how a training step runs and what it costs per parameter."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

FP32 = 4


@dataclass(frozen=True)
class Precision:
    """The dtype the model's weights (and so their gradients) are kept in, and the dtype autocast runs
    matmuls in; fp32 compute runs without autocast."""

    name: str
    weights: torch.dtype
    compute: torch.dtype

    @property
    def uses_autocast(self) -> bool:
        return self.compute != torch.float32

    def autocast(self, device: torch.device):
        """Autocast to the compute dtype around a forward pass; fp32 runs without it."""
        if not self.uses_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute)

    def peak_key(self) -> str:
        """The key of `benchmarking.PEAK_TFLOPS` that this precision's matmuls run at. Read at call time:
        fp32 matmuls run on the tensor cores as tf32 when torch allows it."""
        name = DTYPE_NAMES[self.compute]
        if name == "fp32" and torch.backends.cuda.matmul.allow_tf32:
            return "tf32"
        return name

    # Bytes per parameter, as systems.optim.AdamW keeps them.
    @property
    def weight_bytes(self) -> int:
        return self.weights.itemsize

    @property
    def grad_bytes(self) -> int:
        return self.weights.itemsize

    @property
    def optimizer_bytes(self) -> int:
        """AdamW's two fp32 moments, and for low-precision weights an fp32 master copy."""
        master = FP32 if self.weights != torch.float32 else 0
        return 2 * FP32 + master

    @property
    def autocast_copy_bytes(self) -> int:
        """Per matmul weight: the low-precision copy autocast makes of an fp32 weight in the forward."""
        return self.compute.itemsize if self.weights != self.compute else 0


PRECISIONS = {p.name: p for p in (
    Precision("fp32", weights=torch.float32, compute=torch.float32),
    # Autocast: the fp32 weights are cast to bf16 in every forward, their gradients cast back in backward.
    Precision("bf16", weights=torch.float32, compute=torch.bfloat16),
    Precision("fp16", weights=torch.float32, compute=torch.float16),
    # bf16 weights, with fp32 master copies kept by AdamW: no per-step casts of the weights, and the
    # gradients and the residual stream in bf16. Autocast still runs the ops it keeps in fp32 in fp32.
    Precision("bf16-weights", weights=torch.bfloat16, compute=torch.bfloat16),
)}

# The precisions that are one dtype, named as in PRECISIONS: what tensors cast whole (the attention
# benchmarks' inputs) take.
DTYPES = {name: PRECISIONS[name].compute for name in ("fp32", "bf16", "fp16")}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def get_precision(precision: str | Precision) -> Precision:
    if isinstance(precision, Precision):
        return precision
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {list(PRECISIONS)}")
    return PRECISIONS[precision]
