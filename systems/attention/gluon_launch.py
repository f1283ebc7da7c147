"""`FlashAttentionGluon`: the Gluon forward (gluon_forward) with a backward chosen by `BACKWARD`: the Gluon one
(gluon_backward) or the Triton FlashAttention-2 one (triton_launch), so that the two can be timed against each
other on one build. Both recompute P from the forward's O and natural-log L."""

from __future__ import annotations

import torch

from systems.attention.gluon_backward import gluon_attention_backward
from systems.attention.gluon_forward import gluon_attention_forward
from systems.attention.reference import save_for_recompute, saved_for_recompute
from systems.attention.triton_launch import _attention_backward

BACKWARD = "triton"  # or "gluon", not yet faster than the FA2 backward on an H100 (docs/perf-notes.md)


class FlashAttentionGluon(torch.autograd.Function):
    """`FlashAttentionGluon.apply(q, k, v, is_causal=False)`."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        o, lse = gluon_attention_forward(q, k, v, is_causal)
        return save_for_recompute(ctx, q, k, v, o, lse, is_causal)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, is_causal = saved_for_recompute(ctx)
        backward = gluon_attention_backward if BACKWARD == "gluon" else _attention_backward
        dq, dk, dv = backward(q, k, v, o, do, lse, is_causal)
        return dq, dk, dv, None
