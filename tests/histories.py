"""Benchmark histories as the benches save them, built from points and their measurements, for the report's and
the history's tests."""

from __future__ import annotations

import json
import pathlib

from systems.bench.breakdown import StepBreakdown
from systems.bench.schema import (MEASURED, POINT, SCHEMA, AllReduceMeasured, Measured, Phases, Point, Throughput,
                                  to_record)
from systems.model import get_config

MACHINE = "Linux-CPython-3.12-64bit"
# Where each kind's benchmarks live, as their full names say.
TESTS = {"model": "bench_model.py::test_model", "warmup": "bench_model.py::test_warmup_study",
         "attention": "bench_attention.py::test_flash_sweep", "allreduce": "bench_allreduce.py::test_allreduce",
         "ddp": "bench_ddp.py::test_ddp_step", "optimizer": "bench_ddp.py::test_optimizer_memory",
         "fsdp": "bench_fsdp.py::test_fsdp_step", "layout": "bench_layouts.py::test_layout_step",
         "fullstep": "bench_fullstep.py::test_fullstep",
         "checkpoint": "bench_checkpoint.py::test_checkpoint",
         "leaderboard": "bench_leaderboard.py::test_leaderboard",
         "context_search": "bench_checkpoint.py::test_largest_context"}


def test_of(point: Point) -> str:
    if point.kind == "attention":
        return {"handout": "bench_attention.py::test_handout_sweep",
                "leaderboard": "bench_attention.py::test_leaderboard"}.get(point.sweep, TESTS["attention"])
    return TESTS[point.kind]


def entry(point: Point, measured: Measured, mean: float, rounds: int = 5) -> dict:
    """One benchmark as pytest-benchmark saves it: rounds spread ±10% around `mean`."""
    module, test = test_of(point).split("::")
    name = f"{test}[{point}]"
    return {"group": None, "name": name, "fullname": f"benches/{module}::{name}", "params": {"point": str(point)},
            "param": str(point), "extra_info": {POINT: point.to_record(), MEASURED: to_record(measured)},
            "options": {},
            "stats": {"min": 0.9 * mean, "max": 1.1 * mean, "mean": mean, "stddev": 0.05 * mean, "rounds": rounds,
                      "median": mean, "iqr": 0.0, "q1": mean, "q3": mean, "iqr_outliers": 0, "stddev_outliers": 0,
                      "outliers": "0;0", "ld15iqr": mean, "hd15iqr": mean, "ops": 1 / mean, "total": rounds * mean,
                      "iterations": 1}}


def oom_entry(point: Point) -> dict:
    module, test = test_of(point).split("::")
    name = f"{test}[{point}]"
    return {"name": name, "fullname": f"benches/{module}::{name}", "error": "CUDA out of memory",
            POINT: point.to_record()}


def save_run(storage: pathlib.Path, number: int, benchmarks: list[dict], oom: list[Point] = (),
             machine: str = MACHINE, stamp: str = "20260101_120000", **fields) -> pathlib.Path:
    path = storage / machine / f"{number:04d}_abc123_{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    history = {"machine_info": {"machine": "x86_64", "systems_lab": {"gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 1,
                                                                       "torch": "2.11.0"}},
               "commit_info": {"id": "abc123"}, "benchmarks": benchmarks, "datetime": "2026-01-01T12:00:00",
               "version": "5.2.3", "systems_lab_schema": SCHEMA, "out_of_memory": [oom_entry(p) for p in oom],
               **fields}
    path.write_text(json.dumps(history))
    return path


def config(preset: str, context: int) -> dict:
    return to_record(get_config(preset, context_length=context))


def rate(tflops: float, mfu: float | None = None) -> Throughput:
    return Throughput(tflops, None if mfu is None else tflops / mfu, mfu)


def phases(step: float, forward: float = 0.03, backward: float = 0.06, comm_wait: float = 0.0,
           optimizer: float = 0.01, gather_wait: float | None = None) -> Phases:
    return Phases(step, forward, backward, comm_wait, optimizer, gather_wait)


def allreduce_measured(nbytes: int, latency: float, loop: float | None, world_size: int = 2) -> AllReduceMeasured:
    def busbw(seconds: float) -> float:
        return nbytes / seconds / 1e9 * 2 * (world_size - 1) / world_size

    return AllReduceMeasured(bytes=nbytes, warmup_calls=5, rounds=20, loop_calls=None if loop is None else 20,
                             latency_s=latency, latency_spread_s=1e-6, latency_busbw_gbps=busbw(latency),
                             loop_time_s=loop, loop_spread_s=None if loop is None else 1e-7,
                             algbw_gbps=None if loop is None else nbytes / loop / 1e9,
                             busbw_gbps=None if loop is None else busbw(loop), bare_time_s=None,
                             bare_busbw_gbps=210.0, loop_vs_bare=None if loop is None else 200 / 210)


def step_breakdown(span: float, busy: float) -> StepBreakdown:
    """One rank's breakdown, the busy time split in fixed shares."""
    shares = dict(matmul_s=0.4, attention_forward_s=0.15, attention_backward_s=0.25, communication_s=0.1,
                  communication_exposed_s=0.02, other_s=0.1, optimizer_s=0.01, loss_s=0.02, recompute_s=0.2)
    return StepBreakdown(span_s=span, busy_s=busy, **{k: share * busy for k, share in shares.items()})
