"""Attention benchmarks: the CS336 handout sweep, the FlashAttention sweep and the leaderboard configuration.

The grids come from the command line (conftest.py): --attn-grid, --attn-seqs, --attn-dims,
--attn-precisions, --attn-impls, --warmup-steps, --rounds. Each point's extra_info holds milliseconds,
TFLOP/s (forward 4·b·h·n_q·n_k·d, backward 2.5x that, both halved when causal) and, on a GPU, peak memory
and the memory held between forward and backward; the forward points of triton and sdpa also hold
`device_ms`, the kernels' time without the host's, and triton's hold SDPA's taken in turns with it on the same
inputs (`sdpa_device_ms`, `vs_sdpa`). A point that runs out of GPU memory is recorded as such.
"""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch

from systems.attention import BACKENDS, sdpa_attention
from systems.bench.schema import ATTENTION_PASSES, ATTENTION_SWEEPS, POINT, AttentionPoint
from systems.bench.timing import record_throughput, time_on_device
from systems.device import synchronize
from systems.precision import PRECISIONS, get_precision

PASS_FLOPS = {"forward": 1.0, "backward": 2.5, "forward_backward": 3.5}  # in units of one forward pass
GRIDS = {  # sweep: (seqs, dims, precisions)
    "tiny": {"handout": ([128, 256], [16, 32], ["fp32"]), "flash": ([128, 256], [16, 32], ["fp32"])},
    "full": {"handout": ([256, 1024, 4096, 8192, 16384], [16, 32, 64, 128], ["fp32"]),
             "flash": ([2**i for i in range(7, 17)], [16, 32, 64, 128], ["bf16", "fp32"])},
}
SWEEP_IMPLS = {"handout": ("naive", "compiled"), "flash": ("naive", "compiled", "pytorch", "triton", "sdpa")}
# The leaderboard's configuration; its tests time each pass of it.
LEADERBOARD = AttentionPoint("leaderboard", "triton", batch=16, seq=16384, d=64, precision=PRECISIONS["bf16"],
                             is_causal=True, pass_="forward")
SECOND_SHAPE_SEQ = 1024  # the sequence length the "after a second shape" leaderboard point is compiled at first
DEVICE_MS_TURNS = 3  # Triton's and SDPA's forward kernel times, taken in turns this many times each


def attention_grid(config, sweep: str) -> list[AttentionPoint]:
    """The points of an ATTENTION_SWEEPS sweep, over the grid's sequence lengths, head dims and precisions."""
    opt = config.getoption
    seqs, dims, precisions = GRIDS[opt("attn_grid")][sweep]
    seqs, dims = opt("attn_seqs") or seqs, opt("attn_dims") or dims
    if sweep == "flash":
        precisions = opt("attn_precisions") or precisions
    default = ("naive", "compiled", "triton", "sdpa") if torch.cuda.is_available() else ("naive", "pytorch", "sdpa")
    impls = [impl for impl in opt("attn_impls") or default if impl in SWEEP_IMPLS[sweep]]
    shape = ATTENTION_SWEEPS[sweep]
    # The implementations of one shape run back to back, so the GPU's clocks and temperature are alike
    # for the points that get compared.
    return [AttentionPoint(sweep, impl, shape.batch, seq, d, precision, shape.is_causal, pass_)
            for precision in map(get_precision, precisions) for d in dims for seq in seqs for impl in impls
            for pass_ in shape.passes]


def pytest_generate_tests(metafunc):
    for sweep in SWEEP_IMPLS:
        if f"{sweep}_point" in metafunc.fixturenames:
            metafunc.parametrize(f"{sweep}_point", attention_grid(metafunc.config, sweep), ids=str)
    if "pass_" in metafunc.fixturenames:
        metafunc.parametrize("pass_", ATTENTION_PASSES)


def attention_impl(impl: str, device: torch.device):
    """The (q, k, v, is_causal) -> o function that `impl` names in systems.attention.BACKENDS."""
    if impl == "triton" and device.type != "cuda":
        pytest.skip("the Triton kernels are benchmarked on CUDA only (the interpreter is far too slow)")
    if impl == "compiled":
        torch._dynamo.reset()  # one graph per shape: never hit the recompile limit over a grid
    return BACKENDS[impl]


