"""FlashAttention-2 against attention written out in float64: outputs, log-sum-exp and all three gradients."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings

from attention_cases import (DTYPES, SCORES, Case, cases, check_against_reference,  # noqa: F401 (a fixture)
                             flash_triton)
from systems.attention import FlashAttentionPytorch, attention_reference, flash_attention
from systems.loss import cross_entropy
from systems.model import TransformerLM, get_config
from systems.step import random_batch

# The Triton kernels compute scores, exp2s and rows of dK and dV that they then mask out or never store (past
# the diagonal, at padding keys): with extreme logits these overflow, harmlessly, and the interpreter's NumPy
# says so. The results are checked.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

@settings(deadline=None)
@given(case=cases(max_seq=160, dtypes=DTYPES))
def test_pytorch_matches_reference(case):
    check_against_reference(FlashAttentionPytorch.apply, case, torch.device("cpu"))


@settings(deadline=None)
@given(case=cases(max_seq=48, dtypes=[torch.float32, torch.float16], head_dims=[16, 24, 40], heads=[None, 1, 2]))
def test_triton_interpreter_matches_reference(flash_triton, case):
    # The interpreter's bf16 tl.dot is wrong, so bf16 runs on the GPU only; seq 48 still spans several tiles. It
    # runs each program in Python, so two heads at most: heads and batches of unequal counts are left to
    # test_attention_launch.py's launch orders.
    if torch.cuda.is_available():
        pytest.skip("with a GPU the Triton kernels are tested on it")
    check_against_reference(flash_triton.apply, case, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.slow
@settings(deadline=None)
@given(case=cases(max_seq=700, dtypes=DTYPES))
def test_triton_matches_reference_on_gpu(flash_triton, case):
    # Nearly every example is a compile of each kernel (for its dtype, head dim, causality and the classes of its
    # lengths and strides), a few seconds each: the default tier's sibling is the next test.
    check_against_reference(flash_triton.apply, case, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    Case(2, None, 300, 177, 40, True, torch.bfloat16, "transposed", 21, "mixed"),
    Case(1, 3, 129, 650, 128, False, torch.float16, "sliced", 22, "negative"),
    Case(2, 1, 1, 1, 64, True, torch.float32, "contiguous", 23),
    Case(1, 2, 160, 96, 16, True, torch.bfloat16, "contiguous", 24, "growing"),
], ids=str)
def test_triton_matches_reference_on_gpu_cases(flash_triton, case):
    """The fuzz's values, each in a case, at four compiles: every dtype (bf16 runs on the GPU only), head dims
    padded (40) and not, each layout, (batch, seq, d) and 1 to 3 heads, causal and not, lengths of one, multiples
    of 16 and others, more queries than keys and fewer, and the logits' spreads (fp32's in the next test)."""
    check_against_reference(flash_triton.apply, case, torch.device("cuda"))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("scores", SCORES[1:])
@pytest.mark.parametrize("implementation", ["pytorch", "triton"])
def test_online_softmax_under_extreme_logits(request, device, implementation, scores, is_causal):
    """Large, growing, mixed-scale and negative logits over several key tiles: the running maximum must be
    carried, what was summed under an older one rescaled, and nothing overflow. (fp32: plain PyTorch is exact
    enough there to tell.)"""
    if implementation == "pytorch":  # 64-key tiles
        apply, case = FlashAttentionPytorch.apply, Case(2, 2, 150, 230, 32, is_causal, torch.float32, "sliced", 3)
    else:  # 16-key forward tiles under the interpreter, kept short for it; three sequences keep the keys unsplit
        apply = request.getfixturevalue("flash_triton").apply
        case = Case(1, 3, 40, 56, 24, is_causal, torch.float32, "sliced", 3)
    check_against_reference(apply, replace(case, scores=scores), device)


# From 2048 keys the kernels time their candidate tiles, a compile each: the default tier's siblings are the cases
# above, test_attention_launch.py's tile search and its split keys.
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("case", [
    Case(1, None, 16384, 16384, 64, True, torch.bfloat16, "contiguous", 0),
    Case(1, 2, 4097, 6001, 80, False, torch.float16, "transposed", 1),
    Case(2, 1, 2000, 1500, 128, True, torch.float32, "sliced", 2),
], ids=str)
def test_triton_long_sequences(flash_triton, case):
    check_against_reference(flash_triton.apply, case, torch.device("cuda"))


def _qkv(q_shape=(2, 8, 16), k_shape=None, dtype=torch.float32, k_dtype=None, k_device="cpu"):
    k_shape = k_shape or q_shape
    q = torch.randn(q_shape, dtype=dtype)
    k = torch.randn(k_shape, dtype=k_dtype or dtype, device=k_device)
    return q, k, k.clone()


BAD_INPUTS = {
    "batch mismatch": (_qkv(k_shape=(1, 8, 16)), ValueError, "batch/head dims"),  # would broadcast
    "heads mismatch": (_qkv((2, 4, 8, 16), (2, 1, 8, 16)), ValueError, "batch/head dims"),
    "head dim mismatch": (_qkv(k_shape=(2, 8, 24)), ValueError, "head dims"),
    "3d with 4d": (_qkv(k_shape=(2, 1, 8, 16)), ValueError, r"\(batch, seq, d\)"),
    "dtypes differ": (_qkv(k_dtype=torch.float16), TypeError, "share a dtype"),
    "float64": (_qkv(dtype=torch.float64), TypeError, "supported"),
    "devices differ": (_qkv(k_device="meta"), ValueError, "one device"),
    "empty queries": (_qkv((2, 0, 16), (2, 8, 16)), ValueError, "empty"),
    "empty keys": (_qkv((2, 8, 16), (2, 0, 16)), ValueError, "empty"),
    "not a tensor": (((torch.randn(2, 8, 16), [[1.0]], torch.randn(2, 8, 16))), TypeError, "torch.Tensor"),
}


IMPLEMENTATIONS = ("reference", "pytorch", "triton")


@pytest.mark.parametrize("implementation, bad", [
    pytest.param(implementation, bad, id=f"{implementation}-{name}")
    for implementation in IMPLEMENTATIONS for name, bad in BAD_INPUTS.items()
    if (implementation, name) != ("reference", "float64")  # the reference computes tests' float64 answers
])
def test_bad_inputs_raise_clear_errors(request, implementation, bad):
    (q, k, v), error, match = bad
    apply = {"reference": attention_reference, "pytorch": FlashAttentionPytorch.apply}.get(implementation)
    if implementation == "triton":
        apply = request.getfixturevalue("flash_triton").apply
    with pytest.raises(error, match=match):
        apply(q, k, v, False)

def test_flash_attention_uses_triton_on_cuda_and_pytorch_elsewhere(device):
    q = torch.randn(1, 2, 8, 16, device=device, requires_grad=True)
    backend = type(flash_attention(q, q, q).grad_fn).__name__
    assert backend == ("FlashAttentionTritonBackward" if device.type == "cuda" else "FlashAttentionPytorchBackward")


def test_model_with_flash_backend_matches_naive(device, exact_fp32_matmuls):
    naive = TransformerLM(get_config("tiny", attention="naive")).to(device)
    flash = TransformerLM(get_config("tiny", attention="flash")).to(device)
    flash.load_state_dict(naive.state_dict())
    tokens, targets = random_batch(naive.config, 2, 93, device)
    logits = {}
    for name, model in (("naive", naive), ("flash", flash)):
        logits[name] = model(tokens)
        cross_entropy(logits[name], targets).backward()
    torch.testing.assert_close(logits["flash"], logits["naive"], rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(naive.named_parameters(), flash.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5, msg=name)

