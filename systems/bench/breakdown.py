"""Where one training step's GPU time goes, from a torch.profiler trace of it.

nsys answers the same question, but it is not on every GPU machine; torch.profiler is wherever torch is.
Each GPU activity (kernel, memcpy, memset) is sorted by its kernel name into matmul, attention forward,
attention backward, communication (NCCL) or other. Its launch, matched by correlation id, places it in the
ranges the step opened on the launching thread (systems.device.nvtx_range): `optimizer_step`, `loss`,
`recompute` (activation checkpointing's recomputed forward, inside the backward). Those ranges cut across the
kinds: a recomputed matmul counts in `matmul_s` and in `recompute_s`.

Communication is what the step waits for only where no other GPU work runs: `communication_exposed_s` is the
time covered by NCCL kernels and by nothing else, the all-gathers and reduce-scatters not hidden.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import tempfile
from collections import defaultdict
from collections.abc import Callable

import torch

GPU_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCHES = ("cuda_runtime", "cuda_driver")
# Kernel names: ours exactly (systems.attention's Triton and Gluon kernels), the libraries' by a part of theirs
# (FlashAttention-2 in SDPA, cuDNN's fprop/bprop, the memory-efficient CUTLASS kernels).
ATTENTION_FORWARD = ({"fwd_kernel", "fwd_merge_kernel", "attention_forward_kernel"},
                     ("flash_fwd", "fprop", "fmha_cutlassF"))
ATTENTION_BACKWARD = ({"bwd_preprocess_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel", "attention_backward_kernel",
                       "bwd_postprocess_kernel"}, ("flash_bwd", "bprop", "fmha_cutlassB"))
MATMUL = ("gemm", "nvjet", "xmma", "cutlass", "cublas")
RANGES = ("optimizer_step", "loss", "recompute")


@dataclasses.dataclass(frozen=True)
class StepBreakdown:
    """Seconds of GPU time in one step. The kinds (matmul, attention, communication, other) partition the
    activity; the ranges (optimizer, loss, recompute) overlap them."""
    span_s: float  # first activity's start to last activity's end
    busy_s: float  # time with any activity
    matmul_s: float
    attention_forward_s: float
    attention_backward_s: float
    communication_s: float
    communication_exposed_s: float
    other_s: float
    optimizer_s: float
    loss_s: float
    recompute_s: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def kind_of(kernel: str) -> str:
    lowered = kernel.lower()
    if "nccl" in lowered:
        return "communication"
    for kind, (exact, parts) in (("attention_forward", ATTENTION_FORWARD), ("attention_backward", ATTENTION_BACKWARD)):
        if kernel in exact or any(part.lower() in lowered for part in parts):
            return kind
    if any(part in lowered for part in MATMUL):
        return "matmul"
    return "other"


def breakdown_of(trace: dict) -> StepBreakdown:
    """The breakdown of a Chrome trace (torch.profiler's `export_chrome_trace`; times in microseconds)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    launches = {e["args"]["correlation"]: (e["tid"], e["ts"]) for e in events
                if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}
    ranges = defaultdict(list)  # (thread, name) -> [(start, end)]
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"] in RANGES:
            ranges[e["tid"], e["name"]].append((e["ts"], e["ts"] + e["dur"]))
    seconds = defaultdict(float)
    intervals = defaultdict(list)  # communication or compute -> [(start, end)]
    for e in events:
        if e.get("cat") not in GPU_ACTIVITY:
            continue
        kind = kind_of(e["name"]) if e["cat"] == "kernel" else "other"
        seconds[kind] += e["dur"]
        intervals["communication" if kind == "communication" else "compute"].append((e["ts"], e["ts"] + e["dur"]))
        launch = launches.get(e.get("args", {}).get("correlation"))
        if launch is not None and kind != "communication":
            thread, at = launch
            for name in RANGES:
                if any(start <= at <= end for start, end in ranges[thread, name]):
                    seconds[name] += e["dur"]
    everything = intervals["compute"] + intervals["communication"]
    if not everything:
        raise ValueError("the trace holds no GPU activity: was the step profiled with ProfilerActivity.CUDA?")
    compute = _union(intervals["compute"])
    communication = _union(intervals["communication"])
    return StepBreakdown(
        span_s=(max(end for _, end in everything) - min(start for start, _ in everything)) / 1e6,
        busy_s=_length(_union(everything)) / 1e6,
        matmul_s=seconds["matmul"] / 1e6, attention_forward_s=seconds["attention_forward"] / 1e6,
        attention_backward_s=seconds["attention_backward"] / 1e6, communication_s=seconds["communication"] / 1e6,
        communication_exposed_s=(_length(communication) - _overlap(communication, compute)) / 1e6,
        other_s=seconds["other"] / 1e6, optimizer_s=seconds["optimizer_step"] / 1e6, loss_s=seconds["loss"] / 1e6,
        recompute_s=seconds["recompute"] / 1e6)


def profile_step(step: Callable[[], object]) -> StepBreakdown:
    """Run `step()` once under torch.profiler (CPU and CUDA) and break its GPU time down."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as file:
        prof.export_chrome_trace(file.name)
        return breakdown_of(json.loads(pathlib.Path(file.name).read_text()))


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