def attention_flops(batch: int, heads: int, n_queries: int, n_keys: int, d: int, is_causal: bool) -> float:
    """Forward FLOPs: two matmuls of 2·n_q·n_k·d per head; causal attention does half."""
    return 4 * batch * heads * n_queries * n_keys * d / (2 if is_causal else 1)


def time_attention_pass(benchmark, request, device, attend, inputs, is_causal: bool, pass_: str) -> float:
    """Median seconds of `pass_`; the backward is that of o.sum(), as in the CS336 leaderboard."""
    opt = request.config.getoption
    timing = dict(device=device, warmup=opt("warmup_steps"), rounds=opt("rounds"))

    def clear_grads():
        for t in inputs:
            t.grad = None  # no gradient accumulation inside the timed region
        return ()

    def fresh_loss():
        clear_grads()
        return (attend(*inputs, is_causal).sum(),)

    # Compile and autotune first: the autotuner's scratch buffers must not count towards peak memory.
    fresh_loss()[0].backward()
    clear_grads()
    if pass_ == "backward" and device.type == "cuda":
        loss = fresh_loss()[0]
        synchronize(device)
        benchmark.extra_info["memory_before_backward_mb"] = torch.cuda.memory_allocated(device) / 2**20
        del loss
    if pass_ == "forward":
        return time_on_device(benchmark, lambda: attend(*inputs, is_causal), **timing)
    if pass_ == "backward":
        return time_on_device(benchmark, lambda loss: loss.backward(), setup=fresh_loss, **timing)
    return time_on_device(benchmark, lambda: attend(*inputs, is_causal).sum().backward(), setup=clear_grads,
                          **timing)


def run_point(benchmark, request, device, point: AttentionPoint) -> None:
    attend = attention_impl(point.impl, device)
    benchmark.group = f"{point.sweep} {point.pass_} d={point.d} {point.precision.name}"
    shape = (point.batch, 1, point.seq, point.d)  # one head
    inputs = [torch.randn(shape, device=device, dtype=point.precision.compute, requires_grad=True)
              for _ in range(3)]
    seconds = time_attention_pass(benchmark, request, device, attend, inputs, point.is_causal, point.pass_)
    if seconds is None:  # --benchmark-disable: the pass ran once, untimed
        return
    flops = PASS_FLOPS[point.pass_] * attention_flops(point.batch, 1, point.seq, point.seq, point.d, point.is_causal)
    benchmark.extra_info["ms"] = seconds * 1e3
    if point.pass_ == "forward" and point.impl in ("triton", "sdpa") and device.type == "cuda":
        record_device_ms(benchmark, attend, inputs, point)
    record_throughput(benchmark, seconds=seconds, flops=flops, device=device, precision=point.precision)


def record_device_ms(benchmark, attend, inputs, point: AttentionPoint) -> None:
    """The forward kernels' time (`device_ms`); Triton's in turns with SDPA's on the same inputs.

    Over a sweep a GPU's clocks drift by several percent, more than the two kernels differ at some shapes;
    times taken in turns see the same clocks and temperature.
    """
    if point.impl != "triton":
        benchmark.extra_info["device_ms"] = forward_device_ms(attend, inputs, point.is_causal)
        return
    ours, sdpa = [], []
    for _ in range(DEVICE_MS_TURNS):
        ours.append(forward_device_ms(attend, inputs, point.is_causal))
        sdpa.append(forward_device_ms(sdpa_attention, inputs, point.is_causal))
    device_ms, sdpa_ms = statistics.median(ours), statistics.median(sdpa)
    benchmark.extra_info.update(device_ms=device_ms, sdpa_device_ms=sdpa_ms, vs_sdpa=device_ms / sdpa_ms)


