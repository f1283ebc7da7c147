"""BasicsTransformerLM as the reference lays it out (see the package's docstring)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn


class Linear(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        std = math.sqrt(2 / (d_in + d_out))
        self.weight = nn.Parameter(nn.init.trunc_normal_(torch.empty(d_out, d_in), std=std, a=-3 * std, b=3 * std))

    def forward(self, x):
        return x @ self.weight.T


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        self.weight = nn.Parameter(nn.init.trunc_normal_(torch.empty(vocab_size, d_model), a=-3.0, b=3.0))

    def forward(self, ids):
        return self.weight[ids]


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x):
        wide = x.float()
        return (self.weight * wide * torch.rsqrt(wide.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, context_length: int, dim: int, theta: float):
        super().__init__()
        inverse = torch.tensor(theta) ** -(torch.arange(0, dim, 2) / dim)  # fp32, as the reference's
        angles = torch.arange(context_length)[:, None] * inverse[None, :]
        self.register_buffer("_freq_cis_cache", torch.stack((angles.cos(), angles.sin())), persistent=False)

    def forward(self, x):
        cos, sin = self._freq_cis_cache[:, :x.shape[-2]]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat((cos * even - sin * odd, sin * even + cos * odd), dim=-1)


class CausalMultiHeadSelfAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, positional_encoder: RotaryEmbedding):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj, self.k_proj, self.v_proj = (Linear(d_model, d_model) for _ in range(3))
        self.output_proj = Linear(d_model, d_model)
        self.positional_encoder = positional_encoder

    def forward(self, x):
        batch, seq, width = x.shape
        q, k, v = (p(x).view(batch, seq, self.num_heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.positional_encoder(q), self.positional_encoder(k)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        return self.output_proj((weights @ v).transpose(1, 2).reshape(batch, seq, width))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(d_model, d_ff), Linear(d_ff, d_model), Linear(d_model, d_ff)

    def forward(self, x):
        gate = self.w1(x)
        return self.w2(gate * torch.sigmoid(gate) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, d_model: int, num_heads: int, d_ff: int, positional_encoder: RotaryEmbedding):
        super().__init__()
        self.attn = CausalMultiHeadSelfAttention(d_model, num_heads, positional_encoder)
        self.ffn = SwiGLU(d_model, d_ff)
        self.ln1, self.ln2 = RMSNorm(d_model), RMSNorm(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class BasicsTransformerLM(nn.Module):
    def __init__(self, vocab_size: int, context_length: int, d_model: int, num_layers: int, num_heads: int,
                 d_ff: int, rope_theta: float = 10_000.0):
        super().__init__()
        self.token_embeddings = Embedding(vocab_size, d_model)
        self.positional_encoder = RotaryEmbedding(context_length, d_model // num_heads, rope_theta)
        self.layers = nn.ModuleList(TransformerBlock(d_model, num_heads, d_ff, self.positional_encoder)
                                    for _ in range(num_layers))
        self.ln_final = RMSNorm(d_model)
        self.lm_head = Linear(d_model, vocab_size)

    def forward(self, ids):
        x = self.token_embeddings(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_final(x))
