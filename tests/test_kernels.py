"""The fused Triton kernels (systems.kernels) against the model's eager modules in float64, forward and backward,
within bounds derived from their rounding; under Triton's interpreter on a CPU (fp32 and fp16: the interpreter
rounds bf16 otherwise than a GPU does), on a GPU where there is one.

The bounds are first order, with u the output dtype's unit roundoff and u32 fp32's, and the tests allow twice them,
for the products of errors they leave out (as tests/test_loss.py does). Inputs are exact in their dtype, so the
float64 reference sees what the kernels see; sizes are odd (widths not a power of two, a partial last tile).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from plain_error import check_near_plain
from test_loss import U32, check, inputs, reference
from systems.loss import chunked_cross_entropy
from systems.model import Fused, RMSNorm, RotaryEmbedding, TransformerLM, get_config
from systems.step import random_batch

kernels = pytest.importorskip("systems.kernels", reason="needs Triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
LOG2E = 1 / math.log(2)


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def rounding(dtype: torch.dtype, values: torch.Tensor) -> torch.Tensor:
    """How far rounding to `dtype` moves values: half an ulp, which below the normal range (fp16's products of
    small weights) is half the subnormals' fixed spacing."""
    info = torch.finfo(dtype)
    return unit_roundoff(dtype) * values.abs() + info.smallest_normal * info.eps / 2


