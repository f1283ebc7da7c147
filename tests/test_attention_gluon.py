"""The Gluon FlashAttention-3-style forward and backward (and the forward with the Triton backward) against
attention written out in float64, on a Hopper GPU; and, on any machine, the "gluon" backend's errors for input it
does not take."""

from __future__ import annotations

import itertools

import pytest
import torch

from attention_cases import Case, check_against_reference
from covering import tiered_as
from systems.attention import BACKENDS

pytest.importorskip("triton.experimental.gluon", reason="needs Triton with Gluon")

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not HOPPER, reason="needs an sm90 (Hopper) GPU")

# Lengths around the 64-row consumer halves, the 128-row Q tile and the 64/128-key tiles, a multiple of every tile,
# and a long one, in the slow tier only (from 2048 keys the Triton backward times its candidate tiles, a compile
# each).
SEQ_LENS = [1, 63, 127, 129, 1000, 1024]
LONG_SEQ = 4096
# A kernel compiles once per combination of its compile-time arguments and of its lengths' classes (Triton
# specializes lengths of 1, and multiples of 16, apart), and compiles are nearly all of these tests' time. So the
# default tier gives each class two combinations of head dim, causality and dtype, opposite in all three: every
# pair of values of any two of length, head dim, causality and dtype then meets in a case, at six compiles.
COMBINATIONS = {"one": [(64, False, torch.bfloat16), (128, True, torch.float16)],
                "multiple of 16": [(64, True, torch.float16), (128, False, torch.bfloat16)],
                "other": [(64, True, torch.bfloat16), (128, False, torch.float16)]}


def length_class(n: int) -> str:
    return "one" if n == 1 else "multiple of 16" if n % 16 == 0 else "other"


def _causal_id(is_causal: bool) -> str:
    return "causal" if is_causal else "full"


def _reference_params() -> list:
    """(seq, d, is_causal, dtype): the grid of SEQ_LENS tiered by COMBINATIONS, and LONG_SEQ's in the slow tier."""
    dimensions = (SEQ_LENS, (64, 128), (False, True), (torch.bfloat16, torch.float16))
    default = [(seq, *combination) for seq in SEQ_LENS for combination in COMBINATIONS[length_class(seq)]]
    cases = tiered_as(list(itertools.product(*dimensions)), default)
    cases += [(case, [pytest.mark.slow]) for case in itertools.product([LONG_SEQ], *dimensions[1:])]
    return [pytest.param(*case, marks=marks, id=f"{case[0]}-{case[1]}-{_causal_id(case[2])}-{case[3]}")
            for case, marks in cases]


def _apply(q, k, v, is_causal):
    return BACKENDS["gluon"](q, k, v, is_causal)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("seq, d, is_causal, dtype", _reference_params())
def test_gluon_matches_reference(seq, d, is_causal, dtype):
    heads = 1 if seq >= LONG_SEQ else 3
    case = Case(2, heads, seq, seq, d, is_causal, dtype, "contiguous", seed=seq * d + is_causal)
    check_against_reference(_apply, case, torch.device("cuda"))


# Each case's head dim, causality and dtype are among COMBINATIONS' for its lengths, so that it compiles nothing
# that test_gluon_matches_reference's default cases do not, but a Triton backward of strided rows.
@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("case", [
    Case(1, 2, 129, 1000, 128, False, torch.float16, "transposed", 1),  # more keys than queries
    Case(1, 2, 1000, 129, 64, True, torch.bfloat16, "sliced", 2),  # more queries than keys
    Case(3, None, 200, 300, 128, False, torch.float16, "transposed", 3),  # (batch, seq, d)
    Case(1, 2, 700, 700, 64, True, torch.bfloat16, "contiguous", 4, "growing"),  # the running max must carry
    Case(1, 2, 333, 333, 128, False, torch.float16, "contiguous", 5, "large"),
    Case(1, 2, 257, 257, 128, False, torch.float16, "contiguous", 6, "negative"),
    Case(1, 2, 500, 500, 64, True, torch.bfloat16, "contiguous", 7, "mixed"),
], ids=str)
def test_gluon_shapes_layouts_and_logits(case):
    check_against_reference(_apply, case, torch.device("cuda"))


def _tile_variant_params() -> list:
    """(d, block_n, num_stages, p_in_smem) over the grid, tiered pairwise: each is a compile of the forward."""
    grid = [(d, *tile, p_in_smem) for d in (64, 128) for tile in [(128, None), (64, 3), (64, 4)]
            for p_in_smem in (False, True)]
    default = [(64, 128, None, False), (128, 128, None, True), (128, 64, 3, False), (64, 64, 3, True),
               (64, 64, 4, False), (128, 64, 4, True)]
    return [pytest.param(*case, marks=marks, id="-".join(map(str, case[:3])) + ("-p_in_smem" if case[3] else
                                                                                 "-p_in_registers"))
            for case, marks in tiered_as(grid, default)]


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("d, block_n, num_stages, p_in_smem", _tile_variant_params())
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


# Each case's head dim, causality and dtype are among COMBINATIONS' for its lengths, both of each class: every pair
# of values of any two of them meets, and each backward compiles six times.
@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("backward", ["gluon", "triton"])
@pytest.mark.parametrize("case", [
    Case(1, 2, 1, 1, 64, False, torch.bfloat16, "contiguous", 10),  # lengths of one, which Triton would specialize
    Case(1, 2, 1, 1, 128, True, torch.float16, "contiguous", 18),
    Case(2, 3, 63, 63, 64, True, torch.bfloat16, "contiguous", 11),  # less than one query tile
    Case(1, 2, 129, 129, 128, False, torch.float16, "contiguous", 12),  # one past a key tile
    Case(1, 2, 1000, 1000, 64, True, torch.bfloat16, "transposed", 13),
    Case(1, 2, 129, 1000, 64, True, torch.bfloat16, "sliced", 14),  # key tiles that no query sees
    Case(1, 2, 1000, 129, 128, False, torch.float16, "contiguous", 15),  # a ragged last key tile
    Case(3, None, 208, 304, 128, False, torch.bfloat16, "contiguous", 16),  # (batch, seq, d), multiples of 16
    Case(1, 2, 496, 496, 64, True, torch.float16, "contiguous", 17, "negative"),  # exp2 overflows where masked
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


def _backward_tile_params() -> list:
    """(seq, d, block_m, num_stages, is_causal) over the grid, tiered pairwise: each tile and causality is a
    compile of the backward (127 and 1000 share one). 128-query tiles run causal over several key tiles, where a
    key tile's first query tile depends on block_m."""
    tiles = [(64, 64, 2), (64, 64, 3), (64, 128, 2), (128, 64, 2), (128, 64, 3)]
    grid = [(seq, *tile, is_causal) for seq in (127, 1000) for tile in tiles for is_causal in (False, True)]
    default = [(127, 64, 64, 2, False), (1000, 64, 64, 3, False), (127, 64, 128, 2, False), (1000, 64, 128, 2, True),
               (1000, 128, 64, 2, False), (127, 128, 64, 3, True)]
    return [pytest.param(*case, marks=marks, id="-".join(map(str, case[:4])) + f"-{_causal_id(case[4])}")
            for case, marks in tiered_as(grid, default)]


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("seq, d, block_m, num_stages, is_causal", _backward_tile_params())
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
