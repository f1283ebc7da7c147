"""FlashAttention-2 against attention written out in float64: outputs, log-sum-exp and all three gradients."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from systems.attention import FlashAttentionPytorch, attention_reference, flash_attention
from systems.loss import cross_entropy
from systems.model import TransformerLM, get_config
from systems.step import random_batch

# The Triton kernels compute scores, exp2s and rows of dK and dV that they then mask out or never store (past
# the diagonal, at padding keys): with extreme logits these overflow, harmlessly, and the interpreter's NumPy
# says so. The results are checked.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

# Each quantity's error against float64 may be PLAIN_ERROR_MULTIPLE times that of attention written out in the
# input dtype (attention_reference, autograd for the gradients: what plain PyTorch gives), as flash-attn's
# tests allow: room for another order of the same sums (tiles, an online softmax), none for an error of another
# order. Plain PyTorch rounds P, dS and its outputs to the input dtype as the kernels do, so its error covers
# theirs; what it can avoid by luck is the fp32 error of the kernels' other order of sums. E.g. dQ and dK when
# each query sees one key: the softmax is 1 and autograd's dS = P(dP - sum(P dP)) is exactly 0, where the
# kernels' D = rowsum(O dO) and dP = dO vᵀ are two fp32 sums that differ by rounding; and FlashAttention-2
# takes D from O as stored, rounded to the input dtype, where autograd sums P dP. So a floor adds FLOOR_ULPS
# fp32 roundings of every term and the rounding of O in D (rounding_floor), plus half an ulp of the input dtype at the largest
# element, for the final rounding of a value that fp32 error has moved across a rounding boundary.
PLAIN_ERROR_MULTIPLE = 3
# fp32 roundings per term in the floor: a product, its sum and a rescale or two; on a GPU fp32 dots run as
# 3xTF32, which keeps 22 of fp32's 24 significant bits (2 ulps an operand).
FLOOR_ULPS = 4
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = list(range(16, 129, 8))
LAYOUTS = ("contiguous", "sliced", "transposed")
# How the logits are spread, for the online softmax's running maximum: "large" scales q and k by 8 (scores
# about N(0, 64²)); "growing" makes each row's scores rise along the keys by about GROWTH, past the
# exp's fp32 range (88), so a maximum that is not carried overflows; "mixed" scales each query row by 0.1 to 30;
# "negative" puts every score far below 0 (L ≪ 0: exp(0 - L) overflows, as at a padded key).
SCORES = ("normal", "large", "growing", "mixed", "negative")
GROWTH = 200.0
ROOT = pathlib.Path(__file__).resolve().parents[1]


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
def cases(draw, max_seq: int, dtypes: list[torch.dtype], head_dims: list[int] = HEAD_DIMS) -> Case:
    return Case(batch=draw(st.integers(1, 2)), heads=draw(st.sampled_from([None, 1, 3])),
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
    each summed in fp32, D from O rounded to the input dtype. Then O = P v, dV = Pᵀ dO, dQ = dS k/√d and dK = dSᵀ q/√d, every factor by its
    absolute value.
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


@settings(deadline=None)
@given(case=cases(max_seq=160, dtypes=DTYPES))
def test_pytorch_matches_reference(case):
    check_against_reference(FlashAttentionPytorch.apply, case, torch.device("cpu"))


@settings(deadline=None)
@given(case=cases(max_seq=48, dtypes=[torch.float32, torch.float16], head_dims=[16, 24, 40]))
def test_triton_interpreter_matches_reference(flash_triton, case):
    # The interpreter's bf16 tl.dot is wrong, so bf16 runs on the GPU only; seq 48 still spans several tiles.
    if torch.cuda.is_available():
        pytest.skip("with a GPU the Triton kernels are tested on it")
    check_against_reference(flash_triton.apply, case, torch.device("cpu"))


@pytest.mark.gpu
@settings(deadline=None)
@given(case=cases(max_seq=700, dtypes=DTYPES))
def test_triton_matches_reference_on_gpu(flash_triton, case):
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
    else:  # 16-key forward tiles under the interpreter, kept short for it
        apply = request.getfixturevalue("flash_triton").apply
        case = Case(2, 2, 40, 72, 24, is_causal, torch.float32, "sliced", 3)
    check_against_reference(apply, replace(case, scores=scores), device)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_triton_attention_takes_new_shapes_without_graph_breaks(flash_triton, device, fresh_dynamo):
    """torch.compile(fullgraph=True) through three sequence lengths: no graph break, and after the second
    (where Dynamo makes the sizes symbolic) no recompile, with the same results as the eager calls."""
    # On the CPU, Dynamo and AOTAutograd (aot_eager) trace what inductor would: inductor adds only code
    # generation, which there means compiling C++ for a few views around the kernels, for tens of seconds.
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(flash_triton.apply, fullgraph=True, backend=backend)
    for seq in (24, 40, 56):
        case = Case(2, 2, seq, seq + 8, 16, True, torch.float32, "transposed", seq)
        inputs = case.inputs(torch.Generator().manual_seed(case.seed), device)
        eager_inputs = [t.detach().clone().requires_grad_() for t in inputs]
        with torch._dynamo.config.patch(error_on_recompile=seq > 40):
            o = compiled(*inputs, True)
        o.backward(torch.ones_like(o))
        eager = flash_triton.apply(*eager_inputs, True)
        eager.backward(torch.ones_like(eager))
        torch.testing.assert_close(o, eager, rtol=0, atol=0)
        for t, eager_t in zip(inputs, eager_inputs, strict=True):
            torch.testing.assert_close(t.grad, eager_t.grad, rtol=0, atol=0)


def test_triton_times_the_candidate_tiles_once_per_shape(flash_triton, device, monkeypatch):
    """Where several tiles may run, a shape's first call times each and launches the fastest; later calls launch
    that one without timing again, and compute the same attention."""
    from systems.attention import triton_launch

    fastest = (16, 16, 4, 1)  # one candidate of every kernel, the others small enough for the interpreter
    candidates = {"fwd": [(32, 16, 4, 1), fastest], "dkdv": [(16, 32, 4, 1), fastest], "dq": [(32, 16, 4, 1), fastest]}
    timed, launched = [], []

    def median_ms(run, tile):
        run(tile)  # each candidate must launch
        timed.append(tile)
        return 1.0 if tile == fastest else 2.0

    class LaunchSpy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((self.name, kwargs["BLOCK_M"], kwargs["BLOCK_N"]))
                return self.kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_launch, "_tiles", lambda name, longest_seq: candidates[name])
    monkeypatch.setattr(triton_launch, "_median_ms", median_ms)
    monkeypatch.setattr(triton_launch, "_chosen", {})
    for name, kernel in triton_launch.KERNELS.items():
        monkeypatch.setitem(triton_launch.KERNELS, name, LaunchSpy(name, kernel))
    case = Case(2, 3, 40, 56, 32, True, torch.float32, "sliced", 5)
    check_against_reference(flash_triton.apply, case, device)
    assert sorted(timed) == sorted(tile for tiles in candidates.values() for tile in tiles)
    assert sorted(triton_launch._chosen.values()) == [fastest] * 3
    timed.clear()
    launched.clear()
    check_against_reference(flash_triton.apply, case, device)
    assert timed == [] and sorted(launched) == [("dkdv", 16, 16), ("dq", 16, 16), ("fwd", 16, 16)]


def test_triton_launches_as_triton_defined_the_kernels():
    """Triton chooses between compiling a kernel and interpreting it when it defines it, from TRITON_INTERPRET as
    it is then: kernels defined for a GPU refuse CPU tensors with a clear error, whatever the variable says later."""
    pytest.importorskip("triton")
    code = ("import os, torch; from systems.attention.triton_launch import FlashAttentionTriton; "
            "os.environ['TRITON_INTERPRET'] = '1'; q = torch.randn(1, 8, 16); "
            "FlashAttentionTriton.apply(q, q, q, False)")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    ran = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode != 0 and "ValueError: FlashAttentionTriton needs CUDA tensors" in ran.stderr, ran.stderr


@pytest.mark.parametrize("is_causal", [True, False])
def test_triton_splits_the_keys_when_the_grid_is_too_small(flash_triton, device, is_causal, monkeypatch):
    """One short query tile against many keys: the forward splits the keys over programs and merges them."""
    from systems.attention import triton_launch

    merge, merged = triton_launch.fwd_merge_kernel, []

    class MergeSpy:
        def __getitem__(self, grid):
            merged.append(grid)
            return merge[grid]

    monkeypatch.setattr(triton_launch, "fwd_merge_kernel", MergeSpy())
    interpreted = triton_launch.interpreted()
    min_keys = triton_launch.INTERPRETED_MIN_KEYS_PER_SPLIT if interpreted else triton_launch.MIN_KEYS_PER_SPLIT
    n_keys = 4 * min_keys + 5
    assert triton_launch._key_splits(1, 1, 40, n_keys, device) == 4
    check_against_reference(flash_triton.apply, Case(1, None, 40, n_keys, 32, is_causal, torch.float32, "sliced", 7),
                            device)
    assert len(merged) == 1  # the forward took the split path


@pytest.mark.parametrize("interleave", [True, False])
def test_triton_launch_orders_agree(flash_triton, device, interleave, monkeypatch):
    """Programs launched sequence by sequence, or with the sequences interleaved, compute the same attention."""
    from systems.attention import triton_launch

    multiple = 2**40 if interleave else 0
    monkeypatch.setattr(triton_launch, "L2_MULTIPLE_TO_INTERLEAVE", {"forward": multiple, "backward": multiple})
    q = torch.empty(3, 2, 72, 24, device=device)  # (batch, heads, seq, d)
    shape = triton_launch._shape_args(q, q, "forward")
    assert shape["INTERLEAVE"] is interleave
    assert triton_launch._grid(shape, lambda meta: 7)({}) == ((2, 3, 7) if interleave else (7, 2, 3))
    check_against_reference(flash_triton.apply, Case(3, 2, 72, 90, 24, True, torch.float32, "sliced", 11), device)


@pytest.mark.gpu
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


def test_triton_rejects_what_its_kernels_cannot_run(flash_triton, monkeypatch):
    q = torch.randn(1, 4, 8, 136)
    with pytest.raises(ValueError, match="supported maximum 128"):
        flash_triton.apply(q, q, q, False)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        flash_triton.apply(q[..., :16], q[..., :16], q[..., :16], 1)
    monkeypatch.setattr("systems.attention.triton_launch.interpreted", lambda: True)
    with pytest.raises(TypeError, match="cannot run bfloat16 under TRITON_INTERPRET=1"):
        flash_triton.apply(*[q[..., :16].bfloat16()] * 3, False)
    monkeypatch.setattr("systems.attention.triton_launch.interpreted", lambda: False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        flash_triton.apply(q[..., :16], q[..., :16], q[..., :16], False)


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
