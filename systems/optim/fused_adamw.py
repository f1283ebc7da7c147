"""The fused AdamW update: one Triton launch updates many tensors, each read and written once."""

import functools

import torch
import triton
import triton.language as tl

from systems.device import host_to_device

ADAMW_BLOCK = 4096


@triton.jit
def _adamw_kernel(p_base, g_base, m_base, v_base, w_base, offsets, numels, chunk_tensor, chunk_start,
                  step_sizes, inv_sqrt_bc2s, lr, beta1, beta2, eps, weight_decay,
                  LOW_PRECISION_WEIGHTS: tl.constexpr, W_ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    # One program updates BLOCK elements of one tensor; the tables say which tensor and where.
    # Tensor t's elements start `offsets[5t + i]` elements after the i-th base pointer (p, g, m, v, w).
    # Bases passed as arguments are known to be 16-byte aligned and the hints carry that through the
    # offsets (W_ALIGN: elements of w's dtype in 16 bytes); with unmasked full blocks the loads are then
    # vectorized. With LOW_PRECISION_WEIGHTS, p is the fp32 master copy of the bf16/fp16 weights w, and g
    # has w's dtype.
    chunk = tl.program_id(0)
    t = tl.load(chunk_tensor + chunk)
    start = tl.multiple_of(tl.load(chunk_start + chunk), BLOCK)
    offs = start + tl.arange(0, BLOCK)
    p_ptr = p_base + tl.multiple_of(tl.load(offsets + 5 * t), 4) + offs
    g_ptr = g_base + tl.multiple_of(tl.load(offsets + 5 * t + 1), W_ALIGN) + offs
    m_ptr = m_base + tl.multiple_of(tl.load(offsets + 5 * t + 2), 4) + offs
    v_ptr = v_base + tl.multiple_of(tl.load(offsets + 5 * t + 3), 4) + offs
    w_ptr = w_base + tl.multiple_of(tl.load(offsets + 5 * t + 4), W_ALIGN) + offs
    step_size = tl.load(step_sizes + t)
    inv_sqrt_bc2 = tl.load(inv_sqrt_bc2s + t)
    numel = tl.load(numels + t)
    if start + BLOCK <= numel:
        _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, None, lr, beta1, beta2, eps, weight_decay, step_size,
                     inv_sqrt_bc2, LOW_PRECISION_WEIGHTS)
    else:
        _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs < numel, lr, beta1, beta2, eps, weight_decay,
                     step_size, inv_sqrt_bc2, LOW_PRECISION_WEIGHTS)


@triton.jit
def _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, mask, lr, beta1, beta2, eps, weight_decay, step_size,
                 inv_sqrt_bc2, LOW_PRECISION_WEIGHTS: tl.constexpr):
    p = tl.load(p_ptr, mask=mask)
    g = tl.load(g_ptr, mask=mask).to(tl.float32)
    m = tl.load(m_ptr, mask=mask)
    v = tl.load(v_ptr, mask=mask)
    p = p * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (g - m)
    v = beta2 * v + (1 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) * inv_sqrt_bc2 + eps)
    tl.store(p_ptr, p, mask=mask)
    tl.store(m_ptr, m, mask=mask)
    tl.store(v_ptr, v, mask=mask)
    if LOW_PRECISION_WEIGHTS:
        tl.store(w_ptr, p.to(w_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)  # as torch rounds


@functools.lru_cache(maxsize=8)
def _chunk_table(numels: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Each tensor's size and, for each program, the tensor it updates and the offset of its block.

    Fixed by the shapes, so built once and kept on the device.
    """
    counts = torch.tensor([triton.cdiv(n, ADAMW_BLOCK) for n in numels])
    tensor_index = torch.repeat_interleave(torch.arange(len(numels)), counts)
    starts = torch.cat([torch.arange(int(c)) * ADAMW_BLOCK for c in counts])
    return (torch.tensor(numels, device=device), tensor_index.to(device, torch.int32),
            starts.to(device, torch.int64))


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, *, weights=None, lr: float, beta1: float,
               beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update of many contiguous fp32 tensors, in place, in a single kernel launch.

    Reads p, g, m, v and writes p, m, v once: 28 bytes per parameter, the floor of this update.
    With `weights`, `params` are fp32 master copies of these bf16/fp16 tensors, the gradients have
    their dtype, and each updated master is written back rounded: still 28 bytes per parameter.
    """
    device = params[0].device
    fp32 = (params, exp_avgs, exp_avg_sqs)
    low_precision = weights is not None
    weights = weights if low_precision else params  # w is never written then: the pointer only fills the slot
    grad_dtype = weights[0].dtype
    if (any(t.dtype != torch.float32 for tensors in fp32 for t in tensors)
            or any(t.dtype != grad_dtype for tensors in (grads, weights) for t in tensors)):
        raise ValueError("the fused AdamW kernel needs fp32 parameters and moments, and gradients of the "
                         "weights' dtype")
    lists = (params, grads, exp_avgs, exp_avg_sqs, weights)
    if any(not t.is_contiguous() or t.data_ptr() % 16 for tensors in lists for t in tensors):
        raise ValueError("the fused AdamW kernel needs contiguous, 16-byte aligned tensors")
    bases = [tensors[0] for tensors in lists]
    offsets = [(t.data_ptr() - base.data_ptr()) // t.element_size()
               for group in zip(*lists) for t, base in zip(group, bases)]
    # Bias corrections differ per tensor where a parameter skipped steps (no gradient).
    scalars = host_to_device([[lr / (1 - beta1**s) for s in steps], [(1 - beta2**s) ** -0.5 for s in steps]],
                             torch.float32, device)
    numels, chunk_tensor, chunk_start = _chunk_table(tuple(p.numel() for p in params), device)
    _adamw_kernel[(len(chunk_tensor),)](
        *bases, host_to_device(offsets, torch.int64, device), numels, chunk_tensor, chunk_start, scalars[0],
        scalars[1], lr, beta1, beta2, eps, weight_decay, LOW_PRECISION_WEIGHTS=low_precision,
        W_ALIGN=16 // weights[0].element_size(), BLOCK=ADAMW_BLOCK, num_warps=8,
    )
