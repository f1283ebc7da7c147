"""Attention cases and their check against attention written out in float64, shared by the attention tests: a
Case of shapes, dtype, layout and logits (Hypothesis draws them), and the rule for how far a kernel may be."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import strategies as st

from systems.attention import attention_reference

# Each quantity's error against float64 may be PLAIN_ERROR_MULTIPLE times that of attention written out in the
# input dtype (attention_reference, autograd for the gradients: what plain PyTorch gives), as flash-attn's
# tests allow: room for another order of the same sums (tiles, an online softmax), none for an error of another
# order. Plain PyTorch rounds P, dS and its outputs to the input dtype as the kernels do, so its error covers
# theirs; what it can avoid by luck is the fp32 error of the kernels' other order of sums. E.g. dQ and dK when
# each query sees one key: the softmax is 1 and autograd's dS = P(dP - sum(P dP)) is exactly 0, where the
# kernels' D = rowsum(O dO) and dP = dO vᵀ are two fp32 sums that differ by rounding; and FlashAttention-2
# takes D from O as stored, rounded to the input dtype, where autograd sums P dP. So a floor adds FLOOR_ULPS
# fp32 roundings of every term and the rounding of O in D (rounding_floor), plus half an ulp of the input dtype
# at the largest element, for the final rounding of a value that fp32 error has moved across a rounding boundary.
PLAIN_ERROR_MULTIPLE = 3
# fp32 roundings per term in the floor: a product, its sum and a rescale or two; on a GPU fp32 dots run as
# 3xTF32, which keeps 22 of fp32's 24 significant bits (2 ulps an operand).
FLOOR_ULPS = 4
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = list(range(16, 129, 8))
HEADS = [None, 1, 3]  # None: the handout's (batch, seq, d) shape
LAYOUTS = ("contiguous", "sliced", "transposed")
# How the logits are spread, for the online softmax's running maximum: "large" scales q and k by 8 (scores
# about N(0, 64²)); "growing" makes each row's scores rise along the keys by about GROWTH, past the
# exp's fp32 range (88), so a maximum that is not carried overflows; "mixed" scales each query row by 0.1 to 30;
# "negative" puts every score far below 0 (L ≪ 0: exp(0 - L) overflows, as at a padded key).
SCORES = ("normal", "large", "growing", "mixed", "negative")
GROWTH = 200.0


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int | None  # None: the handout's (batch, seq, d) shape
    n_queries: int
    n_keys: int
    d: int
    is_causal: bool
    dtype: torch.dtype
    layout: str  # how the tensors sit in memory: non-contiguous views must work too
    seed: int
    scores: str = "normal"

    def inputs(self, generator: torch.Generator, device: torch.device) -> list[torch.Tensor]:
        """q, k, v, fresh from `generator`, laid out and spread as the case says."""
        q = self.tensor(self.n_queries, generator, device)
        k, v = self.tensor(self.n_keys, generator, device), self.tensor(self.n_keys, generator, device)
        with torch.no_grad():
            self.spread_scores(q, k, generator)
        return [t.requires_grad_() for t in (q, k, v)]

    def tensor(self, seq: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        lead = (self.batch,) if self.heads is None else (self.batch, self.heads)
        # Converted before the view is taken, so that the view's strides survive the dtype.
        if self.layout == "sliced":  # rows padded: a row stride that is not d
            return self.convert(torch.randn(*lead, seq, self.d + 8, generator=generator), device)[..., :self.d]
        if self.layout == "transposed" and self.heads is None:  # seq-major, as a (seq, batch, d) tensor
            return self.convert(torch.randn(seq, self.batch, self.d, generator=generator), device).transpose(0, 1)
        if self.layout == "transposed":  # (batch, seq, heads, d), as the model's projections lay it out
            t = torch.randn(self.batch, seq, self.heads, self.d, generator=generator)
            return self.convert(t, device).transpose(1, 2)
        return self.convert(torch.randn(*lead, seq, self.d, generator=generator), device)

    def convert(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t.to(device=device, dtype=self.dtype)

    def spread_scores(self, q: torch.Tensor, k: torch.Tensor, generator: torch.Generator) -> None:
        """Rescale q and k in place (their layouts kept) so that the scores spread as `self.scores` says."""
        if self.scores == "large":
            q.mul_(8)
            k.mul_(8)
        elif self.scores == "growing":  # s_ij ≈ q_i0 · GROWTH · j / n_keys, with q_i0 >= 1
            q[..., 0] = q[..., 0].abs() + 1
            ramp = torch.linspace(0, GROWTH * self.d**0.5, self.n_keys, device=k.device)
            k[..., 0] = ramp.to(k.dtype)
        elif self.scores == "mixed":
            row_scale = 10 ** torch.empty(q.shape[:-1]).uniform_(-1, 1.5, generator=generator)
            q.mul_(row_scale.to(q)[..., None])
        elif self.scores == "negative":
            q.abs_().mul_(8)
            k.abs_().mul_(-8)


@st.composite
def cases(draw, max_seq: int, dtypes: list[torch.dtype], head_dims: list[int] = HEAD_DIMS,
          heads: list[int | None] = HEADS) -> Case:
    return Case(batch=draw(st.integers(1, 2)), heads=draw(st.sampled_from(heads)),
                n_queries=draw(st.integers(1, max_seq)), n_keys=draw(st.integers(1, max_seq)),
                d=draw(st.sampled_from(head_dims)), is_causal=draw(st.booleans()), dtype=draw(st.sampled_from(dtypes)),
                layout=draw(st.sampled_from(LAYOUTS)), seed=draw(st.integers(0, 2**32 - 1)),
                scores=draw(st.sampled_from(SCORES)))


def check_against_reference(apply, case: Case, device: torch.device) -> None:
    """O, L, dQ, dK and dV of `apply` match attention_reference computed in float64 on the same inputs, within
    a small multiple of plain PyTorch's error in the input dtype (see PLAIN_ERROR_MULTIPLE)."""
    generator = torch.Generator().manual_seed(case.seed)
    q, k, v = case.inputs(generator, device)
    o = apply(q, k, v, case.is_causal)
    lse = [t for t in o.grad_fn.saved_tensors if t.shape == q.shape[:-1]]
    assert len(lse) == 1, "exactly one saved tensor must have the log-sum-exp's shape"
    assert o.shape == q.shape and o.dtype == q.dtype
    do = torch.randn(o.shape, generator=generator).to(device=device, dtype=o.dtype)
    o.backward(do)
    actual = {"O": o, "L": lse[0], "dQ": q.grad, "dK": k.grad, "dV": v.grad}

    expected = plain_attention(q, k, v, do, case.is_causal, torch.float64)
    plain = plain_attention(q, k, v, do, case.is_causal, case.dtype)
    floor = rounding_floor(q, k, v, do, expected, case.is_causal)
    for name, value in actual.items():
        error = (value.double() - expected[name]).abs().max().item()
        plain_error = (plain[name].double() - expected[name]).abs().max().item()
        allowed = PLAIN_ERROR_MULTIPLE * plain_error + floor[name]
        assert error <= allowed, (f"{name}: error {error:.2e} against float64 exceeds {allowed:.2e} = "
                                  f"{PLAIN_ERROR_MULTIPLE} x plain PyTorch's {plain_error:.2e} + "
                                  f"rounding floor {floor[name]:.2e}, for {case}")


