"""What every benchmark point shares: its kind, its test id, its measured dataclass, and its record.

A point kind is a frozen dataclass of the levers that decide what is measured (`class ModelPoint(Point,
kind="model", measured=ModelMeasured)`), beside a dataclass of what a run of it measures. A benchmark saves both
whole in its `extra_info` (`POINT` and `MEASURED`, systems.bench.schema.records' typed records), and a point that
ran out of memory is saved with its point alone. The report reads them back by kind; `str(point)` is the test
id, and so the key of the point in every history.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, dataclass_transform

from systems.bench.schema.records import NewerSchema, SchemaError, from_record, to_record

POINT, MEASURED = "point", "measured"  # the extra_info keys of a benchmark's point and measurements


@dataclass(frozen=True)
class Measured:
    """What a run of a point measured. `seconds` is its headline time, the figure runs are compared by:
    pytest-benchmark's mean over rounds unless the kind times itself (the ranks' step)."""

    def seconds(self, mean: float) -> float | None:
        return mean

    def peak_mb(self) -> float | None:
        """The most memory the point held, MiB, where it was measured (a GPU): a kind that measures one peak names
        it `peak_memory_mb`; a kind that measures several says which is the most."""
        return getattr(self, "peak_memory_mb", None)


@dataclass(frozen=True)
class Throughput:
    """Achieved TFLOP/s of the FLOPs the kind counts (its module says which), and on a GPU with a known peak the
    model FLOPs utilization against that peak (systems.bench.timing.PEAK_TFLOPS)."""

    tflops: float
    peak_tflops: float | None
    mfu: float | None


KINDS: dict[str, type[Point]] = {}


@dataclass_transform(frozen_default=True)
class Point:
    """A point kind: a frozen dataclass of its levers, registered under its kind with its measured dataclass."""

    kind: ClassVar[str]
    measured: ClassVar[type[Measured]]

    def __init_subclass__(cls, kind: str, measured: type[Measured], **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if kind in KINDS:
            raise ValueError(f"point kind {kind!r} is taken by {KINDS[kind].__name__}")
        cls.kind, cls.measured = kind, measured
        dataclass(frozen=True)(cls)
        KINDS[kind] = cls

    def to_record(self) -> dict:
        return {"kind": self.kind} | to_record(self)

    def replace(self, **changes) -> Point:
        return dataclasses.replace(self, **changes)


def read_point(record: dict) -> Point:
    """The point a `to_record` record holds."""
    if not isinstance(record, dict) or "kind" not in record:
        raise SchemaError(f"a point record names its kind, got {record!r}")
    kind = record["kind"]
    if kind not in KINDS:
        raise NewerSchema(f"unknown point kind {kind!r} (saved by a newer schema?); this code knows "
                          f"{', '.join(KINDS)}")
    return from_record(KINDS[kind], {k: v for k, v in record.items() if k != "kind"}, f"{kind} point")


def read_measured(point: Point, record: dict) -> Measured:
    return from_record(point.measured, record, f"{point.kind} measurements")
