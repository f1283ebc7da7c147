"""The chunked cross-entropy against float64 formulas, within bounds derived from its rounding, and its memory:
one chunk's logits, never all of them.

The bounds, to first order, from the inputs as the computation sees them (rounded to the compute dtype), with
u the compute dtype's unit roundoff and u32 fp32's: a logit z = h . w is off by at most u|z| + d u32 (|h|.|w|)
(the matmul accumulates in fp32 and rounds once to the compute dtype); a row's log-sum-exp, summed over V
classes in fp32, by that row's largest logit error plus V u32; so a row's loss by e_r = twice that, and every
softmax probability by a relative e_r. A gradient is a sum of (p - onehot) / N times weights or hidden states,
rounded to the compute dtype before its matmul (u), accumulated in fp32 over V or N terms and rounded again
(u), and for the weight's gradient added up over chunks after a rounding each (u). The tests allow twice the
first-order bound, for the products of errors it leaves out.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memory_probes import cpu_peak_bytes
from systems.loss import LMHead, chunked_cross_entropy, cross_entropy

U32 = 2.0**-24
UNIT_ROUNDOFF = {torch.float32: U32, torch.bfloat16: 2.0**-8}
TOKENS, VOCAB, WIDTH = (3, 100), 1000, 48  # 300 tokens


def inputs(dtype: torch.dtype, logit_scale: float, tokens: tuple[int, ...] = TOKENS, vocab: int = VOCAB,
           width: int = WIDTH):
    """Hidden states and weights whose logits reach about +-logit_scale * 4, and targets."""
    hidden = (torch.randn(*tokens, width) * logit_scale / width**0.5).to(dtype).requires_grad_()
    weight = torch.randn(vocab, width).to(dtype).requires_grad_()
    return hidden, weight, torch.randint(vocab, tokens)


def reference(hidden, weight, targets, u: float):
    """Loss and gradients in float64, and their first-order error bounds."""
    h, w = hidden.detach().double().flatten(0, -2), weight.detach().double()
    t, n = targets.flatten(), len(targets.flatten())
    vocab, width = w.shape
    z = h @ w.T  # (N, V)
    log_norm = torch.logsumexp(z, dim=-1)
    loss = (log_norm - z.gather(-1, t[:, None]).squeeze(-1)).mean()
    g = (z - log_norm[:, None]).exp()
    g[torch.arange(n), t] -= 1
    g /= n
    logit_error = u * z.abs() + width * U32 * (h.abs() @ w.abs().T)
    row_error = 2 * (logit_error.amax(dim=-1) + vocab * U32)  # (N,)
    bounds = {"loss": row_error.mean() + U32 * loss.abs(),
              "hidden": (row_error[:, None] + 3 * u + vocab * U32) * (g.abs() @ w.abs()),
              "weight": (row_error.max() + 3 * u + n * U32) * (g.abs().T @ h.abs())}
    return {"loss": loss, "hidden": g @ w, "weight": g.T @ h}, bounds


def check(actual: dict, expected: dict, bounds: dict) -> None:
    for name, value in actual.items():
        error = (value.double().reshape(expected[name].shape) - expected[name]).abs()
        assert (error <= 2 * bounds[name]).all(), f"{name}: {(error / bounds[name]).max():.2f} of the bound"


@pytest.mark.parametrize("chunk", [7, 64, 299, 300, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_cross_entropy_matches_float64(dtype, chunk):
    """Chunk sizes that leave a shorter last chunk, one chunk, and more than the tokens; logits up to ~40."""
    hidden, weight, targets = inputs(dtype, logit_scale=10.0)
    loss = chunked_cross_entropy(hidden, weight, targets, chunk)
    loss.backward()
    assert loss.dtype == torch.float32 and hidden.grad.dtype == dtype and weight.grad.dtype == dtype
    expected, bounds = reference(hidden, weight, targets, UNIT_ROUNDOFF[dtype])
    check({"loss": loss, "hidden": hidden.grad, "weight": weight.grad}, expected, bounds)


def test_autocast_runs_the_matmuls_in_bf16_and_returns_fp32_gradients():
    """fp32 weights and hidden states under autocast: bf16 logits, as autocast's LM head makes them."""
    hidden, weight, targets = inputs(torch.float32, logit_scale=10.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_cross_entropy(hidden, weight, targets, 64)
    loss.backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32
    rounded = [t.detach().bfloat16() for t in (hidden, weight)]
    expected, bounds = reference(*rounded, targets, UNIT_ROUNDOFF[torch.bfloat16])
    check({"loss": loss, "hidden": hidden.grad, "weight": weight.grad}, expected, bounds)


class MatmulInputs(TorchDispatchMode):
    """Records the dtypes of every matmul's tensor inputs as aten sees them, however the Python spelled it."""

    MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm,
               torch.ops.aten.mv, torch.ops.aten.dot}

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.MATMULS:
            self.dtypes.append({a.dtype for a in args if isinstance(a, torch.Tensor)})
        return func(*args, **(kwargs or {}))


