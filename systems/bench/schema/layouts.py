"""Points of bench_layouts: one model's training step with its ranks laid out as replicas x shards: DDP (N x 1),
FSDP (1 x N), HSDP (R x S, ours and torch's) and one process beside them, and what each axis of the layout
carries.

The step and its phases as the other training benches measure them (TrainingMeasured). Per axis with more than one
rank: the bytes a rank sends on it per step, as systems.accounting.traffic counts the step's collectives (ring
bytes; tests/test_hsdp.py checks our FSDP's against the bytes counted from a run), and the seconds those
collectives take on that axis's groups alone, timed back to back after the training steps with nothing else
running: the axis's time in communication were none of it hidden, and so its bus bandwidth, bytes / seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from systems.bench.schema.base import Point
from systems.bench.schema.distributed import TrainingMeasured
from systems.levers.layout import Layout
from systems.levers.variant import Variant
from systems.parallel.spec import TrainSpec

# One process first (the compute every layout adds communication to), then DDP, FSDP, ours and torch's HSDP.
LAYOUT_VARIANTS = (Variant.SINGLE, Variant.BUCKETED, Variant.FSDP, Variant.HSDP, Variant.TORCH_HSDP)
LAYOUT_BUCKET_MB = 25.0  # DDPBucketed's buckets in these points: torch DDP's default bucket_cap_mb


@dataclass(frozen=True)
class AxisComm:
    """One axis of a point's layout, per rank and step."""

    ranks: int  # in each of its groups
    sent_mb: float  # MiB a rank sends (systems.accounting.traffic)
    seconds: float  # the step's collectives on it alone, back to back: the slowest rank's median
    busbw_gbps: float  # sent / seconds, GB/s

    @classmethod
    def of(cls, ranks: int, sent_bytes: int, seconds: float) -> AxisComm:
        return cls(ranks, sent_bytes / 2**20, seconds, sent_bytes / seconds / 1e9)


@dataclass(frozen=True)
class LayoutMeasured(TrainingMeasured):
    axes: dict[str, AxisComm]  # "shard", "replicate": those with more than one rank


class LayoutPoint(Point, kind="layout", measured=LayoutMeasured):
    """A variant of LAYOUT_VARIANTS training its spec (DDPBucketed's buckets LAYOUT_BUCKET_MB) over `layout`, which
    the spec holds for the meshed variants; the others' is the one they take over its ranks."""

    spec: TrainSpec
    layout: Layout  # replicas x shards (one process: 1 x 1)

    def __post_init__(self):
        if self.spec.layout_for(self.layout.world_size) != self.layout:
            raise ValueError(f"{self.spec.variant} over {self.layout.world_size} ranks is laid out as "
                             f"{self.spec.layout_for(self.layout.world_size)}, not {self.layout}")

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def __str__(self) -> str:
        spec = self.spec
        return (f"{spec.variant}-{self.layout}-{spec.preset}-{spec.edition}-{spec.precision.name}-b{spec.batch_size}"
                f"-ctx{spec.context}")
