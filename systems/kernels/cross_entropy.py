"""Cross-entropy's softmax over vocab tiles in Triton: the elementwise half of systems.loss's fused LM head and loss.

systems.loss.chunked_cross_entropy(..., fused=True) makes a chunk's logits with a torch matmul (cuBLAS: the matmuls
are nearly all of the loss's FLOPs, and cuBLAS runs them at the GPU's peak) and hands them, in the compute dtype,
to these kernels; eager PyTorch would copy them to fp32 and make several (chunk, vocab) fp32 tensors (the copy, the
log-sum-exp's exponentials, the softmax, its scaled cast). Here:

- forward: a program streams one row's logits tile by tile, keeping a running maximum and the sum of exponentials
  under it (an online softmax, in fp32), and writes the row's log-sum-exp and loss (log-sum-exp less the target's
  logit). The logits are read once, nothing (chunk, vocab) is written.
- backward: a program takes one tile of one row's logits, made again by the matmul, and overwrites it with that
  row's gradient, (softmax - one-hot of the target) * d(loss) / tokens, in the logits' dtype: the two gradient
  matmuls read it from there. That scale is read on the device: no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from systems.kernels.launch import check_device, kernel_op, on_gpu

BLOCK_V = 4096  # a forward program's tile of the vocabulary
GRADIENT_BLOCK_V = 1024  # a backward program's (the grid spans the vocabulary)
INTERPRETED_BLOCK_V = 128


@triton.jit
def _lse_loss_kernel(LOGITS, TARGETS, LSE, LOSS, vocab, row_stride, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits = LOGITS + row * row_stride
    cols = tl.arange(0, BLOCK_V)
    m = float("-inf")  # running maximum
    s = 0.0  # sum of exp(logit - m)
    for start in range(0, vocab, BLOCK_V):
        z = tl.load(logits + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))  # finite from the first tile on, which holds a logit
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    target = tl.load(logits + tl.load(TARGETS + row)).to(tl.float32)
    tl.store(LSE + row, lse)
    tl.store(LOSS + row, lse - target)


@triton.jit
def _logit_gradient_kernel(LOGITS, TARGETS, LSE, SCALE, vocab, row_stride, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < vocab
    logits = LOGITS + row * row_stride + cols
    z = tl.load(logits, mask=mask, other=0.0).to(tl.float32)
    p = tl.exp(z - tl.load(LSE + row))
    p = tl.where(cols == tl.load(TARGETS + row), p - 1, p)
    tl.store(logits, (p * tl.load(SCALE)).to(LOGITS.dtype.element_ty), mask=mask)


def _block(forward: bool) -> int:
    if not on_gpu():
        return INTERPRETED_BLOCK_V
    return BLOCK_V if forward else GRADIENT_BLOCK_V


@kernel_op("cross_entropy_rows", lambda logits, targets: (logits.new_empty(len(logits), dtype=torch.float32),
                                                          logits.new_empty(len(logits), dtype=torch.float32)))
def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's fp32 log-sum-exp and loss: logits (rows, vocab) with unit stride along the vocabulary, targets
    (rows,) int64."""
    _check(logits, targets)
    lse = torch.empty(len(logits), dtype=torch.float32, device=logits.device)
    loss = torch.empty_like(lse)
    if len(logits):
        _lse_loss_kernel[(len(logits),)](logits, targets, lse, loss, logits.shape[1], logits.stride(0),
                                         BLOCK_V=_block(forward=True), num_warps=8 if on_gpu() else 1)
    return lse, loss


@kernel_op("cross_entropy_logit_gradients_", lambda logits, targets, lse, scale: None, mutates_args=("logits",))
def logit_gradients_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor) -> None:
    """Overwrites the rows' logits with (softmax - one-hot of the target) * scale, in their dtype: `scale` a
    one-element tensor, d(mean loss) / tokens for the mean's gradient."""
    _check(logits, targets)
    if len(logits):
        block = _block(forward=False)
        _logit_gradient_kernel[(len(logits), triton.cdiv(logits.shape[1], block))](
            logits, targets, lse, scale, logits.shape[1], logits.stride(0), BLOCK_V=block)


def _check(logits: torch.Tensor, targets: torch.Tensor) -> None:
    check_device("fused cross-entropy", logits, targets)
    if logits.dim() != 2 or logits.stride(1) != 1 or targets.shape != logits.shape[:1]:
        raise ValueError(f"fused cross-entropy needs (rows, vocab) logits with unit stride along the vocabulary "
                         f"and a target per row, got logits {tuple(logits.shape)} (strides {logits.stride()}) and "
                         f"targets {tuple(targets.shape)}")
    if targets.dtype != torch.int64:
        raise TypeError(f"targets must be int64 class ids, got {targets.dtype}")