def forward_device_ms(attend, inputs, is_causal: bool) -> float:
    """Median forward milliseconds with the host out of the way: the call replayed from a CUDA graph.

    The timed calls include the Python and launch time of each call, which decides short sequences;
    this is the kernels' own time, where the FlashAttention kernels and SDPA's compare as kernels.
    """
    from triton.testing import do_bench_cudagraph

    with torch.no_grad():
        return do_bench_cudagraph(lambda: attend(*inputs, is_causal), return_mode="median")


def test_handout_sweep(benchmark, request, device, skip_on_oom, handout_point):
    benchmark.extra_info[POINT] = handout_point.to_dict()
    with skip_on_oom:
        run_point(benchmark, request, device, handout_point)


def test_flash_sweep(benchmark, request, device, skip_on_oom, flash_point):
    benchmark.extra_info[POINT] = flash_point.to_dict()
    with skip_on_oom:
        run_point(benchmark, request, device, flash_point)


@pytest.mark.gpu
def test_leaderboard(benchmark, request, device, skip_on_oom, pass_):
    """torch.compile(FlashAttentionTriton.apply) on (16, 16384, 64) bf16 causal, beside torch SDPA."""
    run_leaderboard(benchmark, request, device, skip_on_oom, pass_)


@pytest.mark.gpu
def test_leaderboard_after_a_second_shape(benchmark, request, device, skip_on_oom, pass_):
    """The leaderboard point, its compiled function first called at sequence SECOND_SHAPE_SEQ: as in training
    with more than one sequence length, Dynamo recompiles for symbolic sizes. It should time as the point does."""
    run_leaderboard(benchmark, request, device, skip_on_oom, pass_, first_seq=SECOND_SHAPE_SEQ)


def run_leaderboard(benchmark, request, device, skip_on_oom, pass_, first_seq: int | None = None) -> None:
    from triton.testing import do_bench

    from systems.attention import FlashAttentionTriton

    torch._dynamo.reset()  # Dynamo caches by function: a point must not see the shapes of another
    flash = torch.compile(FlashAttentionTriton.apply)
    point = dataclasses.replace(LEADERBOARD, pass_=pass_)
    benchmark.group = f"leaderboard {pass_}"
    benchmark.extra_info.update({POINT: point.to_dict(), "first_seq": first_seq})
    with skip_on_oom:
        if first_seq is not None:
            first = [torch.randn(point.batch, first_seq, point.d, device=device, dtype=point.precision.compute,
                                 requires_grad=True) for _ in range(3)]
            flash(*first, point.is_causal).sum().backward()
            del first
        inputs = [torch.randn(point.batch, point.seq, point.d, device=device, dtype=point.precision.compute,
                              requires_grad=True) for _ in range(3)]
        seconds = time_attention_pass(benchmark, request, device, flash, inputs, point.is_causal, pass_)
        if seconds is None:  # --benchmark-disable
            return
        flops = PASS_FLOPS[pass_] * attention_flops(point.batch, 1, point.seq, point.seq, point.d, point.is_causal)
        record_throughput(benchmark, seconds=seconds, flops=flops, device=device, precision=point.precision)
        # SDPA beside it, both timed alike with CUDA events (median of do_bench, L2 flushed between calls).
        heads = [t.unsqueeze(1) for t in inputs]  # SDPA's fused kernels want (batch, heads, seq, d)
        ms = {name: _do_bench_pass(do_bench, attend, args, inputs, pass_)
              for name, attend, args in (("triton", flash, inputs), ("sdpa", sdpa_attention, heads))}
    benchmark.extra_info.update(ms=seconds * 1e3, do_bench_ms=ms["triton"], sdpa_do_bench_ms=ms["sdpa"],
                                vs_sdpa=ms["triton"] / ms["sdpa"])


def _do_bench_pass(do_bench, attend, args, leaves, pass_: str) -> float:
    """Median milliseconds of `pass_` of causal attend(*args); `leaves` get their gradients reset.

    The backward alone is forward+backward minus forward: a compiled backward cannot rerun a retained graph.
    """
    forward = do_bench(lambda: attend(*args, True), return_mode="median")
    if pass_ == "forward":
        return forward
    both = do_bench(lambda: attend(*args, True).sum().backward(), grad_to_none=leaves, return_mode="median")
    return both - forward if pass_ == "backward" else both