def test_autocast_runs_every_matmul_in_bf16_forward_and_backward():
    """The bound above cannot tell bf16 matmuls from fp32 ones (fp32 is more exact still): the matmuls themselves
    must see bf16. Forward: one per chunk of 64 of the 300 tokens, 5; backward: each chunk's logits again, its
    hidden states' gradient and its weight gradient, 15."""
    hidden, weight, targets = inputs(torch.float32, logit_scale=10.0)
    with torch.autocast("cpu", dtype=torch.bfloat16), MatmulInputs() as forward:
        loss = chunked_cross_entropy(hidden, weight, targets, 64)
    with MatmulInputs() as backward:
        loss.backward()
    assert len(forward.dtypes) == 5 and len(backward.dtypes) == 15
    assert all(dtypes == {torch.bfloat16} for dtypes in forward.dtypes + backward.dtypes), (forward.dtypes,
                                                                                            backward.dtypes)


def test_whole_logits_cross_entropy_matches_float64():
    """The loss without chunks: the same bound, where only the loss's own rounding differs."""
    hidden, weight, targets = inputs(torch.float32, logit_scale=10.0)
    loss = cross_entropy(hidden @ weight.T, targets)
    loss.backward()
    expected, bounds = reference(hidden, weight, targets, U32)
    check({"loss": loss, "hidden": hidden.grad, "weight": weight.grad}, expected, bounds)


def test_lm_head_returns_logits_or_the_loss():
    head = LMHead(WIDTH, VOCAB)
    hidden, _, targets = inputs(torch.float32, logit_scale=1.0)
    logits = head(hidden)
    assert logits.shape == (*TOKENS, VOCAB)
    assert torch.equal(head(hidden, targets), cross_entropy(logits, targets))
    assert torch.equal(head(hidden, targets, 64), chunked_cross_entropy(hidden, head.weight, targets, 64))


def test_no_targets_and_no_chunk_are_errors():
    hidden, weight, _ = inputs(torch.float32, logit_scale=1.0)
    with pytest.raises(ValueError, match="at least one target"):
        chunked_cross_entropy(hidden[:, :0], weight, torch.zeros(3, 0, dtype=torch.int64), 8)
    with pytest.raises(ValueError, match="positive number of tokens"):
        chunked_cross_entropy(hidden, weight, torch.zeros(*TOKENS, dtype=torch.int64), 0)


@pytest.mark.parametrize("chunk", [2.5, True, "64", 64.0])
def test_a_chunk_that_is_not_an_int_is_an_error(chunk):
    hidden, weight, targets = inputs(torch.float32, logit_scale=1.0)
    with pytest.raises(TypeError, match=f"^chunk must be a positive int, a number of tokens, got {chunk!r}"):
        chunked_cross_entropy(hidden, weight, targets, chunk)


def whole(hidden, weight, targets):
    return cross_entropy(hidden @ weight.T, targets)


def chunked(hidden, weight, targets):
    return chunked_cross_entropy(hidden, weight, targets, 64)


@pytest.mark.parametrize("loss", [whole, chunked])
@pytest.mark.parametrize("drop", [0, 1], ids=["one-row-fewer", "one-position-fewer"])
def test_targets_must_label_every_row(loss, drop):
    """(3, 99) or (2, 100) targets for (3, 100) rows would otherwise average over the rows they share."""
    hidden, weight, targets = inputs(torch.float32, logit_scale=1.0)
    short = targets[:2] if drop == 0 else targets[:, :99]
    with pytest.raises(ValueError, match=rf"one id per row of the .*: \(3, 100\), got targets of shape "
                                         rf"\({short.shape[0]}, {short.shape[1]}\)"):
        loss(hidden, weight, short)


@pytest.mark.parametrize("loss", [whole, chunked])
@pytest.mark.parametrize("dtype", [torch.int32, torch.float32])
def test_targets_must_be_int64_ids(loss, dtype):
    hidden, weight, targets = inputs(torch.float32, logit_scale=1.0)
    with pytest.raises(TypeError, match=f"^targets must be int64 class ids, got {dtype}$"):
        loss(hidden, weight, targets.to(dtype))


def test_chunked_weight_must_match_the_hidden_width():
    hidden, weight, targets = inputs(torch.float32, logit_scale=1.0)
    with pytest.raises(ValueError, match=rf"weight must be \(vocab, d_model\) with d_model={WIDTH}.*\({VOCAB}, "
                                         rf"{WIDTH - 1}\)"):
        chunked_cross_entropy(hidden, weight[:, 1:], targets, 64)


def test_peak_memory_is_one_chunks_logits_not_all():
    """Forward and backward hold a few (chunk, vocab) fp32 tensors at once (the logits, log-sum-exp's exp, the
    softmax made in place), beside the gradients (hidden's; the weight's fp32 sum and one chunk's term) and
    two fp32 values per token: far below the (tokens, vocab) logits of the whole."""
    tokens, vocab, width, chunk = 4096, 1024, 32, 128
    hidden = torch.randn(tokens, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    targets = torch.randint(vocab, (tokens,))
    peak = cpu_peak_bytes(lambda: chunked_cross_entropy(hidden, weight, targets, chunk).backward())
    chunk_logits, all_logits = 4 * chunk * vocab, 4 * tokens * vocab
    gradients = hidden.nbytes + 2 * weight.nbytes + 2 * 4 * tokens
    assert peak <= 3 * chunk_logits + gradients
    assert peak < all_logits / 8