def plain_attention(q, k, v, do, is_causal: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """O, L and the gradients of attention_reference in `dtype`, by autograd."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    o, lse = attention_reference(q, k, v, is_causal)
    o.backward(do.to(dtype))
    return {"O": o.detach(), "L": lse.detach(), "dQ": q.grad, "dK": k.grad, "dV": v.grad}


def rounding_floor(q, k, v, do, expected: dict[str, torch.Tensor], is_causal: bool) -> dict[str, float]:
    """Per quantity: FLOOR_ULPS fp32 roundings of each term that makes one of its elements, at the largest
    element, plus half an ulp of the input dtype at the largest element.

    The scores s = q kᵀ/√d err by eps32·S, with S = |q| |k|ᵀ/√d, which moves P = exp(s - L) by
    P·eps32·(S + its P-weighted mean, through L). dS = P ∘ (dP - D), with dP = dO vᵀ and D = rowsum(O ∘ dO)
    each summed in fp32, D from O rounded to the input dtype. Then O = P v, dV = Pᵀ dO, dQ = dS k/√d and
    dK = dSᵀ q/√d, every factor by its absolute value.
    """
    eps, eps32 = torch.finfo(q.dtype).eps, torch.finfo(torch.float32).eps
    q, k, v, do = (t.detach().double() for t in (q, k, v, do))
    o, lse = expected["O"], expected["L"]
    scale = q.shape[-1] ** -0.5
    scores = q @ k.transpose(-2, -1) * scale
    if is_causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    p = torch.exp(scores - lse.unsqueeze(-1))  # 0 where masked
    dp_minus_d = (do @ v.transpose(-2, -1) - (o * do).sum(-1, keepdim=True)).abs()
    q, k, v, o, do = (t.abs() for t in (q, k, v, o, do))
    score_terms = (q @ k.transpose(-2, -1)) * scale
    p_error = p * eps32 * (score_terms + (p * score_terms).sum(-1, keepdim=True))
    # D comes from O as stored, rounded to the input dtype: a rounding that autograd's dS does not make.
    ds_error = p_error * dp_minus_d + p * (eps32 * do @ v.transpose(-2, -1) + eps * (o * do).sum(-1, keepdim=True))
    errors = {"O": p_error @ v, "L": eps32 * ((p * score_terms).sum(-1) + lse.abs()),
              "dQ": ds_error @ k * scale, "dK": ds_error.transpose(-2, -1) @ q * scale,
              "dV": p_error.transpose(-2, -1) @ do}
    output_eps = {name: eps32 if name == "L" else eps for name in errors}  # L is stored in fp32
    return {name: FLOOR_ULPS * error.max().item() + output_eps[name] / 2 * expected[name].abs().max().item()
            for name, error in errors.items()}


@pytest.fixture(scope="module")
def flash_triton():
    return pytest.importorskip("systems.attention.triton_launch", reason="needs Triton").FlashAttentionTriton

