"""Benchmark points: one dataclass per kind, the one definition of what a point is.

A point names its test id (`str(point)`; saved histories are keyed by these ids, so they never change) and is
saved whole in its benchmark's `extra_info["point"]`, and in the history's out-of-memory list when it ran out
of memory, as `point.to_dict()`, which records its kind (`class ModelPoint(Point, kind="model")`). The report
reads it back with `read_point`. The names the benches and the report share (phases, passes, DDP variants,
timing keys) are defined here or imported from where they are.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import ClassVar, dataclass_transform

from systems.parallel.train import PHASES as DDP_PHASES
from systems.parallel.train import SHARDED, VARIANTS
from systems.precision import Precision, get_precision

POINT = "point"  # the extra_info key that holds the point
MODEL_PHASES = ("forward", "backward", "forward_backward", "step")
ATTENTION_PASSES = ("forward", "backward", "forward_backward")
DDP_TIMINGS = ("step", *DDP_PHASES)  # each saved in seconds under seconds_key(name)
# One process and torch's DistributedDataParallel come first, in grids and tables: the others compare with them.
DDP_BASELINES = ("single", "torch")
DDP_VARIANTS = (*DDP_BASELINES, *(variant for variant in VARIANTS if variant not in (*DDP_BASELINES, *SHARDED)))
# The FSDP comparison: one process, our bucketed DDP, our FSDP, torch's FSDP2.
FSDP_VARIANTS = ("single", "bucketed", *SHARDED)
FSDP_TIMINGS = (*DDP_TIMINGS, "gather_wait")


def seconds_key(timing: str) -> str:
    return f"{timing}_s"


KINDS: dict[str, type[Point]] = {}  # each kind's point class, for read_point


@dataclass_transform(frozen_default=True)
class Point:
    """What the points share: each kind is a frozen dataclass of its fields, registered under its kind; its
    record, and reading it back with the fields' own types."""

    kind: ClassVar[str]

    def __init_subclass__(cls, kind: str, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if kind in KINDS:
            raise ValueError(f"point kind {kind!r} is taken by {KINDS[kind].__name__}")
        cls.kind = kind
        dataclass(frozen=True)(cls)
        KINDS[kind] = cls

    def to_dict(self) -> dict:
        """The kind and every field, a precision by its name. A field named after a Python keyword carries a
        trailing underscore (`pass_`); its key is the word."""
        record = {"kind": self.kind}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            record[f.name.removesuffix("_")] = value.name if isinstance(value, Precision) else value
        return record

    @classmethod
    def from_dict(cls, record: dict) -> Point:
        """The point of a record, each field converted to its declared type (JSON and test ids give numbers as
        text or as ints where the field is a float). A missing field is a KeyError, unless it has a default: a
        field added after histories were saved, whose default is what those points ran with."""
        hints = typing.get_type_hints(cls)
        return cls(**{f.name: _typed(hints[f.name], record[key]) for f in dataclasses.fields(cls)
                      if (key := f.name.removesuffix("_")) in record or f.default is dataclasses.MISSING})


def _typed(hint, value):
    if value is None:
        return None
    if hint is Precision:
        return get_precision(value)
    kind = next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))  # float | None -> float
    if kind is bool and not isinstance(value, bool):
        raise TypeError(f"{value!r} is not a bool")
    return kind(value)


class ModelPoint(Point, kind="model"):
    preset: str
    context: int
    precision: Precision
    compile: str  # "eager", or a --compile-mode
    phase: str  # one of MODEL_PHASES

    def __str__(self) -> str:
        return f"{self.preset}-ctx{self.context}-{self.precision.name}-{self.compile}-{self.phase}"


@dataclass(frozen=True)
class AttentionSweep:
    batch: int
    is_causal: bool
    passes: tuple[str, ...]


# The CS336 handout's sweep: batch 8, no mask, forward and backward timed apart. The FlashAttention sweep: batch 1,
# causal. Both one head.
ATTENTION_SWEEPS = {"handout": AttentionSweep(8, False, ATTENTION_PASSES[:2]),
                    "flash": AttentionSweep(1, True, ATTENTION_PASSES)}


class AttentionPoint(Point, kind="attention"):
    sweep: str  # an ATTENTION_SWEEPS key, or "leaderboard"
    impl: str
    batch: int
    seq: int
    d: int
    precision: Precision  # one of systems.precision.DTYPES
    is_causal: bool
    pass_: str  # one of ATTENTION_PASSES

    def __str__(self) -> str:
        return f"{self.impl}-seq{self.seq}-d{self.d}-{self.precision.name}-{self.pass_}"


