"""Points of the CS336 2026 edition's own measurements: one SwiGLU layer under section 8's layouts (bench_ffn),
the collectives' bandwidth that calibrates the section's W (bench_ffn), and the leaderboard's training step timed
as the course times it (bench_leaderboard).

An FFN point's matmul FLOPs are section 8's: 6 B D F forward and 12 B D F backward (the handout's eqs. 20-30:
x requires its gradient), split evenly over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from systems.bench.schema.base import Measured, Point
from systems.bench.schema.distributed import CollectiveShape
from systems.bench.schema.model import kernel_levers
from systems.levers.checkpointing import Checkpointing
from systems.levers.variant import Variant
from systems.model import Attention, Fused
from systems.parallel.spec import TrainSpec
from systems.parallel.swiglu import FFNLayout, Placement
from systems.precision import Precision


@dataclass(frozen=True)
class Passes:
    """Seconds of a forward and a backward pass: the mean over ranks of each rank's median round."""

    forward_s: float
    backward_s: float

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class FFNMeasured(Measured):
    """One step of the layer and its parts on each rank (systems.bench.ffn says how each is timed)."""

    backend: str
    rows: int  # this rank's rows of the batch
    d_ff_per_rank: int  # its share of d_ff
    step: Passes  # the layout's step, collectives and their synchronization included
    compute: Passes  # the rank's matmuls alone
    comm: Passes  # the handout's collectives of the layout alone, back to back
    exposed: Passes  # step - compute, at least 0: communication the step did not hide
    sent_forward: dict[str, float]  # bytes one rank sent, by kind of collective (systems.parallel.issued)
    sent_backward: dict[str, float]
    layer_tflops: float  # C: the whole layer's matmuls (B rows, all of d_ff) on one device, TFLOP/s

    def seconds(self, mean: float) -> float:
        return self.step.step_s


class FFNPoint(Point, kind="ffn", measured=FFNMeasured):
    layout: FFNLayout
    data: int  # ranks that split the batch
    tensor: int  # ranks that split d_ff
    batch: int  # B, the whole batch's rows
    d_model: int
    d_ff: int
    precision: Precision  # one of systems.precision.DTYPES: weights, activations and collectives in it
    backend: str

    def __post_init__(self):
        self.placement.check_shape(self.batch, self.d_ff)

    @property
    def placement(self) -> Placement:
        return Placement(self.layout, self.data, self.tensor)

    @property
    def world_size(self) -> int:
        return self.data * self.tensor

    def __str__(self) -> str:
        return (f"{self.placement}-b{self.batch}-d{self.d_model}-f{self.d_ff}-{self.precision.name}"
                f"-{self.backend}")


@dataclass(frozen=True)
class CollectiveBandwidth:
    seconds: float  # per collective, back to back: the mean over ranks of each rank's median round
    busbw_gbps: float  # W: bytes a rank sends in it (the ring's count) / seconds, nccl-tests' bus bandwidth


@dataclass(frozen=True)
class FFNBandwidthMeasured(Measured):
    bytes: int  # S, the whole tensor
    all_reduce: CollectiveBandwidth
    all_gather: CollectiveBandwidth
    reduce_scatter: CollectiveBandwidth

    def seconds(self, mean: float) -> float:
        return self.all_reduce.seconds

    def by_kind(self) -> dict[str, CollectiveBandwidth]:
        return {"all-reduce": self.all_reduce, "all-gather": self.all_gather, "reduce-scatter": self.reduce_scatter}


class FFNBandwidthPoint(CollectiveShape, Point, kind="ffn_bandwidth", measured=FFNBandwidthMeasured):
    precision: Precision

    def __str__(self) -> str:
        return f"{super().__str__()}-{self.precision.name}"


@dataclass(frozen=True)
class LeaderboardMeasured(Measured):
    """The course's timing of a training step (systems.leaderboard): do_bench's default figure, its mean, is the
    leaderboard's; its median beside it. `timer` says which ran: triton.testing.do_bench on a GPU, its
    algorithm on the host clock on a CPU."""

    timer: str
    mean_s: float  # the slowest rank's
    median_s: float | None  # None where the GPU's triton returns no per-step times
    warmup_steps: int  # what do_bench ran within its budgets
    timed_steps: int
    rep_ms_run: float  # the budgets handed to do_bench: the point's, or between step counts on several ranks
    warmup_ms_run: float
    first_loss: float  # the first step's loss, the mean over ranks
    peak_memory_mb_per_rank: list[float] | None
    cold_start_s: float | None  # from this pytest process's start to the end of the timing

    def seconds(self, mean: float) -> float:
        return self.mean_s

    def peak_mb(self) -> float | None:
        return None if self.peak_memory_mb_per_rank is None else max(self.peak_memory_mb_per_rank)


class LeaderboardPoint(Point, kind="leaderboard", measured=LeaderboardMeasured):
    """The leaderboard's step on `world_size` ranks, over the whole batch of `batch` sequences (the handout's 2),
    each rank its share: `model` ours (our FSDP, with its levers) or the course's cs336_basics (our FSDP around
    it). `rep_ms` and `warmup_ms` are do_bench's budgets (the handout's: 30000 and 10000)."""

    model: str  # "ours" or "cs336_basics"
    preset: str
    edition: str
    precision: Precision
    batch: int
    context: int
    world_size: int
    attention: Attention | None  # ours only
    checkpoint: Checkpointing | None
    loss_chunk: int | None
    rep_ms: float
    warmup_ms: float
    fused: Fused = Fused.NONE  # ours: the model's fused Triton kernels
    compile: bool = False  # ours: each block through torch.compile

    def spec(self) -> TrainSpec:
        """Ours: the run of one rank's share of the batch, which do_bench times."""
        if self.model != "ours":
            raise ValueError(f"the {self.model} model is not ours: it has no TrainSpec")
        return TrainSpec(preset=self.preset, edition=self.edition, variant=Variant.FSDP, precision=self.precision,
                         batch_size=self.batch // self.world_size, context=self.context, checkpoint=self.checkpoint,
                         loss_chunk=self.loss_chunk, attention=self.attention, fused=self.fused, compile=self.compile)

    def __str__(self) -> str:
        levers = "" if self.model != "ours" else (f"-{self.attention}-{self.checkpoint}-loss"
                                                  f"{self.loss_chunk or 'full'}"
                                                  f"{kernel_levers(self.fused, self.compile)}")
        return (f"{self.model}-{self.preset}-{self.edition}-{self.precision.name}-b{self.batch}-ctx{self.context}"
                f"-{self.world_size}ranks{levers}-rep{self.rep_ms:g}-warmup{self.warmup_ms:g}")
