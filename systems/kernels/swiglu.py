"""SwiGLU's elementwise part in Triton: silu(a) * b, forward and backward, in one pass each.

Eager PyTorch makes silu(a) (a tensor of its own, which autograd keeps) and then the product, rounding each to the
input dtype, and its backward makes the product's two gradients before silu's. Here the forward reads a and b and
writes the product, computed in fp32 and rounded once; autograd keeps a and b only. The backward reads a, b and the
product's gradient g and writes both gradients, with s = sigmoid(a):
da = g b s (1 + a (1 - s)), db = g a s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from systems.kernels.launch import check_device, kernel_op, on_gpu

BLOCK = 2048
INTERPRETED_BLOCK = 64


@triton.jit
def _sigmoid(a):
    return 1 / (1 + tl.exp(-a))


@triton.jit
def _silu_mul_forward_kernel(A, B, OUT, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    a = tl.load(A + offsets, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offsets, (a * _sigmoid(a) * b).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_backward_kernel(A, B, G, DA, DB, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    a = tl.load(A + offsets, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
    s = _sigmoid(a)
    tl.store(DA + offsets, (g * b * s * (1 + a * (1 - s))).to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offsets, (g * a * s).to(DB.dtype.element_ty), mask=mask)


def _grid(n: int):
    block = BLOCK if on_gpu() else INTERPRETED_BLOCK
    return (triton.cdiv(n, block),), block


def _fresh(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


@kernel_op("silu_mul_forward", lambda a, b: torch.empty_like(a, memory_format=torch.contiguous_format))
def silu_mul_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.contiguous(), b.contiguous()
    out = _fresh(a)
    if a.numel():
        grid, block = _grid(a.numel())
        _silu_mul_forward_kernel[grid](a, b, out, a.numel(), BLOCK=block)
    return out


@kernel_op("silu_mul_backward", lambda a, b, g: (torch.empty_like(a, memory_format=torch.contiguous_format),
                                                 torch.empty_like(b, memory_format=torch.contiguous_format)))
def silu_mul_backward(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, b, g = a.contiguous(), b.contiguous(), g.contiguous()
    da, db = _fresh(a), _fresh(b)
    if a.numel():
        grid, block = _grid(a.numel())
        _silu_mul_backward_kernel[grid](a, b, g, da, db, a.numel(), BLOCK=block)
    return da, db


class SiluMulFunction(torch.autograd.Function):
    """`SiluMulFunction.apply(a, b)`: silu(a) * b of two tensors of one shape and dtype. Saves a and b."""

    @staticmethod
    def forward(ctx, a, b):
        check_device("silu_mul", a, b)
        if a.shape != b.shape or a.dtype != b.dtype or not a.is_floating_point():
            raise ValueError(f"silu_mul needs two floating-point tensors of one shape and dtype, got {a.dtype} "
                             f"{tuple(a.shape)} and {b.dtype} {tuple(b.shape)}")
        ctx.save_for_backward(a, b)
        return silu_mul_forward(a, b)

    @staticmethod
    def backward(ctx, g):
        return silu_mul_backward(*ctx.saved_tensors, g)


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """F.silu(a) * b, fused: SwiGLU's product of its gate (w1's output) and its value (w3's)."""
    return SiluMulFunction.apply(a, b)
