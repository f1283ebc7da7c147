"""FlashAttention-2 in plain PyTorch: tiled forward with an online softmax, backward by recomputation."""

from __future__ import annotations

import math

import torch

from systems.attention.reference import check_inputs, save_for_recompute, saved_for_recompute

Q_TILE = 64
K_TILE = 64


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                  q_tile: int = Q_TILE, k_tile: int = K_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (q's dtype) and fp32 log-sum-exp, never holding more than a (q_tile, k_tile) block of scores."""
    # q: (..., n_queries, d), k and v: (..., n_keys, d); fp32 math whatever the input dtype
    n_queries, n_keys = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1])
    q, k, v = q.float(), k.float(), v.float()
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for i in range(0, n_queries, q_tile):
        q_i = q[..., i:i + q_tile, :] * scale
        rows = torch.arange(i, i + q_i.shape[-2], device=q.device)
        m = torch.full(q_i.shape[:-1], float("-inf"), device=q.device)  # running row max
        l = torch.zeros(q_i.shape[:-1], device=q.device)  # running row sum of exp(s - m)
        acc = torch.zeros_like(q_i)
        # Causal: keys past the tile's last query are masked for every row, so never visited.
        k_end = min(n_keys, i + q_i.shape[-2]) if is_causal else n_keys
        for j in range(0, k_end, k_tile):
            s = q_i @ k[..., j:j + k_tile, :].transpose(-2, -1)  # (..., q_tile, k_tile)
            if is_causal and j + s.shape[-1] - 1 > i:  # the tile crosses the diagonal
                cols = torch.arange(j, j + s.shape[-1], device=q.device)
                s = s.masked_fill(cols > rows[:, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new.unsqueeze(-1))
            alpha = torch.exp(m - m_new)  # rescales what was accumulated under the old max
            l = alpha * l + p.sum(dim=-1)
            acc = alpha.unsqueeze(-1) * acc + p @ v[..., j:j + k_tile, :]
            m = m_new
        o[..., i:i + q_tile, :] = acc / l.unsqueeze(-1)
        lse[..., i:i + q_tile] = m + torch.log(l)
    return o, lse


def flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
                   lse: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV recomputed from the inputs, the output and its log-sum-exp (FlashAttention-2, eq. 13-20)."""
    scale = 1 / math.sqrt(q.shape[-1])
    q, k, v, o, do = q.float(), k.float(), v.float(), o.float(), do.float()
    s = q @ k.transpose(-2, -1) * scale  # (..., n_queries, n_keys)
    if is_causal:
        visible = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = p.transpose(-2, -1) @ do
    dp = do @ v.transpose(-2, -1)
    delta = (o * do).sum(dim=-1, keepdim=True)  # rowsum(O ∘ dO) equals rowsum(P ∘ dP), without forming it
    ds = p * (dp - delta)
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv


class FlashAttentionPytorch(torch.autograd.Function):
    """`FlashAttentionPytorch.apply(q, k, v, is_causal=False)`: q (batch, [heads,] n_queries, d)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        check_inputs(q, k, v, is_causal)
        # The math is fp32 by design: autocast must not push the tiles back to half precision.
        with torch.autocast(q.device.type, enabled=False):
            o, lse = flash_forward(q, k, v, is_causal)
        return save_for_recompute(ctx, q, k, v, o.to(q.dtype), lse, is_causal)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, is_causal = saved_for_recompute(ctx)
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = flash_backward(q, k, v, o, do, lse, is_causal)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
