"""Rotary position embedding of q and k in Triton, in the model's layout: each (even, odd) pair of a head's features
rotated by its position's angle, as systems.model.RotaryEmbedding does, with the cos and sin tables it holds.

One program takes BLOCK_S positions of one head and rotates q's and k's there, reading the tables' rows once for
both. The math is fp32 with the tables as stored (eager casts them to q's dtype first); each output is rounded once.
The backward is the inverse rotation, the same kernel with sin negated. q and k may be any strided
(batch, heads, seq, d_head) views, such as the model's of its qkv projection; the outputs are laid out
(batch, seq, heads, d_head) in memory, as v is, and returned as (batch, heads, seq, d_head) views.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from systems.kernels.launch import check_device, kernel_op, on_gpu

BLOCK_S = 16
INTERPRETED_BLOCK_S = 4


@triton.jit
def _rotate(X, OUT, x_strides, out_strides, b, h, pos, pairs, mask, cos, sin):
    """Rotates the (positions, pairs) tile of X's head h of batch b into OUT."""
    x = X + b * x_strides[0] + h * x_strides[1] + pos[:, None] * x_strides[2] + 2 * pairs[None, :] * x_strides[3]
    even = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(x + x_strides[3], mask=mask, other=0.0).to(tl.float32)
    out = (OUT + b * out_strides[0] + h * out_strides[1] + pos[:, None] * out_strides[2]
           + 2 * pairs[None, :] * out_strides[3])
    tl.store(out, (even * cos - odd * sin).to(OUT.dtype.element_ty), mask=mask)
    tl.store(out + out_strides[3], (even * sin + odd * cos).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN, q_strides, k_strides, qo_strides, ko_strides, seq, table_stride,
                 HALF: tl.constexpr, HALF_PAD: tl.constexpr, INVERSE: tl.constexpr, BLOCK_S: tl.constexpr):
    pos = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    pairs = tl.arange(0, HALF_PAD)
    mask = (pos < seq)[:, None] & (pairs < HALF)[None, :]
    table = pos[:, None] * table_stride + pairs[None, :]
    cos = tl.load(COS + table, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(SIN + table, mask=mask, other=0.0).to(tl.float32)
    if INVERSE:  # the transpose of a rotation is the rotation by minus the angle
        sin = -sin
    _rotate(Q, QO, q_strides, qo_strides, b, h, pos, pairs, mask, cos, sin)
    _rotate(K, KO, k_strides, ko_strides, b, h, pos, pairs, mask, cos, sin)


def _like_v(x: torch.Tensor) -> torch.Tensor:
    """An empty (batch, heads, seq, d) tensor laid out (batch, seq, heads, d) in memory."""
    batch, heads, seq, d = x.shape
    return torch.empty(batch, seq, heads, d, dtype=x.dtype, device=x.device).transpose(1, 2)


def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, seq, d = q.shape
    q_out, k_out = _like_v(q), _like_v(k)
    if q.numel():
        block = BLOCK_S if on_gpu() else INTERPRETED_BLOCK_S
        _rope_kernel[(triton.cdiv(seq, block), heads, batch)](
            q, k, q_out, k_out, cos, sin, q.stride(), k.stride(), q_out.stride(), k_out.stride(), seq, cos.stride(0),
            HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2), INVERSE=inverse, BLOCK_S=block)
    return q_out, k_out


def _fake(q, k, cos, sin):
    return _like_v(q), _like_v(k)


@kernel_op("rope_forward", _fake)
def rope_forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope(q, k, cos, sin, inverse=False)


@kernel_op("rope_backward", _fake)
def rope_backward(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope(dq, dk, cos, sin, inverse=True)


class RopeFunction(torch.autograd.Function):
    """`RopeFunction.apply(q, k, cos, sin)`: q and k (batch, heads, seq, d_head) rotated by the (context, d_head / 2)
    tables' first seq rows. Saves nothing but the tables (the model's buffers)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        _check(q, k, cos, sin)
        ctx.save_for_backward(cos, sin)
        return rope_forward(q, k, cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = rope_backward(dq, dk, cos, sin)
        return dq, dk, None, None


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RotaryEmbedding applied to q and to k, fused into one launch."""
    return RopeFunction.apply(q, k, cos, sin)


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    check_device("rotate_qk", q, k, cos, sin)
    if q.dim() != 4 or q.shape != k.shape or q.dtype != k.dtype or not q.is_floating_point():
        raise ValueError(f"rotate_qk needs q and k (batch, heads, seq, d_head) of one shape and float dtype, got "
                         f"{q.dtype} {tuple(q.shape)} and {k.dtype} {tuple(k.shape)}")
    seq, d = q.shape[2:]
    if d % 2:
        raise ValueError(f"rotate_qk rotates pairs of features: d_head must be even, got {d}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[0] < seq or table.shape[1] != d // 2 or table.stride(1) != 1:
            raise ValueError(f"{name} must be a (context >= {seq}, {d // 2}) table with unit stride along the pairs, "
                             f"got shape {tuple(table.shape)}, strides {table.stride()}")
    if cos.stride() != sin.stride():
        raise ValueError(f"cos and sin must share a layout, got strides {cos.stride()} and {sin.stride()}")
