"""Gradient clipping by the global norm."""

from __future__ import annotations

from collections.abc import Iterable

import torch


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale gradients in place so their global L2 norm is at most `max_norm`; returns the norm before.

    The scale is applied unconditionally (1 when under the limit) so no host sync is needed.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    scale = (max_norm / (total + eps)).clamp(max=1.0)
    torch._foreach_mul_(grads, scale)
    return total
