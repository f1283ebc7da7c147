"""The Gluon FlashAttention-3-style forward and backward (and the forward with the Triton backward) against
attention written out in float64, on a Hopper GPU; and, on any machine, the "gluon" backend's errors for input it
does not take."""

from __future__ import annotations

import pytest
import torch

from attention_cases import Case, check_against_reference
from systems.attention import BACKENDS

pytest.importorskip("triton.experimental.gluon", reason="needs Triton with Gluon")

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not HOPPER, reason="needs an sm90 (Hopper) GPU")

# Lengths around the 64-row consumer halves, the 128-row Q tile and the 64/128-key tiles, and a long one.
SEQ_LENS = [1, 63, 127, 129, 1000, 4096]


def _apply(q, k, v, is_causal):
    return BACKENDS["gluon"](q, k, v, is_causal)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("seq", SEQ_LENS)
def test_gluon_matches_reference(seq, d, is_causal, dtype):
    heads = 1 if seq >= 4096 else 3
    case = Case(2, heads, seq, seq, d, is_causal, dtype, "contiguous", seed=seq * d + is_causal)
    check_against_reference(_apply, case, torch.device("cuda"))


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("case", [
    Case(1, 2, 129, 1000, 128, True, torch.bfloat16, "transposed", 1),  # more keys than queries
    Case(1, 2, 1000, 129, 64, True, torch.float16, "sliced", 2),  # more queries than keys
    Case(3, None, 200, 300, 64, False, torch.bfloat16, "transposed", 3),  # (batch, seq, d)
    Case(1, 2, 700, 700, 128, True, torch.bfloat16, "contiguous", 4, "growing"),  # the running max must carry
    Case(1, 2, 333, 333, 64, False, torch.float16, "contiguous", 5, "large"),
    Case(1, 2, 257, 257, 128, True, torch.float16, "contiguous", 6, "negative"),
    Case(1, 2, 500, 500, 64, True, torch.bfloat16, "contiguous", 7, "mixed"),
], ids=str)
def test_gluon_shapes_layouts_and_logits(case):
    check_against_reference(_apply, case, torch.device("cuda"))


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("p_in_smem", [False, True], ids=["p_in_registers", "p_in_smem"])
@pytest.mark.parametrize("block_n, num_stages", [(128, None), (64, 3), (64, 4)])
@pytest.mark.parametrize("d", [64, 128])
def test_gluon_tile_variants_match_reference(d, block_n, num_stages, p_in_smem):
    from systems.attention.gluon_forward import gluon_attention_forward
    from systems.attention.reference import attention_reference

    generator = torch.Generator().manual_seed(d + block_n)
    q, k, v = (torch.randn(2, 3, 1000, d, generator=generator).to("cuda", torch.bfloat16) for _ in range(3))
    o, lse = gluon_attention_forward(q, k, v, True, block_n=block_n, num_stages=num_stages, p_in_smem=p_in_smem)
    o_64, lse_64 = attention_reference(q.double(), k.double(), v.double(), True)
    o_plain, _ = attention_reference(q, k, v, True)
    # As attention_cases allows: 3 x plain PyTorch's error, plus half an ulp at the largest element.
    allowed = 3 * (o_plain.double() - o_64).abs().max().item() + torch.finfo(q.dtype).eps / 2 * o_64.abs().max().item()
    assert (o.double() - o_64).abs().max().item() <= allowed
    torch.testing.assert_close(lse.double(), lse_64, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("backward", ["gluon", "triton"])
@pytest.mark.parametrize("case", [
    Case(1, 2, 1, 1, 64, False, torch.bfloat16, "contiguous", 10),  # lengths of one, which Triton would specialize
    Case(2, 3, 63, 63, 64, True, torch.bfloat16, "contiguous", 11),  # less than one query tile
    Case(1, 2, 129, 129, 128, True, torch.float16, "contiguous", 12),  # one past a key tile
    Case(1, 2, 1000, 1000, 64, False, torch.bfloat16, "transposed", 13),
    Case(1, 2, 129, 1000, 128, True, torch.bfloat16, "sliced", 14),  # key tiles that no query sees
    Case(1, 2, 1000, 129, 64, True, torch.float16, "contiguous", 15),  # a ragged last key tile
    Case(3, None, 200, 300, 128, False, torch.float16, "contiguous", 16),  # (batch, seq, d)
    Case(1, 2, 500, 500, 128, True, torch.bfloat16, "contiguous", 17, "negative"),  # exp2 overflows where masked
], ids=str)
def test_gluon_backward_choices_match_reference(case, backward, monkeypatch):
    from systems.attention import gluon_launch

    monkeypatch.setattr(gluon_launch, "BACKWARD", backward)
    check_against_reference(_apply, case, torch.device("cuda"))


def _gluon_with_backward_tiles(block_m, num_stages):
    """The Gluon forward and the Gluon backward with these tiles, as an attention function."""
    from systems.attention.gluon_backward import gluon_attention_backward
    from systems.attention.gluon_forward import gluon_attention_forward
    from systems.attention.reference import save_for_recompute, saved_for_recompute

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, is_causal):
            o, lse = gluon_attention_forward(q, k, v, is_causal)
            return save_for_recompute(ctx, q, k, v, o, lse, is_causal)

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse, is_causal = saved_for_recompute(ctx)
            grads = gluon_attention_backward(q, k, v, o, do, lse, is_causal, block_m=block_m, num_stages=num_stages)
            return *grads, None

    return Attention.apply


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d, block_m, num_stages", [(64, 64, 2), (64, 64, 3), (64, 128, 2), (128, 64, 2),
                                                    (128, 64, 3)])
@pytest.mark.parametrize("seq", [127, 1000])
def test_gluon_backward_tiles_match_reference(seq, d, block_m, num_stages, is_causal):
    case = Case(1, 2, seq, seq, d, is_causal, torch.bfloat16, "contiguous", seed=seq + d + block_m + num_stages)
    check_against_reference(_gluon_with_backward_tiles(block_m, num_stages), case, torch.device("cuda"))


def test_gluon_backward_refuses_tiles_past_shared_memory():
    from systems.attention.gluon_backward import gluon_attention_backward

    q = torch.empty(1, 1, 8, 128)
    with pytest.raises(ValueError, match="block_m"):
        gluon_attention_backward(q, q, q, q, q, q[..., 0], False, block_m=128)


def _qkv(shape=(1, 2, 8, 64), dtype=torch.bfloat16, device="cpu"):
    return [torch.randn(shape, dtype=dtype, device=device) for _ in range(3)]


@pytest.mark.parametrize("qkv, error, match", [
    (_qkv(dtype=torch.float32), TypeError, "bfloat16"),
    (_qkv((1, 2, 8, 80)), ValueError, "head dims"),
    (_qkv(), ValueError, "CUDA"),
    ((torch.randn(1, 8, 64), torch.randn(2, 8, 64), torch.randn(2, 8, 64)), ValueError, "batch/head dims"),
], ids=["float32", "head dim 80", "cpu", "shapes differ"])
def test_gluon_backend_raises_clear_errors(qkv, error, match):
    with pytest.raises(error, match=match):
        BACKENDS["gluon"](*qkv, False)


@pytest.mark.gpu
@pytest.mark.skipif(HOPPER, reason="checks the refusal of GPUs other than sm90")
def test_gluon_refuses_other_gpus():
    with pytest.raises(RuntimeError, match="sm90"):
        BACKENDS["gluon"](*_qkv(device="cuda"), False)
