"""How the Triton FlashAttention launches: under torch.compile, its tile choice, its split-key forward, its launch
orders, and what it refuses; each checked against attention written out in float64."""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from attention_cases import Case, check_against_reference, flash_triton  # noqa: F401 (flash_triton is a fixture)

# The Triton kernels compute scores, exp2s and rows of dK and dV that they then mask out or never store (past
# the diagonal, at padding keys): with extreme logits these overflow, harmlessly, and the interpreter's NumPy
# says so. The results are checked.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
ROOT = pathlib.Path(__file__).resolve().parents[1]


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
    # Lengths unequal to every other size (d = 16), which Dynamo would otherwise tie to them; one sequence keeps
    # the interpreter quick.
    for seq in (8, 12, 20):
        case = Case(1, None, seq, seq + 6, 16, True, torch.float32, "transposed", seq)
        inputs = case.inputs(torch.Generator().manual_seed(case.seed), device)
        eager_inputs = [t.detach().clone().requires_grad_() for t in inputs]
        with torch._dynamo.config.patch(error_on_recompile=seq > 12):
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
    case = Case(1, None, 20, 24, 16, True, torch.float32, "sliced", 5)  # more than one tile of 16 each way
    check_against_reference(flash_triton.apply, case, device)
    assert sorted(timed) == sorted(tile for tiles in candidates.values() for tile in tiles)
    assert sorted(triton_launch._chosen.values()) == [fastest] * 3
    timed.clear()
    launched.clear()
    check_against_reference(flash_triton.apply, case, device)
    assert timed == [] and sorted(launched) == [("dkdv", 16, 16), ("dq", 16, 16), ("fwd", 16, 16)]


def test_triton_launches_as_triton_defined_the_kernels(flash_triton, monkeypatch):
    """Triton chooses between compiling a kernel and interpreting it when it defines it, from TRITON_INTERPRET as
    it is then: kernels defined for a GPU refuse CPU tensors with a clear error, whatever the variable says later."""
    import triton
    from triton.runtime import KernelInterface

    from systems.attention import triton_launch

    # The module's kernels defined again as a process without the variable defines them.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for name, kernel in list(vars(triton_launch).items()):
        if isinstance(kernel, KernelInterface):
            monkeypatch.setattr(triton_launch, name, triton.jit(kernel.fn))
    for name, kernel in triton_launch.KERNELS.items():
        monkeypatch.setitem(triton_launch.KERNELS, name, triton.jit(kernel.fn))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.randn(1, 8, 16)
    with pytest.raises(ValueError, match="FlashAttentionTriton needs CUDA tensors"):
        flash_triton.apply(q, q, q, False)


@pytest.mark.slow
def test_triton_launches_as_triton_defined_the_kernels_in_a_fresh_process():
    """As above, with the kernels defined by importing them in a process without TRITON_INTERPRET."""
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
    # One tile, as below TUNE_FROM_SEQ: the keys reach it on a GPU, where timing the candidate tiles would compile
    # each (test_triton_times_the_candidate_tiles_once_per_shape checks that search).
    monkeypatch.setattr(triton_launch, "TUNE_FROM_SEQ", math.inf)
    interpreted = triton_launch.interpreted()
    min_keys = triton_launch.INTERPRETED_MIN_KEYS_PER_SPLIT if interpreted else triton_launch.MIN_KEYS_PER_SPLIT
    n_keys = 4 * min_keys + 5
    assert triton_launch.key_splits(1, 1, 40, n_keys, device) == 4
    check_against_reference(flash_triton.apply, Case(1, None, 40, n_keys, 32, is_causal, torch.float32, "sliced", 7),
                            device)
    assert len(merged) == 1  # the forward took the split path


@pytest.mark.parametrize("interleave", [True, False])
def test_triton_launch_orders_agree(flash_triton, device, interleave, monkeypatch):
    """Programs launched sequence by sequence, or with the sequences interleaved, compute the same attention."""
    from systems.attention import triton_launch

    multiple = 2**40 if interleave else 0
    monkeypatch.setattr(triton_launch, "L2_MULTIPLE_TO_INTERLEAVE", {"forward": multiple, "backward": multiple})
    q = torch.empty(3, 2, 24, 24, device=device)  # (batch, heads, seq, d)
    shape = triton_launch._shape_args(q, q, "forward")
    assert shape["INTERLEAVE"] is interleave
    assert triton_launch._grid(shape, lambda meta: 7)({}) == ((2, 3, 7) if interleave else (7, 2, 3))
    # 3 sequences of a batch, 2 heads and one tile of queries (and of keys) each: axes of three sizes, so that
    # a program reading its tile, head or batch off another axis leaves some of the output unwritten.
    check_against_reference(flash_triton.apply, Case(3, 2, 24, 30, 24, True, torch.float32, "sliced", 11), device)



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


