"""Points of one process training the model: a phase of a step (bench_model), the warm-up study, a step under a
checkpointing scheme and the longest context a scheme trains (bench_checkpoint).

Their FLOPs are the model's matmuls (systems.accounting.flops: projections, attention's causal half, LM head;
backward twice the forward, recomputation not counted); MFU is against the GPU's dense peak for the precision.
`config` records the whole TransformerConfig that ran, so a figure is never read against another shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from systems.bench.schema.base import Measured, Point, Throughput
from systems.levers.checkpointing import Checkpointing
from systems.model import Attention, Fused
from systems.precision import Precision

MODEL_PHASES = ("forward", "backward", "forward_backward", "step")


@dataclass(frozen=True)
class ModelSettings:
    """What a one-process point runs: a preset of an edition, the batch and context it takes, in a precision,
    with an attention backend. The first fields of the kinds below, and of their ids."""

    preset: str
    edition: str
    batch: int
    context: int
    precision: Precision
    attention: Attention

    def settings_id(self) -> str:
        return (f"{self.preset}-{self.edition}-b{self.batch}-ctx{self.context}-{self.precision.name}-"
                f"{self.attention}")


@dataclass(frozen=True)
class ModelMeasured(Measured):
    parameters: int
    tokens_per_s: float | None  # None under --benchmark-disable, where nothing is timed
    throughput: Throughput | None
    peak_memory_mb: float | None  # over the timed rounds, on a GPU
    config: dict


class ModelPoint(ModelSettings, Point, kind="model", measured=ModelMeasured):
    compile: str  # "eager", or a --compile-mode
    phase: str  # one of MODEL_PHASES

    def __str__(self) -> str:
        return f"{self.settings_id()}-{self.compile}-{self.phase}"


@dataclass(frozen=True)
class WarmupMeasured(Measured):
    peak_memory_mb: float | None
    config: dict


class WarmupPoint(ModelSettings, Point, kind="warmup", measured=WarmupMeasured):
    """Forward+backward on a fresh eager model, timed after `warmup_steps` untimed steps."""

    warmup_steps: int

    def __str__(self) -> str:
        return f"{self.settings_id()}-warmup{self.warmup_steps}"


@dataclass(frozen=True)
class CheckpointMeasured(Measured):
    """A training step's memory under its scheme, measured (GPU) and predicted (systems.accounting), in MiB.
    Activation memory is the peak less the state a step starts with (weights, buffers, AdamW's)."""

    levels: tuple[int, ...]  # the scheme's segment sizes for this model (nested's resolved)
    parameters: int
    state_mb: float
    predicted_peak_mb: float
    predicted_activation_mb: float
    peak_memory_mb: float | None
    activation_mb: float | None
    recomputed_tflop: float  # the backward's recomputed forward, beside the model FLOPs MFU counts
    tokens_per_s: float | None
    throughput: Throughput | None
    config: dict


class CheckpointPoint(ModelSettings, Point, kind="checkpoint", measured=CheckpointMeasured):
    """A training step under a checkpointing scheme, with the model's fused kernels and regional compilation
    (TransformerConfig.fused, .compile)."""

    scheme: Checkpointing
    fused: Fused = Fused.NONE
    compile: bool = False

    def __str__(self) -> str:
        return f"{self.settings_id()}-{self.scheme}{kernel_levers(self.fused, self.compile)}"


def kernel_levers(fused: Fused, compile: bool) -> str:
    """The fused kernels and regional compilation in an id, where they are on (ids saved before them stand)."""
    return ("" if fused == Fused.NONE else f"-fused-{fused}") + ("-compiled" if compile else "")


@dataclass(frozen=True)
class ContextSearchMeasured(Measured):
    largest_context: int | None  # None: not even `start` trained
    first_oom_context: int | None  # None: every context up to `limit` trained
    predicted_largest_context: int  # the accounting's, on an 80 GB H100
    at_longest: CheckpointMeasured  # a step timed at the longest context that trained (or at `start`)

    def peak_mb(self) -> float | None:
        return self.at_longest.peak_memory_mb


class ContextSearchPoint(Point, kind="context_search", measured=ContextSearchMeasured):
    """The longest context, doubling from `start` up to `limit`, at which a preset trains with a scheme."""

    preset: str
    edition: str
    batch: int
    precision: Precision
    attention: Attention
    scheme: Checkpointing
    start: int
    limit: int

    def __str__(self) -> str:
        return (f"{self.preset}-{self.edition}-b{self.batch}-{self.precision.name}-{self.attention}-{self.scheme}"
                f"-ctx{self.start}to{self.limit}")