class AllReducePoint(Point, kind="allreduce"):
    backend: str
    world_size: int
    size_mb: float

    def __str__(self) -> str:
        return f"{self.backend}-{self.world_size}ranks-{self.size_mb:g}MiB"


class DDPPoint(Point, kind="ddp"):
    variant: str  # one of DDP_VARIANTS
    bucket_size_mb: float | None  # DDPBucketed's, and torch DDP's bucket_cap_mb
    precision: Precision
    context: int
    world_size: int

    def __str__(self) -> str:
        bucket = f"-{self.bucket_size_mb:g}MiB" if self.variant == "bucketed" else ""
        return f"{self.variant}{bucket}-{self.precision.name}-ctx{self.context}-{self.world_size}ranks"


def scheme_name(scheme: str, blocks: int | None) -> str:
    """A checkpointing scheme as ids and tables show it: none, every4, nested."""
    return f"every{blocks}" if scheme == "blocks" else scheme


class CheckpointPoint(Point, kind="checkpoint"):
    """A training step with activation checkpointing; "blocks" takes segments of `blocks` blocks."""

    preset: str
    batch: int
    context: int
    precision: Precision
    attention: str
    scheme: str  # one of systems.accounting.SCHEMES
    blocks: int | None

    def __str__(self) -> str:
        scheme = scheme_name(self.scheme, self.blocks)
        return f"{self.preset}-b{self.batch}-ctx{self.context}-{self.precision.name}-{self.attention}-{scheme}"


class ContextSearchPoint(Point, kind="context_search"):
    """The longest context, doubling from `start` up to `limit`, at which a preset trains with a scheme."""

    preset: str
    batch: int
    precision: Precision
    attention: str
    scheme: str  # one of systems.accounting.SCHEMES
    blocks: int | None
    start: int
    limit: int

    def __str__(self) -> str:
        scheme = scheme_name(self.scheme, self.blocks)
        return (f"{self.preset}-b{self.batch}-{self.precision.name}-{self.attention}-{scheme}"
                f"-ctx{self.start}to{self.limit}")


class FSDPPoint(Point, kind="fsdp"):
    variant: str  # one of FSDP_VARIANTS
    preset: str
    precision: Precision
    context: int
    batch_size: int  # per rank
    world_size: int
    prefetch: int = 1  # our FSDP's all-gathers in flight ahead of the computing layer; 1 for the other variants
    gather: str = "layer"  # what one of our FSDP's collectives covers (fsdp.GATHERS); older runs gathered layers

    def __str__(self) -> str:
        depth = f"-prefetch{self.prefetch}" if self.prefetch != 1 else ""  # depth 1's ids predate the field
        blocks = "-block" if self.gather == "block" else ""  # so do per-layer ids
        return (f"{self.variant}-{self.preset}-{self.precision.name}-ctx{self.context}-b{self.batch_size}"
                f"-{self.world_size}ranks{depth}{blocks}")


class FullStepPoint(Point, kind="fullstep"):
    """A whole training step with its levers: a variant of systems.parallel.train (our FSDP for the leaderboard's
    model), the attention backend, checkpointed segments of `checkpoint_blocks` blocks (None: none) and the
    cross-entropy `loss_chunk` tokens at a time (None: the whole logits)."""

    variant: str
    preset: str
    precision: Precision
    context: int
    batch_size: int  # per rank
    world_size: int
    attention: str
    checkpoint_blocks: int | None
    loss_chunk: int | None
    gather: str = "layer"  # what one of our FSDP's collectives covers; older runs gathered layers

    def __str__(self) -> str:
        checkpoint = "none" if self.checkpoint_blocks is None else f"every{self.checkpoint_blocks}"
        loss = "full" if self.loss_chunk is None else f"chunk{self.loss_chunk}"
        blocks = "-block" if self.gather == "block" else ""  # per-layer ids predate the field
        return (f"{self.variant}-{self.preset}-{self.precision.name}-ctx{self.context}-b{self.batch_size}"
                f"-{self.world_size}ranks-{self.attention}-ckpt-{checkpoint}-loss-{loss}{blocks}")


def read_point(record: dict) -> Point:
    """The point a `to_dict` record holds."""
    return KINDS[record["kind"]].from_dict(record)
