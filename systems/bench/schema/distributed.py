"""Points of several ranks: the all-reduce (bench_allreduce), data-parallel steps and optimizer sharding
(bench_ddp), FSDP beside DDP (bench_fsdp) and the whole training step the leaderboard times (bench_fullstep).

A training point holds the TrainSpec its run trains (TrainingPoint), its id naming what its kind varies. The ranks
time themselves (systems.parallel.train: CUDA events on a GPU); a phase's seconds are the mean over ranks of each
rank's median over the timed steps. Model FLOPs as systems.bench.schema.model's, per GPU; the full step counts the
leaderboard's way (Flops.flash_step: attention's backward 2.5x its forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from systems.bench.breakdown import StepBreakdown
from systems.bench.schema.base import Measured, Point, Throughput
from systems.bench.schema.model import kernel_levers
from systems.levers.variant import Variant
from systems.parallel.spec import TrainSpec

# One process and torch's DistributedDataParallel come first, in grids and tables: the others compare with them.
DDP_VARIANTS = (Variant.SINGLE, Variant.TORCH, Variant.NAIVE, Variant.FLAT, Variant.INDIVIDUAL, Variant.BUCKETED)
# The FSDP comparison: one process, our bucketed DDP, our FSDP, torch's FSDP2.
FSDP_VARIANTS = (Variant.SINGLE, Variant.BUCKETED, Variant.FSDP, Variant.FSDP2)
SHARDED_BUCKET_MB = 25.0  # the sharded-optimizer points all train with DDPBucketed at this size
FSDP_DDP_BUCKET_MB = 100.0  # the bucket size of bucketed DDP beside FSDP
SHAPE = ("preset", "edition", "precision", "batch_size", "context")  # the TrainSpec fields of a point's shape
FSDP_LEVERS = ("fsdp_gather", "fsdp_prefetch")  # our FSDP's own: the ids of its points alone name them


@dataclass(frozen=True)
class TrainingPoint:
    """What a training point trains: the TrainSpec its bench runs (a nested scheme as the grid names it: the run
    resolves it where it starts), on `world_size` ranks. The first fields of the training kinds below; their ids
    begin with the shape (`shape_id`) and name the levers the kind varies (`varies`), the others the same in all
    its points."""

    spec: TrainSpec
    world_size: int
    varies: ClassVar[tuple[str, ...]] = ()

    def shape_id(self) -> str:
        spec = self.spec
        return (f"{spec.preset}-{spec.edition}-{spec.precision.name}-b{spec.batch_size}-ctx{spec.context}-"
                f"{self.world_size}ranks")

    def shows(self, name: str) -> bool:
        """Whether the point's id names the spec's field `name`: a field of its shape or a lever its kind varies,
        our FSDP's levers only beside our FSDP (the other variants do not use them)."""
        return name in SHAPE + self.varies and (name not in FSDP_LEVERS or self.spec.variant == Variant.FSDP)


@dataclass(frozen=True)
class AllReduceMeasured(Measured):
    """Per call: one all-reduce at a time, after a barrier, ended by a synchronize. Back to back: nccl-tests'
    time per all-reduce over `loop_calls` issued without host synchronization (None in runs made before it
    was), and a bare uninterrupted loop of them. Bus bandwidth = algbw · 2(n−1)/n."""

    bytes: int
    warmup_calls: int
    rounds: int
    loop_calls: int | None
    latency_s: float
    latency_spread_s: float  # between the ranks' medians
    latency_busbw_gbps: float
    loop_time_s: float | None
    loop_spread_s: float | None
    algbw_gbps: float | None
    busbw_gbps: float | None
    bare_time_s: float | None
    bare_busbw_gbps: float | None
    loop_vs_bare: float | None  # bare time / back-to-back time: 1 when the rounds' barriers cost nothing

    def seconds(self, mean: float) -> float | None:
        return self.loop_time_s


@dataclass(frozen=True)
class CollectiveShape:
    """A collective's backend, ranks and tensor size: the first fields of the kinds that time collectives."""

    backend: str
    world_size: int
    size_mb: float

    def __str__(self) -> str:
        return f"{self.backend}-{self.world_size}ranks-{self.size_mb:g}MiB"


class AllReducePoint(CollectiveShape, Point, kind="allreduce", measured=AllReduceMeasured):
    """A float32 tensor all-reduced."""


@dataclass(frozen=True)
class Phases:
    """A training step and its phases, seconds: waiting in finish_gradient_synchronization for communication,
    and (our FSDP) the time the compute stream waited on all-gathers prefetch did not hide."""

    step_s: float
    forward_s: float
    backward_s: float
    comm_wait_s: float
    optimizer_s: float
    gather_wait_s: float | None