def within(name: str, actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> None:
    error = (actual.double() - expected).abs()
    assert (error <= 2 * bound).all(), f"{name}: {(error / bound).max():.2f} of the first-order bound"


def fresh(*shape, dtype, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("width", [40, 64, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_the_module_in_float64(dtype, width):
    """Rows scaled from 1e-3 to 10: mean(x²) from below eps = 1e-5 to far above it, so eps added in another place
    than under the root fails. Forward: the fp32 sum of `width` squares errs by width·u32 relative, the root,
    its reciprocal and the two products by a u32 each, then y is rounded once (u). Backward, with x̂ = x / rms and
    g = w·dy: dx = (g - x̂·mean(x̂ g)) / rms errs by (width + 8)·u32 of the sizes of its terms; dweight sums
    dy·x̂ over the rows in fp32 ((rows + 4)·u32 of the sum of sizes) and is rounded to its dtype."""
    norm = RMSNorm(width).double()
    norm.weight.data.normal_()
    scales = torch.logspace(-3, 1, 7).view(7, 1)
    x = (torch.randn(3, 7, width) * scales).to(device=DEVICE, dtype=dtype).requires_grad_()
    weight = norm.weight.detach().to(device=DEVICE, dtype=dtype).requires_grad_()
    y = kernels.rms_norm(x, weight, norm.eps)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert y.dtype == x.grad.dtype == weight.grad.dtype == dtype

    x64, dy64 = x.detach().cpu().double().requires_grad_(), dy.cpu().double()
    norm.weight.data = weight.detach().cpu().double()
    y64 = norm(x64)
    y64.backward(dy64)
    rows = x64[..., 0].numel()
    rstd = (x64.detach().pow(2).mean(-1, keepdim=True) + norm.eps).rsqrt()
    x_hat, g = x64.detach() * rstd, dy64 * norm.weight.detach()
    within("y", y.cpu(), y64.detach(), rounding(dtype, y64.detach()) + (width / 2 + 6) * U32 * y64.detach().abs())
    dx_terms = rstd * (g.abs() + x_hat.abs() * (x_hat * g).abs().mean(-1, keepdim=True))
    within("dx", x.grad.cpu(), x64.grad, rounding(dtype, x64.grad) + (width + 8) * U32 * dx_terms)
    dw_terms = (dy64 * x_hat).abs().flatten(0, -2).sum(0)
    dweight_bound = rounding(dtype, norm.weight.grad) + (rows + 4) * U32 * dw_terms
    within("dweight", weight.grad.cpu(), norm.weight.grad, dweight_bound)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_matches_eager_in_float64(dtype):
    """a spread to |a| ~ 15, where silu saturates; 3·7·45 elements, not a whole number of tiles. silu(a) b in fp32:
    exp(-a) as exp2(-a·log2e) errs by (|a|·log2e + 2)·u32 relative, the sigmoid and two products by a u32 each,
    rounded once (u). The gradients da = g b s (1 + a (1 - s)) and db = g a s likewise, of their terms' sizes."""
    a = fresh(3, 7, 45, dtype=dtype, scale=4.0).requires_grad_()
    b = fresh(3, 7, 45, dtype=dtype).requires_grad_()
    out = kernels.silu_mul(a, b)
    g = torch.randn_like(out)
    out.backward(g)
    assert out.dtype == a.grad.dtype == b.grad.dtype == dtype

    a64, b64 = (t.detach().cpu().double().requires_grad_() for t in (a, b))
    out64 = F.silu(a64) * b64
    g64 = g.cpu().double()
    out64.backward(g64)
    da64, db64 = a64.grad, b64.grad
    a64, b64, out64 = a64.detach(), b64.detach(), out64.detach()
    s = torch.sigmoid(a64)
    exp_error = (a64.abs() * LOG2E + 2) * U32
    within("out", out.cpu(), out64, rounding(dtype, out64) + (exp_error + 3 * U32) * out64.abs())
    da_terms = (g64 * b64).abs() * s * (1 + a64.abs() * (1 - s))
    within("da", a.grad.cpu(), da64, rounding(dtype, da64) + (exp_error + 8 * U32) * da_terms)
    within("db", b.grad.cpu(), db64, rounding(dtype, db64) + (exp_error + 4 * U32) * (g64 * a64 * s).abs())


@pytest.mark.parametrize("d_head", [12, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotate_qk_matches_the_module_in_float64(dtype, d_head):
    """q and k as the model makes them, views of one (batch, seq, 3, heads, d_head) projection; 11 positions, a
    partial last tile of positions, and 6 pairs (12 features) padded to 8. Each output is a difference of two fp32
    products (2·u32 of their sizes), rounded once (u); the backward is the same rotation by minus the angle."""
    rope = RotaryEmbedding(d_head, context_length=16, theta=500.0)
    qkv = fresh(2, 11, 3, 3, d_head, dtype=dtype)
    q, k, _ = (t.detach().requires_grad_() for t in qkv.permute(2, 0, 3, 1, 4))
    q_out, k_out = kernels.rotate_qk(q, k, rope.cos.to(DEVICE), rope.sin.to(DEVICE))
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    torch.autograd.backward((q_out, k_out), (dq_out, dk_out))
    assert q_out.dtype == k_out.dtype == q.grad.dtype == dtype

    rope64 = rope.double()  # the fp32 tables, exactly
    for name, x, out, grad_out in (("q", q, q_out, dq_out), ("k", k, k_out, dk_out)):
        x64 = x.detach().cpu().double().requires_grad_()
        out64 = rope64(x64)
        out64.backward(grad_out.cpu().double())
        out_bound = rounding(dtype, out64.detach()) + 2 * U32 * pair_sizes(rope64, x64.detach())
        within(name, out.cpu(), out64.detach(), out_bound)
        grad_bound = rounding(dtype, x64.grad) + 2 * U32 * pair_sizes(rope64, grad_out.cpu().double())
        within(f"d{name}", x.grad.cpu(), x64.grad, grad_bound)


def pair_sizes(rope: RotaryEmbedding, x: torch.Tensor) -> torch.Tensor:
    """|even cos| + |odd sin| and |even sin| + |odd cos| at each feature: the sizes of a rotation's two products."""
    seq = x.shape[-2]
    cos, sin = rope.cos[:seq].abs(), rope.sin[:seq].abs()
    even, odd = x[..., 0::2].abs(), x[..., 1::2].abs()
    return torch.stack((even * cos + odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


@pytest.mark.parametrize("chunk", [8, 22, 100])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_cross_entropy_matches_float64(dtype, chunk):
    """The chunked loss with its softmax in the kernels: chunks leaving a shorter last one, one chunk, more than the
    tokens; a vocabulary of 300 (tiles of 128 under the interpreter, the last partial). The logits are the same
    matmul's as the eager chunked loss's, and the softmax is fp32 with the same sums over the vocabulary, tile by
    tile: tests/test_loss.py's bound holds, with fp16's underflow added: a logit's gradient p / tokens below its
    normal range rounds to the subnormals' spacing, which the gradients' matmuls sum over the vocabulary (hidden)
    or the tokens (weight)."""
    hidden, weight, targets = inputs(dtype, logit_scale=10.0, tokens=(2, 11), vocab=300, width=24)
    hidden, weight = (t.detach().to(DEVICE).requires_grad_() for t in (hidden, weight))
    loss = chunked_cross_entropy(hidden, weight, targets.to(DEVICE), chunk, fused=True)
    loss.backward()
    assert loss.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == dtype
    expected, bounds = reference(hidden.cpu(), weight.cpu(), targets, unit_roundoff(dtype))
    info = torch.finfo(dtype)
    underflow = info.smallest_normal * info.eps / 2
    bounds["hidden"] = bounds["hidden"] + underflow * (1 + weight.detach().cpu().double().abs().sum(0))
    bounds["weight"] = bounds["weight"] + underflow * (1 + hidden.detach().cpu().double().abs().flatten(0, -2).sum(0))
    check({"loss": loss.cpu(), "hidden": hidden.grad.cpu(), "weight": weight.grad.cpu()}, expected, bounds)


def norm_inputs() -> tuple:
    return fresh(3, 5, 40, dtype=torch.float32), fresh(40, dtype=torch.float32), 1e-5


def norm_gradient_inputs() -> tuple:
    x, weight, eps = norm_inputs()
    _, rstd = kernels.rmsnorm.rms_norm_forward(x, weight, eps)
    return x, weight, rstd, torch.randn_like(x)


def silu_inputs(count: int) -> tuple:
    return tuple(fresh(3, 45, dtype=torch.float32) for _ in range(count))


def rope_inputs() -> tuple:
    """q and k as the model makes them, views of one (batch, seq, 3, heads, d_head) projection."""
    q, k, _ = fresh(2, 3, 3, 2, 12, dtype=torch.float32).permute(2, 0, 3, 1, 4)
    rope = RotaryEmbedding(12, context_length=16, theta=500.0).to(DEVICE)
    return q, k, rope.cos, rope.sin


def logits_inputs() -> tuple:
    return fresh(7, 300, dtype=torch.float32), torch.randint(300, (7,), device=DEVICE)


def logit_gradient_inputs() -> tuple:
    logits, targets = logits_inputs()
    lse, _ = kernels.cross_entropy_rows(logits, targets)
    return logits, targets, lse, torch.tensor(0.5, device=DEVICE)


# Each custom op's inputs, fresh and of odd sizes, as its autograd Function passes them.
CUSTOM_OP_INPUTS = {"rms_norm_forward": norm_inputs, "rms_norm_backward": norm_gradient_inputs,
                    "silu_mul_forward": lambda: silu_inputs(2), "silu_mul_backward": lambda: silu_inputs(3),
                    "rope_forward": rope_inputs, "rope_backward": rope_inputs,
                    "cross_entropy_rows": logits_inputs, "cross_entropy_logit_gradients_": logit_gradient_inputs}


@pytest.mark.parametrize("name", CUSTOM_OP_INPUTS)
def test_custom_ops_describe_their_outputs(name):
    """torch.library.opcheck: the schema, the fake implementation's outputs (shapes, dtypes, strides) against the
    real ones, and the op under AOT autograd, as torch.compile runs it."""
    torch.library.opcheck(getattr(torch.ops.systems, name), CUSTOM_OP_INPUTS[name]())


def test_the_kernels_compile_into_one_graph():
    """Every autograd Function of systems.kernels inside one torch.compile graph (fullgraph: a graph break fails),
    forward and backward, giving what eager gives (aot_eager runs the same ops: the same values)."""
    rope = RotaryEmbedding(8, context_length=16, theta=500.0).to(DEVICE)

    def step(x, weight, qkv, a, b, hidden, head, targets):
        q, k, _ = qkv.permute(2, 0, 3, 1, 4)
        q, k = kernels.rotate_qk(q, k, rope.cos, rope.sin)
        return (kernels.rms_norm(x, weight, 1e-5).sum() + q.sum() + 2 * k.sum() + kernels.silu_mul(a, b).sum()
                + chunked_cross_entropy(hidden, head, targets, 5, fused=True))

    shapes = [(2, 3, 40), (40,), (2, 5, 3, 2, 8), (3, 45), (3, 45), (12, 8), (30, 8)]
    args = [fresh(*shape, dtype=torch.float32).requires_grad_() for shape in shapes]
    args.append(torch.randint(30, (12,), device=DEVICE))
    expected = step(*args)
    expected_grads = torch.autograd.grad(expected, args[:-1])
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    assert torch.equal(compiled, expected)
    assert all(map(torch.equal, torch.autograd.grad(compiled, args[:-1]), expected_grads))


@pytest.mark.parametrize("call, error, match", [
    (lambda: kernels.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5), ValueError, "weight of x's last dimension"),
    (lambda: kernels.rms_norm(torch.randn(2, 8), torch.randn(8), 0), ValueError, "eps must be a positive float"),
    (lambda: kernels.rms_norm(torch.randn(2, 32768), torch.randn(32768), 1e-5), ValueError, "exceeds"),
    (lambda: kernels.silu_mul(torch.randn(2, 8), torch.randn(2, 9)), ValueError, "one shape and dtype"),
    (lambda: kernels.silu_mul(torch.randn(2, 8), torch.randn(2, 8).half()), ValueError, "one shape and dtype"),
    (lambda: kernels.rotate_qk(torch.randn(1, 2, 4, 6), torch.randn(1, 2, 4, 6), torch.randn(3, 3),
                               torch.randn(3, 3)), ValueError, "context >= 4"),
    (lambda: kernels.rotate_qk(torch.randn(1, 2, 4, 5), torch.randn(1, 2, 4, 5), torch.randn(8, 2),
                               torch.randn(8, 2)), ValueError, "d_head must be even"),
    (lambda: kernels.cross_entropy_rows(torch.randn(4, 9), torch.randint(9, (4,), dtype=torch.int32)), TypeError,
     "int64"),
    (lambda: kernels.cross_entropy_rows(torch.randn(9, 4).T, torch.randint(4, (4,))), ValueError, "unit stride"),
], ids=["norm-width", "norm-eps", "norm-too-wide", "silu-shape", "silu-dtype", "rope-table", "rope-odd",
        "ce-targets", "ce-layout"])
def test_bad_inputs_are_clear_errors(call, error, match):
    if DEVICE.type == "cuda":
        pytest.skip("the inputs are CPU tensors, which a GPU run refuses before the check made here")
    with pytest.raises(error, match=match):
        call()


@pytest.mark.gpu
def test_fused_loss_holds_one_chunk_of_logits_in_the_compute_dtype():
    """The fused loss's forward holds a chunk's bf16 logits and nothing more of the vocabulary's size; eager's the
    fp32 copy of them and log-sum-exp's fp32 exponentials besides. (The CPU cannot say: Triton's interpreter copies
    its arguments.)"""
    tokens, vocab, width, chunk = 8192, 32768, 256, 1024
    hidden = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(vocab, width, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(vocab, (tokens,), device="cuda")

    def forward_peak(fused: bool) -> int:
        chunked_cross_entropy(hidden, weight, targets, chunk, fused=fused)  # cuBLAS's workspace, Triton's compile
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        chunked_cross_entropy(hidden, weight, targets, chunk, fused=fused)
        return torch.cuda.max_memory_allocated() - before

    chunk_logits = chunk * vocab * 2
    per_token = 4 * 4 * tokens  # log-sum-exp and loss, and the chunks' (no more than the tokens)
    assert forward_peak(fused=True) <= chunk_logits + per_token
    assert forward_peak(fused=False) >= 2 * 2 * chunk_logits  # fp32 logits and exponentials at once


# A model as small as the kernels' tests: heads of 8 features (4 pairs), a SwiGLU width and a vocabulary that are
# not powers of two, chunks of the loss that leave a shorter last one.
SMALL = get_config("tiny", d_model=32, num_heads=4, d_ff=88, vocab_size=101, num_layers=1, context_length=16,
                   loss_chunk=7)


def loss_and_grads(model, tokens, targets) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = model(tokens, targets)
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters())]


def test_the_fused_model_matches_the_eager_one():
    """Every kernel's model against the eager model in float64, within tests/plain_error.py's rule of the eager
    fp32 model's error. A fused op wired wrongly (the other norm's weight, k left unrotated, the loss without its
    chunks) is off by far more."""
    eager = TransformerLM(SMALL).to(DEVICE)
    model = TransformerLM(dataclasses.replace(SMALL, fused=Fused.ALL)).to(DEVICE)
    model.load_state_dict(eager.state_dict())
    reference = TransformerLM(SMALL).to(DEVICE).double()
    reference.load_state_dict(eager.state_dict())
    tokens, targets = random_batch(SMALL, 2, 9, DEVICE)
    check_near_plain(loss_and_grads(model, tokens, targets), loss_and_grads(eager, tokens, targets),
                     loss_and_grads(reference, tokens, targets))


@pytest.mark.parametrize("fused", list(Fused), ids=str)
def test_each_lever_fuses_its_ops_only(fused):
    """`fused` names the modules that run a kernel: all of them, none, or one kind."""
    model = TransformerLM(dataclasses.replace(SMALL, fused=fused))
    block = model.blocks[0]
    running = {"rmsnorm": [block.attn_norm.fused, block.ffn_norm.fused, model.final_norm.fused],
               "rope": [block.attn.fused_rope], "swiglu": [block.ffn.fused], "loss": [model.lm_head.fused]}
    for op, flags in running.items():
        assert flags == [fused in (Fused.ALL, Fused(op))] * len(flags), op
