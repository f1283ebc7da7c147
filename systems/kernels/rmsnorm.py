"""RMSNorm in Triton, forward and backward: y = x / rms(x) * weight with the statistics in fp32, as
systems.model.RMSNorm computes it, in one read of x and one write of y.

Forward: a program normalizes ROWS rows, each held whole (the width padded to a power of two), and keeps each row's
1 / rms in fp32 for the backward. Backward, with x̂ = x / rms and g = weight * dy:
dx = (g - x̂ mean(x̂ g)) / rms, and dweight = sum over rows of dy x̂; each program sums dweight over its own run of
rows into an fp32 partial, and the partials are added in a fixed order afterwards (no atomics: the same sums every
run).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from systems.kernels.launch import check_device, kernel_op, on_gpu

# One row is held whole by a program: d_model up to this (every preset's is).
MAX_WIDTH = 16384
# Rows a backward program sums dweight over: enough programs to fill the GPU, each with a long run of rows.
PARTIALS_PER_SM = 4
INTERPRETED_PARTIALS = 3


@triton.jit
def _rms_forward_kernel(X, W, Y, RSTD, n_rows, width, x_stride, y_stride, EPS: tl.constexpr,
                        BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < width)[None, :]
    x = tl.load(X + rows[:, None].to(tl.int64) * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1 / tl.sqrt(tl.sum(x * x, 1) / width + EPS)
    w = tl.load(W + cols, mask=cols < width, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + rows[:, None].to(tl.int64) * y_stride + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)


@triton.jit
def _rms_backward_kernel(X, W, DY, RSTD, DX, DW_PARTIAL, n_rows, width, rows_per_program, x_stride, dy_stride,
                         dx_stride, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    w = tl.load(W + cols, mask=cols < width, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    start = tl.program_id(0) * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    for first in range(start, end, ROWS):
        rows = first + tl.arange(0, ROWS)
        mask = (rows < end)[:, None] & (cols < width)[None, :]
        offsets = rows[:, None].to(tl.int64)
        x = tl.load(X + offsets * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offsets * dy_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rows < end, other=0.0)
        x_hat = x * rstd[:, None]
        g = dy * w[None, :]
        dx = (g - x_hat * (tl.sum(x_hat * g, 1) / width)[:, None]) * rstd[:, None]
        tl.store(DX + offsets * dx_stride + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * x_hat, 0)
    tl.store(DW_PARTIAL + tl.program_id(0) * width + cols, dw, mask=cols < width)


def _block(width: int) -> tuple[int, int, int]:
    """(padded width, rows a program, warps): about 4096 elements a program on a GPU; a few rows interpreted."""
    block = triton.next_power_of_2(width)
    if not on_gpu():
        return block, 4, 1
    return block, max(1, 4096 // block), 8 if block >= 4096 else 4


@functools.cache
def _partials(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETED_PARTIALS
    return PARTIALS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, width) with unit stride along the width; a view where its layout allows."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _rms_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows = _as_rows(x)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(len(rows), dtype=torch.float32, device=x.device)
    block, per_program, warps = _block(rows.shape[1])
    if len(rows) == 0:
        return y.view(x.shape), rstd
    _rms_forward_kernel[(triton.cdiv(len(rows), per_program),)](
        rows, weight, y, rstd, len(rows), rows.shape[1], rows.stride(0), y.stride(0),
        EPS=eps, BLOCK=block, ROWS=per_program, num_warps=warps)
    return y.view(x.shape), rstd


def _rms_backward(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                  dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, dy_rows = _as_rows(x), _as_rows(dy)
    dx = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block, per_program, warps = _block(rows.shape[1])
    programs = max(1, min(_partials(x.device), triton.cdiv(len(rows), per_program)))
    partial = torch.empty(programs, rows.shape[1], dtype=torch.float32, device=x.device)
    _rms_backward_kernel[(programs,)](
        rows, weight, dy_rows, rstd, dx, partial, len(rows), rows.shape[1], triton.cdiv(len(rows), programs),
        rows.stride(0), dy_rows.stride(0), dx.stride(0), BLOCK=block, ROWS=per_program, num_warps=warps)
    return dx.view(x.shape), partial.sum(0).to(weight.dtype)


@kernel_op("rms_norm_forward", lambda x, weight, eps: (torch.empty_like(x, memory_format=torch.contiguous_format),
                                                        x.new_empty(x.shape[:-1].numel(), dtype=torch.float32)))
def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y (x's shape and dtype) and each row's fp32 1 / rms."""
    return _rms_forward(x, weight, eps)


@kernel_op("rms_norm_backward", lambda x, weight, rstd, dy: (torch.empty_like(x, memory_format=torch.contiguous_format),
                                                              torch.empty_like(weight)))
def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (x's dtype) and dweight (weight's dtype, summed in fp32)."""
    return _rms_backward(x, weight, rstd, dy)


class RMSNormFunction(torch.autograd.Function):
    """`RMSNormFunction.apply(x, weight, eps)`: x (..., width) of any float dtype, weight (width,); the output in x's
    dtype. Saves x and each row's 1 / rms (fp32)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        _check(x, weight, eps)
        y, rstd = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = rms_norm_backward(x, weight, rstd, dy)
        return dx, dweight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """systems.model.RMSNorm's forward, fused: x / sqrt(mean(x²) + eps) * weight."""
    return RMSNormFunction.apply(x, weight, eps)


def _check(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    check_device("rms_norm", x, weight)
    if not (x.is_floating_point() and weight.is_floating_point()):
        raise TypeError(f"rms_norm needs floating-point x and weight, got {x.dtype} and {weight.dtype}")
    if weight.dim() != 1 or x.dim() < 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm needs a weight of x's last dimension, got x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)}")
    if x.shape[-1] > MAX_WIDTH:
        raise ValueError(f"rms_norm holds a row whole: width {x.shape[-1]} exceeds {MAX_WIDTH}")
    if not (isinstance(eps, float) and eps > 0):
        raise ValueError(f"eps must be a positive float, got {eps!r}")
