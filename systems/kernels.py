"""Small Triton kernels the model's training step uses (attention lives in systems.attention)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, lr, beta1, beta2, eps, weight_decay,
                  step_size, inv_sqrt_bc2, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    p = p * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (g - m)
    v = beta2 * v + (1 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) * inv_sqrt_bc2 + eps)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)


def adamw_step(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               step_size: float, inv_sqrt_bias_correction2: float) -> None:
    """One AdamW update of a contiguous parameter, in place; bias corrections folded into the scalars."""
    n = p.numel()
    block = 4096
    _adamw_kernel[(triton.cdiv(n, block),)](
        p, grad, exp_avg, exp_avg_sq, n, lr, beta1, beta2, eps, weight_decay,
        step_size, inv_sqrt_bias_correction2, BLOCK=block, num_warps=8,
    )
