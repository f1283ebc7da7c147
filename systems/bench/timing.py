"""What every benchmark shares: correct GPU timing, device facts and derived figures."""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib
import platform
import subprocess
from dataclasses import dataclass

import torch

from systems.bench import baton
from systems.bench.schema import KINDS, MEASURED, POINT, Measured, Point, Throughput, to_record
from systems.device import synchronize
from systems.precision import Precision

# Dense datasheet peaks per GPU, TFLOP/s (SXM parts). MFU is measured against these.
PEAK_TFLOPS = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 495.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 495.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
}

def peak_tflops(device: torch.device, precision: Precision) -> float | None:
    """The peak of the precision's matmuls on `device`; None off-GPU or on a GPU without a listed peak."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS.items():  # "H100 PCIe" is listed before "H100" on purpose
        if key in name:
            return peaks[precision.peak_key()]
    return None


@functools.cache
def device_info() -> dict:
    """Versions and GPU facts that make a timing comparable; saved into every benchmark history."""
    info = {
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda_runtime": torch.version.cuda,
        "cpu": platform.processor() or platform.machine(),
        "gpu": None,
        "gpu_count": 0,
        "host_malloc": _host_malloc,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_count=torch.cuda.device_count(),
            compute_capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            driver=_nvidia_smi("driver_version"),
        )
    return info


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.splitlines()[0].strip()


def record_point(benchmark, point: Point) -> None:
    """The point, whole, where the history keeps it; first, so that running out of memory records it too."""
    benchmark.extra_info[POINT] = point.to_record()


def record_measured(benchmark, measured: Measured) -> None:
    """What the point measured, whole, beside it: the dataclass its kind declares."""
    kind = KINDS[benchmark.extra_info[POINT]["kind"]]
    if type(measured) is not kind.measured:
        raise TypeError(f"{kind.__name__} measures {kind.measured.__name__}, not {type(measured).__name__}")
    benchmark.extra_info[MEASURED] = to_record(measured)


# glibc's settings for a timed process (mallopt's parameter numbers): blocks up to 1 GiB come from the heap rather
# than their own mmap, and the heap's free top is never trimmed.
HOST_MALLOC = {"mmap_threshold": (-3, 2**30), "trim_threshold": (-1, 2**31 - 1)}
_host_malloc: dict | None = None  # the settings applied in this process


def keep_freed_host_memory() -> None:
    """Keep freed host memory in this process (glibc only), so that every round starts alike: by default glibc
    hands a freed block of 32 MiB or more back to the kernel at once, and trims the heap, so the next round
    faults every page of its activations in again; a CPU model's rounds then swing by several times.
    Histories record the settings (device_info's host_malloc)."""
    global _host_malloc
    if _host_malloc is not None:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    if all(libc.mallopt(param, value) for param, value in HOST_MALLOC.values()):
        _host_malloc = {name: value for name, (_, value) in HOST_MALLOC.items()}


@dataclass(frozen=True)
class Timing:
    seconds: float | None  # median seconds per call; None under --benchmark-disable, where fn ran once, untimed
    peak_memory_mb: float | None  # over the timed rounds, on a GPU


def time_on_device(benchmark, fn, *, device: torch.device, warmup: int, rounds: int, setup=None) -> Timing:
    """Time `fn` with pytest-benchmark so that GPU work is inside the measured region.

    Each round ends with a device synchronize, so the wall-clock timer sees the kernels finish;
    `setup` (untimed, once per round) returns the positional arguments of `fn`.
    """

    keep_freed_host_memory()

    def timed(*args):
        fn(*args)  # nothing returned: pytest-benchmark would hold a round's output through the next round
        synchronize(device)

    def prepare():
        baton.pass_on()  # the other run's round first, in a turn of --benchmark-gate-against
        args = setup() if setup else ()
        synchronize(device)
        return args, {}

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    benchmark.pedantic(timed, setup=prepare, rounds=rounds, warmup_rounds=warmup, iterations=1)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return Timing(benchmark.stats.stats.median if benchmark.stats else None, peak)


def throughput(*, seconds: float, flops: float, device: torch.device, precision: Precision) -> Throughput:
    """Achieved TFLOP/s and, on a GPU with a known peak, model FLOPs utilization (the precision's matmuls)."""
    tflops = flops / seconds / 1e12
    peak = peak_tflops(device, precision)
    return Throughput(tflops, peak, None if peak is None else tflops / peak)


def record_timings(benchmark, rank_seconds: list[list[float]]) -> None:
    """Give pytest-benchmark per-round times measured where its timer cannot reach: `rank_seconds[r][i]`
    is round i as rank r timed it, and a round lasts as long as its slowest rank.

    Their statistics then fill its table, the saved history and the regression gate like any other
    benchmark's. pytest-benchmark has no public hook for this, so it fills the fixture's stats as
    `pedantic` does; under --benchmark-disable it records nothing.
    """
    if benchmark.disabled:
        return
    benchmark._mode = "record_timings(...)"  # the fixture refuses a second use, as after pedantic
    stats = benchmark._make_stats(1)
    for duration in map(max, zip(*rank_seconds, strict=True)):
        stats.update(duration)


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started (Linux's /proc); None elsewhere."""
    try:
        stat = pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(pathlib.Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return None
    return uptime - int(stat[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks after boot