@dataclass(frozen=True)
class TrainingMeasured(Measured):
    """What a rank-timed training step measured. Memory: per moment (construction, before and after the
    optimizer step) the largest rank's peak, MiB, on a GPU."""

    backend: str
    phases: Phases
    tokens_per_s: float  # over all ranks
    throughput: Throughput  # per GPU
    memory_mb: dict[str, float] | None
    config: dict

    def seconds(self, mean: float) -> float:
        return self.phases.step_s

    def peak_mb(self) -> float | None:
        return None if self.memory_mb is None else max(self.memory_mb.values())


@dataclass(frozen=True)
class DDPMeasured(TrainingMeasured):
    step_spread_s: float  # between the ranks' median steps
    comm_share: float  # comm_wait / step


class DDPPoint(TrainingPoint, Point, kind="ddp", measured=DDPMeasured):
    """A variant of DDP_VARIANTS at a bucket size (DDPBucketed's, torch DDP's bucket_cap_mb; None for the others)."""

    varies = ("variant", "bucket_size_mb")

    def __str__(self) -> str:
        bucket = "" if self.spec.bucket_size_mb is None else f"-{self.spec.bucket_size_mb:g}MiB"
        return f"{self.spec.variant}{bucket}-{self.shape_id()}"


@dataclass(frozen=True)
class OptimizerMeasured(Measured):
    state_mb: list[float]  # optimizer state per rank
    unsharded_state_mb: float
    state_fraction: float  # the largest rank's share of the unsharded state
    ideal_fraction: float  # 1 / ranks
    optimizer_s: float
    step_s: float
    memory_mb: dict[str, float] | None

    def seconds(self, mean: float) -> float:
        return self.step_s

    def peak_mb(self) -> float | None:
        return None if self.memory_mb is None else max(self.memory_mb.values())


class OptimizerPoint(TrainingPoint, Point, kind="optimizer", measured=OptimizerMeasured):
    """AdamW, ShardedOptimizer (ZeRO-1) or torch's ZeroRedundancyOptimizer, under DDPBucketed (SHARDED_BUCKET_MB)."""

    varies = ("optimizer",)

    def __str__(self) -> str:
        return f"{self.spec.optimizer}-{self.shape_id()}"


@dataclass(frozen=True)
class FSDPMeasured(TrainingMeasured):
    predicted_peak_mb: float | None  # the largest rank's (systems.accounting); None for FSDP2, not modelled
    peak_gathered_mb: float | None  # our FSDP's gathered weights held at once
    breakdown_per_rank: list[StepBreakdown] | None  # one profiled step per rank, on a GPU


def _fsdp_levers(spec: TrainSpec) -> str:
    """Our FSDP's levers in an id; the other variants have none."""
    return f"-{spec.fsdp_gather}-prefetch{spec.fsdp_prefetch}" if spec.variant == Variant.FSDP else ""


class FSDPPoint(TrainingPoint, Point, kind="fsdp", measured=FSDPMeasured):
    """A variant of FSDP_VARIANTS (bucketed DDP at FSDP_DDP_BUCKET_MB), ours with its gather and prefetch."""

    varies = ("variant", *FSDP_LEVERS)

    def __str__(self) -> str:
        return f"{self.spec.variant}-{self.shape_id()}{_fsdp_levers(self.spec)}"


@dataclass(frozen=True)
class FullStepMeasured(FSDPMeasured):
    do_bench_s: float | None  # the leaderboard's figure: do_bench's median on the slowest rank (GPU)
    cold_start_s: float | None  # from the pytest process's start to the end of the point's timed job
    step_pflop: float  # the leaderboard's model FLOPs of a step, all ranks
    recomputed_tflop: float  # per rank, beside them
    peak_memory_mb_per_rank: list[float] | None


class FullStepPoint(TrainingPoint, Point, kind="fullstep", measured=FullStepMeasured):
    """A whole training step with its levers: a variant of systems.parallel.train (our FSDP for the leaderboard's
    model), the attention backend, a checkpointing scheme, the cross-entropy `loss_chunk` tokens at a time
    (None: the whole logits), our FSDP's gather and prefetch, the fused kernels and regional compilation."""

    varies = ("variant", "attention", "checkpoint", "loss_chunk", *FSDP_LEVERS, "fused", "compile")

    def __str__(self) -> str:
        spec = self.spec
        loss = "full" if spec.loss_chunk is None else f"chunk{spec.loss_chunk}"
        return (f"{spec.variant}-{self.shape_id()}-{spec.attention}-ckpt-{spec.checkpoint}-loss-{loss}"
                f"{_fsdp_levers(spec)}{kernel_levers(spec.fused, spec.compile)}")
