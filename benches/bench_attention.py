"""Attention benchmarks: the CS336 handout sweep, the FlashAttention sweep and the leaderboard configuration.

The grids come from the command line (systems.bench.options): --attn-grid, --attn-seqs, --attn-dims,
--attn-precisions, --attn-impls, --warmup-steps, --rounds. Each point measures (systems.bench.schema.
AttentionMeasured) milliseconds, TFLOP/s (forward 4·b·h·n_q·n_k·d, backward 2.5x that, both halved when causal)
and, on a GPU, peak memory and the memory held between forward and backward; the forward points of triton, gluon
and sdpa also measure `device_ms`, the kernels' time without the host's, and triton's and gluon's SDPA's taken in
turns with it on the same inputs (`sdpa_device_ms`). A point that runs out of GPU memory is recorded as such.

Beside ours (pytorch, triton, and on Hopper the Gluon forward, gluon) the FlashAttention sweep times torch's fast
paths where this torch and GPU have them: SDPA as torch picks (sdpa) and held to its FlashAttention-2 (sdpa-flash)
or cuDNN (sdpa-cudnn) kernel, SDPA's flash kernel replaced by a registered implementation
(torch.nn.attention.list_flash_attention_impls: sdpa-fa3, sdpa-fa4, where the image has its package), and
FlexAttention compiled with a causal block mask (flex). A point an implementation cannot run is skipped with the
reason, or, where that is known from the point alone (16-bit-only kernels in fp32, gluon's head dims), not made.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import statistics

import pytest
import torch

from systems.attention import BACKENDS, sdpa_attention
from systems.attention.backends import SDPA_FLASH_IMPLS
from systems.bench.options import grid_of
from systems.bench.schema import ATTENTION_SWEEPS, AttentionMeasured, AttentionPoint
from systems.bench.timing import Timing, record_measured, record_point, throughput, time_on_device
from systems.device import synchronize
from systems.precision import PRECISIONS

PASS_FLOPS = {"forward": 1.0, "backward": 2.5, "forward_backward": 3.5}  # in units of one forward pass
GRIDS = {  # sweep: (seqs, dims, precisions)
    "tiny": {"handout": ([128, 256], [16, 32], ["fp32"]), "flash": ([128, 256], [16, 32], ["fp32"])},
    "full": {"handout": ([256, 1024, 4096, 8192, 16384], [16, 32, 64, 128], ["fp32"]),
             "flash": ([2**i for i in range(7, 17)], [16, 32, 64, 128], ["bf16", "fp32"])},
}
SWEEP_IMPLS = {"handout": ("naive", "compiled"),
               "flash": ("naive", "compiled", "pytorch", "triton", "gluon", "sdpa", "sdpa-flash", "sdpa-cudnn",
                         *SDPA_FLASH_IMPLS, "flex")}
SIXTEEN_BIT_ONLY = ("gluon", "sdpa-flash", "sdpa-cudnn", *SDPA_FLASH_IMPLS)  # their kernels take fp16 and bf16 only
# The package each of torch's registered flash attention implementations imports when activated (torch.nn.
# attention._fa3, _fa4): the default grid times those whose package is installed.
FLASH_IMPL_PACKAGES = {"FA3": "flash_attn_interface", "FA4": "flash_attn"}
# The leaderboard's configuration, timed through torch.compile(FlashAttentionTriton.apply) beside SDPA: alone, and
# after its compiled function first saw sequence 1024, as in training with more than one sequence length, where
# Dynamo recompiles for symbolic sizes. It should time as the point does. On Hopper the Gluon forward (eager: it
# runs outside torch.compile) and, on any GPU, FlexAttention (compiled) time there too, beside SDPA likewise.
LEADERBOARD = ATTENTION_SWEEPS["leaderboard"]
LEADERBOARD_POINTS = [AttentionPoint("leaderboard", "triton", LEADERBOARD.batch, 16384, 64, PRECISIONS["bf16"],
                                     LEADERBOARD.is_causal, pass_, first_seq)
                      for first_seq in (None, 1024) for pass_ in LEADERBOARD.passes]
LEADERBOARD_IMPLS = ("gluon", "flex")  # beside triton, where they run and --attn-impls (if given) names them
DEVICE_MS_TURNS = 3  # our forward kernels' and SDPA's times, taken in turns this many times each


@functools.cache
def hopper() -> bool:
    """Whether this process's GPU is an sm90 one, the only GPUs the Gluon kernels are written for."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def default_impls() -> tuple[str, ...]:
    """What --attn-impls times when not given: on CUDA every GPU implementation this GPU and image have."""
    if not torch.cuda.is_available():
        return ("naive", "pytorch", "sdpa")
    flash_impls = tuple(impl for impl, name in SDPA_FLASH_IMPLS.items() if _has_package(FLASH_IMPL_PACKAGES[name]))
    gluon = ("gluon",) if hopper() else ()
    return ("naive", "compiled", "triton", *gluon, "sdpa", "sdpa-flash", "sdpa-cudnn", *flash_impls, "flex")


