"""Points of attention on its own (bench_attention): the CS336 handout's sweep, the FlashAttention sweep and the
leaderboard's configuration.

FLOPs: forward 4·b·h·n_q·n_k·d, halved when causal; backward 2.5x the forward (FlashAttention's convention).
"""

from __future__ import annotations

from dataclasses import dataclass

from systems.bench.schema.base import Measured, Point, Throughput
from systems.precision import Precision

ATTENTION_PASSES = ("forward", "backward", "forward_backward")


@dataclass(frozen=True)
class AttentionSweep:
    batch: int
    is_causal: bool
    passes: tuple[str, ...]


# The CS336 handout's sweep: batch 8, no mask, forward and backward timed apart. The FlashAttention sweep: batch 1,
# causal. Both one head. The leaderboard: (16, 16384, 64) bf16 causal, every pass, beside SDPA.
ATTENTION_SWEEPS = {"handout": AttentionSweep(8, False, ATTENTION_PASSES[:2]),
                    "flash": AttentionSweep(1, True, ATTENTION_PASSES),
                    "leaderboard": AttentionSweep(16, True, ATTENTION_PASSES)}


@dataclass(frozen=True)
class AttentionMeasured(Measured):
    ms: float  # median of the timed calls, host time included
    throughput: Throughput
    peak_memory_mb: float | None  # on a GPU
    memory_before_backward_mb: float | None  # what the forward left for the backward (backward points, GPU)
    # The forward kernels' own time, replayed from a CUDA graph (triton, gluon and sdpa forward points, GPU);
    # triton's and gluon's with SDPA's taken in turns on the same inputs.
    device_ms: float | None
    sdpa_device_ms: float | None
    # The leaderboard's: do_bench medians of the point's implementation (triton through torch.compile, gluon eager,
    # flex compiled) and of SDPA on the same inputs.
    do_bench_ms: float | None
    sdpa_do_bench_ms: float | None


class AttentionPoint(Point, kind="attention", measured=AttentionMeasured):
    sweep: str  # an ATTENTION_SWEEPS key
    impl: str  # a systems.attention.BENCHED_BACKENDS name
    batch: int
    seq: int
    d: int
    precision: Precision  # one of systems.precision.DTYPES
    is_causal: bool
    pass_: str  # one of ATTENTION_PASSES
    first_seq: int | None = None  # the leaderboard's compiled function first called at this sequence length

    def __str__(self) -> str:
        mask = "causal" if self.is_causal else "full"
        first = "" if self.first_seq is None else f"-after-seq{self.first_seq}"
        return f"{self.impl}-b{self.batch}-seq{self.seq}-d{self.d}-{self.precision.name}-{mask}-{self.pass_}{first}"
