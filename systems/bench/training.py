"""What the rank-timed training benches share (bench_ddp, bench_fsdp, bench_fullstep, bench_layouts): a point's
TrainSpec trained by `systems.parallel.train.train` in spawned ranks for the grid's Schedule, with its step times
handed to pytest-benchmark, and the measurements every such point records.

The steps run in spawned ranks, out of reach of pytest-benchmark's timer, and are timed there (CUDA events on
the compute stream on a GPU, the wall clock on a CPU). pytest-benchmark's rounds are the timed steps, each as
long as its slowest rank (systems.bench.timing.record_timings), so its table, the history and the gate see real
step times. The backend is NCCL with one GPU per rank where CUDA is available, gloo on the CPU otherwise.
"""

from __future__ import annotations

import statistics

import torch

from systems.accounting import flops
from systems.bench.breakdown import StepBreakdown, profile_step
from systems.bench.leases import on_gpus
from systems.bench.schema import Phases, Point
from systems.bench.schema.records import to_record
from systems.bench.timing import record_timings, throughput
from systems.parallel.spec import Schedule, TrainSpec
from systems.parallel.train import train

BACKEND = "nccl" if torch.cuda.is_available() else "gloo"


def on_rank_gpus(points: list[Point]) -> list:
    """The points as parameters, each holding its world size in GPUs under NCCL (systems.bench.leases)."""
    return [on_gpus(point, point.world_size if BACKEND == "nccl" else 0) for point in points]


def schedule_of(grid) -> Schedule:
    """How long the grid times a run: --warmup-steps untimed steps, then --rounds timed ones."""
    return Schedule(warmup=grid.warmup_steps, steps=grid.rounds)


def train_in_ranks(benchmark, rank_pools, world_size: int, spec: TrainSpec, schedule: Schedule,
                   after_training=None) -> list[dict]:
    """systems.parallel.train.train(spec, schedule, after_training) on every rank, its step times given to
    pytest-benchmark."""
    ranks = rank_pools.run(world_size, BACKEND, train, spec, schedule, after_training)
    record_timings(benchmark, [rank["seconds"]["step"] for rank in ranks])
    return ranks


def phases(ranks: list[dict]) -> Phases:
    """Each phase: the mean over ranks of each rank's median over the timed steps."""
    def mean_of_medians(phase: str) -> float | None:
        if phase not in ranks[0]["seconds"]:
            return None
        return statistics.mean(statistics.median(rank["seconds"][phase]) for rank in ranks)

    return Phases(**{f"{phase}_s": mean_of_medians(phase) for phase in
                     ("step", "forward", "backward", "comm_wait", "optimizer", "gather_wait")})


def memory_mb(ranks: list[dict]) -> dict[str, float] | None:
    """Per moment of the step, the largest rank's peak (GPU only)."""
    if "memory_mb" not in ranks[0]:
        return None
    return {moment: max(rank["memory_mb"][moment] for rank in ranks) for moment in ranks[0]["memory_mb"]}


def gathered_mb(ranks: list[dict]) -> float | None:
    """The most gathered weights our FSDP held at once, the largest rank's; None for the other variants."""
    return max(rank["peak_gathered_bytes"] for rank in ranks) / 2**20 if "peak_gathered_bytes" in ranks[0] else None


def step_breakdown(model, step) -> dict:
    """`train`'s `after_training`: one more step profiled for where its GPU time goes (systems.bench.breakdown)."""
    return {"breakdown": profile_step(step).to_dict()} if torch.cuda.is_available() else {}


def breakdowns(ranks: list[dict]) -> list[StepBreakdown] | None:
    return [StepBreakdown(**rank["breakdown"]) for rank in ranks] if "breakdown" in ranks[0] else None


def training_measured(spec: TrainSpec, ranks: list[dict], world_size: int, device: torch.device,
                      step_seconds: float | None = None, step_flops: float | None = None) -> dict:
    """The fields of systems.bench.schema.TrainingMeasured: throughput per GPU at `step_seconds` (default the
    ranks' median step) of `step_flops` (default the model's step FLOPs per rank)."""
    timed = phases(ranks)
    step = step_seconds or timed.step_s
    config = spec.config()
    counted = step_flops or flops(config, spec.batch_size, spec.context).step
    return dict(backend=BACKEND, phases=timed, tokens_per_s=world_size * spec.batch_size * spec.context / step,
                throughput=throughput(seconds=step, flops=counted, device=device, precision=spec.precision),
                memory_mb=memory_mb(ranks), config=to_record(config))