def _has_package(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def runs_at(impl: str, d: int, precision) -> bool:
    """False where the point alone shows that `impl` cannot run it: a 16-bit-only kernel in fp32, gluon at a
    head dim its kernel has no variant for."""
    if impl in SIXTEEN_BIT_ONLY and precision.compute == torch.float32:
        return False
    if impl == "gluon":
        try:
            from systems.attention.gluon_forward import HEAD_DIMS
        except ImportError:  # a Triton without Gluon: the point is made, and skipped with the reason
            return True
        return d in HEAD_DIMS
    return True


def attention_grid(grid, sweep: str) -> list[AttentionPoint]:
    """The points of a sweep, over the grid's sequence lengths, head dims and precisions."""
    seqs, dims, names = GRIDS[grid.attn_grid][sweep]
    seqs, dims, precisions = grid.attn_seqs or seqs, grid.attn_dims or dims, [PRECISIONS[name] for name in names]
    if sweep == "flash":  # the handout's sweep is fp32
        precisions = grid.attn_precisions or precisions
    impls = [impl for impl in grid.attn_impls or default_impls() if impl in SWEEP_IMPLS[sweep]]
    shape = ATTENTION_SWEEPS[sweep]
    # The implementations of one shape run back to back, so the GPU's clocks and temperature are alike
    # for the points that get compared.
    return [AttentionPoint(sweep, impl, shape.batch, seq, d, precision, shape.is_causal, pass_)
            for precision in precisions for d in dims for seq in seqs for impl in impls for pass_ in shape.passes
            if runs_at(impl, d, precision)]


def leaderboard_points(grid) -> list[AttentionPoint]:
    """The triton points, always; gluon's (on Hopper) and flex's where --attn-impls, if given, names them."""
    wanted = [impl for impl in LEADERBOARD_IMPLS if impl in (grid.attn_impls or LEADERBOARD_IMPLS)
              and (impl != "gluon" or hopper())]
    return LEADERBOARD_POINTS + [AttentionPoint("leaderboard", impl, LEADERBOARD.batch, 16384, 64, PRECISIONS["bf16"],
                                                LEADERBOARD.is_causal, pass_)
                                 for impl in wanted for pass_ in LEADERBOARD.passes]


def pytest_generate_tests(metafunc):
    grid = grid_of(metafunc.config)
    for sweep in SWEEP_IMPLS:
        if f"{sweep}_point" in metafunc.fixturenames:
            metafunc.parametrize(f"{sweep}_point", attention_grid(grid, sweep), ids=str)
    if "leaderboard_point" in metafunc.fixturenames:
        metafunc.parametrize("leaderboard_point", leaderboard_points(grid), ids=str)


def attention_impl(impl: str, device: torch.device):
    """The (q, k, v, is_causal) -> o function that `impl` names in systems.attention.BACKENDS (sdpa-fa3 and
    sdpa-fa4: sdpa-flash, run inside flash_impl_activated)."""
    if impl == "triton" and device.type != "cuda":
        pytest.skip("the Triton kernels are benchmarked on CUDA only (the interpreter is far too slow)")
    if impl == "gluon" and not (device.type == "cuda" and hopper()):
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
        pytest.skip(f"the Gluon kernels are written for Hopper (sm90) and run there only, not on {gpu}")
    if impl == "flex" and device.type != "cuda":
        pytest.skip("FlexAttention is benchmarked on CUDA only: torch runs no FlexAttention backward on a CPU")
    if impl in ("compiled", "flex"):
        torch._dynamo.reset()  # one graph per shape: never hit the recompile limit over a grid
    return BACKENDS["sdpa-flash" if impl in SDPA_FLASH_IMPLS else impl]


@contextlib.contextmanager
def flash_impl_activated(impl: str):
    """For sdpa-fa3 and sdpa-fa4: torch's registered flash attention implementation activated in SDPA's flash
    kernel for the point (torch's own FlashAttention-2 restored after it); skipped where it cannot be."""
    if impl not in SDPA_FLASH_IMPLS:
        yield
        return
    name = SDPA_FLASH_IMPLS[impl]
    from torch.nn import attention

    if name not in getattr(attention, "list_flash_attention_impls", list)():
        pytest.skip(f"torch {torch.__version__} registers no {name} flash attention implementation")
    try:
        attention.activate_flash_attention_impl(name)
    except (ImportError, RuntimeError, ValueError) as error:
        pytest.skip(f"{name} cannot be activated here: {type(error).__name__}: {str(error).splitlines()[0]}")
    try:
        yield
    finally:
        attention.restore_flash_attention_impl()


def skip_unless_runs(impl: str, attend, inputs, is_causal: bool) -> None:
    """Skip the point, with the kernel's reason, where gluon's input check or a held SDPA kernel refuses it."""
    if impl == "gluon":
        from systems.attention.gluon_forward import check_gluon_inputs

        try:
            check_gluon_inputs(*inputs, is_causal)
        except (TypeError, ValueError, RuntimeError) as error:
            pytest.skip(str(error))
    elif impl.startswith("sdpa-"):
        try:
            with torch.no_grad():
                attend(*inputs, is_causal)
        except RuntimeError as error:
            pytest.skip(f"{impl} cannot run this point: {str(error).splitlines()[0]}")


def attention_flops(batch: int, heads: int, n_queries: int, n_keys: int, d: int, is_causal: bool) -> float:
    """Forward FLOPs: two matmuls of 2·n_q·n_k·d per head; causal attention does half."""
    return 4 * batch * heads * n_queries * n_keys * d / (2 if is_causal else 1)


def time_attention_pass(benchmark, grid, device, attend, inputs, is_causal: bool,
                        pass_: str) -> tuple[Timing, float | None]:
    """`pass_` timed (the backward is that of o.sum(), as in the CS336 leaderboard), and for the backward on a
    GPU the memory the forward leaves it, MiB."""
    timing = dict(device=device, warmup=grid.warmup_steps, rounds=grid.rounds)

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
    before_backward = None
    if pass_ == "backward" and device.type == "cuda":
        loss = fresh_loss()[0]
        synchronize(device)
        before_backward = torch.cuda.memory_allocated(device) / 2**20
        del loss
    if pass_ == "forward":
        return time_on_device(benchmark, lambda: attend(*inputs, is_causal), **timing), before_backward
    if pass_ == "backward":
        return time_on_device(benchmark, lambda loss: loss.backward(), setup=fresh_loss, **timing), before_backward
    return time_on_device(benchmark, lambda: attend(*inputs, is_causal).sum().backward(), setup=clear_grads,
                          **timing), before_backward


def pass_flops(point: AttentionPoint) -> float:
    return PASS_FLOPS[point.pass_] * attention_flops(point.batch, 1, point.seq, point.seq, point.d, point.is_causal)


def run_point(benchmark, grid, device, point: AttentionPoint) -> None:
    attend = attention_impl(point.impl, device)
    with flash_impl_activated(point.impl):
        run_activated(benchmark, grid, device, point, attend)


def run_activated(benchmark, grid, device, point: AttentionPoint, attend) -> None:
    benchmark.group = f"{point.sweep} {point.pass_} d={point.d} {point.precision.name}"
    shape = (point.batch, 1, point.seq, point.d)  # one head
    inputs = [torch.randn(shape, device=device, dtype=point.precision.compute, requires_grad=True)
              for _ in range(3)]
    skip_unless_runs(point.impl, attend, inputs, point.is_causal)
    timing, before_backward = time_attention_pass(benchmark, grid, device, attend, inputs, point.is_causal,
                                                  point.pass_)
    if timing.seconds is None:  # --benchmark-disable: the pass ran once, untimed
        return
    device_ms = sdpa_device_ms = None
    if point.pass_ == "forward" and point.impl in ("triton", "gluon", "sdpa") and device.type == "cuda":
        device_ms, sdpa_device_ms = forward_kernels_ms(attend, inputs, point)
    record_measured(benchmark, AttentionMeasured(
        ms=timing.seconds * 1e3, peak_memory_mb=timing.peak_memory_mb, memory_before_backward_mb=before_backward,
        throughput=throughput(seconds=timing.seconds, flops=pass_flops(point), device=device,
                              precision=point.precision),
        device_ms=device_ms, sdpa_device_ms=sdpa_device_ms, do_bench_ms=None, sdpa_do_bench_ms=None))


def forward_kernels_ms(attend, inputs, point: AttentionPoint) -> tuple[float, float | None]:
    """The forward kernels' time; for ours (triton, gluon), SDPA's beside it, taken in turns on the same inputs.

    Over a sweep a GPU's clocks drift by several percent, more than the two kernels differ at some shapes;
    times taken in turns see the same clocks and temperature.
    """
    if point.impl not in ("triton", "gluon"):
        return forward_device_ms(attend, inputs, point.is_causal), None
    ours, sdpa = [], []
    for _ in range(DEVICE_MS_TURNS):
        ours.append(forward_device_ms(attend, inputs, point.is_causal))
        sdpa.append(forward_device_ms(sdpa_attention, inputs, point.is_causal))
    return statistics.median(ours), statistics.median(sdpa)


def forward_device_ms(attend, inputs, is_causal: bool) -> float:
    """Median forward milliseconds with the host out of the way: the call replayed from a CUDA graph.

    The timed calls include the Python and launch time of each call, which decides short sequences;
    this is the kernels' own time, where the FlashAttention kernels and SDPA's compare as kernels.
    """
    from triton.testing import do_bench_cudagraph

    with torch.no_grad():
        return do_bench_cudagraph(lambda: attend(*inputs, is_causal), return_mode="median")


def test_handout_sweep(benchmark, grid, device, skip_on_oom, handout_point):
    record_point(benchmark, handout_point)
    with skip_on_oom:
        run_point(benchmark, grid, device, handout_point)


def test_flash_sweep(benchmark, grid, device, skip_on_oom, flash_point):
    record_point(benchmark, flash_point)
    with skip_on_oom:
        run_point(benchmark, grid, device, flash_point)


@pytest.mark.gpu
def test_leaderboard(benchmark, grid, device, skip_on_oom, leaderboard_point):
    """torch.compile(FlashAttentionTriton.apply) on (16, 16384, 64) bf16 causal, beside torch SDPA; on Hopper the
    Gluon forward, eager, and FlexAttention, compiled, likewise."""
    from triton.testing import do_bench

    from systems.attention import FlashAttentionTriton

    point = leaderboard_point
    torch._dynamo.reset()  # Dynamo caches by function: a point must not see the shapes of another
    if point.impl == "triton":
        flash = torch.compile(FlashAttentionTriton.apply)
    else:
        flash = attention_impl(point.impl, device)
    benchmark.group = f"leaderboard {point.pass_}"
    record_point(benchmark, point)
    with skip_on_oom:
        if point.first_seq is not None:
            first = [torch.randn(point.batch, point.first_seq, point.d, device=device, dtype=point.precision.compute,
                                 requires_grad=True) for _ in range(3)]
            flash(*first, point.is_causal).sum().backward()
            del first
        inputs = [torch.randn(point.batch, point.seq, point.d, device=device, dtype=point.precision.compute,
                              requires_grad=True) for _ in range(3)]
        timing, before_backward = time_attention_pass(benchmark, grid, device, flash, inputs, point.is_causal,
                                                      point.pass_)
        if timing.seconds is None:  # --benchmark-disable
            return
        # SDPA beside it, both timed alike with CUDA events (median of do_bench, L2 flushed between calls).
        heads = [t.unsqueeze(1) for t in inputs]  # SDPA's fused kernels want (batch, heads, seq, d)
        ms = {name: _do_bench_pass(do_bench, attend, args, inputs, point.pass_)
              for name, attend, args in (("ours", flash, inputs), ("sdpa", sdpa_attention, heads))}
    record_measured(benchmark, AttentionMeasured(
        ms=timing.seconds * 1e3, peak_memory_mb=timing.peak_memory_mb, memory_before_backward_mb=before_backward,
        throughput=throughput(seconds=timing.seconds, flops=pass_flops(point), device=device,
                              precision=point.precision),
        device_ms=None, sdpa_device_ms=None, do_bench_ms=ms["ours"], sdpa_do_bench_ms=ms["sdpa"]))


def _do_bench_pass(do_bench, attend, args, leaves, pass_: str) -> float:
    """Median milliseconds of `pass_` of causal attend(*args); `leaves` get their gradients reset.

    The backward alone is forward+backward minus forward: a compiled backward cannot rerun a retained graph.
    """
    forward = do_bench(lambda: attend(*args, True), return_mode="median")
    if pass_ == "forward":
        return forward
    both = do_bench(lambda: attend(*args, True).sum().backward(), grad_to_none=leaves, return_mode="median")
    return both - forward if pass_ == "backward" else both
