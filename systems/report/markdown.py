"""Tables in markdown, the formats of their cells, and results grouped into rows by their points' fields."""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from systems.bench.schema import Point
from systems.levers.checkpointing import Checkpointing
from systems.precision import Precision
from systems.report.runs import Result


@dataclass
class Table:
    name: str  # file stem
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    note: str = ""

    def markdown(self) -> str:
        # Columns no row fills (a figure only some machines record) are left out.
        keep = [i for i in range(len(self.columns)) if any(row[i] for row in self.rows)] or range(len(self.columns))
        lines = [f"### {self.title}", ""] + ([self.note, ""] if self.note else [])
        lines.append("| " + " | ".join(self.columns[i] for i in keep) + " |")
        lines.append("|" + "|".join("---" for _ in keep) + "|")
        lines += ["| " + " | ".join(row[i].replace("|", "\\|") for i in keep) + " |" for row in self.rows]
        return "\n".join(lines) + "\n"


def ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.4g}"


def ms_pm(result: Result) -> str:
    return f"{ms(result.mean)} ± {result.stddev * 1e3:.2g}"


def plain(value):
    """A point's field as tables show and sort it: a precision by its name, a choice or a scheme as text."""
    if isinstance(value, Precision):
        return value.name
    if isinstance(value, (enum.Enum, Checkpointing)):
        return str(value)
    return value


def number(value) -> str:
    value = plain(value)
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def fields_of(point: Point, keys: list[str]) -> tuple:
    """The point's values of `keys` (its dataclass fields: a name it lacks is an error), as tables show them."""
    return tuple(plain(getattr(point, key)) for key in keys)


def bytes_as_mib(nbytes: float) -> str:
    """A figure in bytes, as the tables show memory: whole MiB with thousands separated."""
    return f"{nbytes / 2**20:,.0f}"


def mib(mebibytes: float | None) -> str:
    """A figure already in MiB, as the tables show memory: whole MiB with thousands separated."""
    return "" if mebibytes is None else f"{mebibytes:,.0f}"


def order(value) -> tuple:
    """Sorts numbers before text, None last, within a column."""
    value = plain(value)
    if value is None:
        return (2, 0, "")
    return (0, value, "") if isinstance(value, (int, float)) else (1, 0, str(value))


def pivot(results: Iterable[Result], keys: list[str], column: str, oom: Iterable[Point] = ()) -> dict[tuple, dict]:
    """{key values: {value of `column`: result, or "OOM"}}, sorted by key."""
    grid = defaultdict(dict)
    for r in results:
        grid[fields_of(r.point, keys)][plain(getattr(r.point, column))] = r
    for point in oom:
        grid[fields_of(point, keys)].setdefault(plain(getattr(point, column)), "OOM")
    return {key: grid[key] for key in sorted(grid, key=lambda key: tuple(map(order, key)))}


def cell(entry, fmt: Callable[[Result], str]) -> str:
    if entry is None:
        return ""
    return entry if isinstance(entry, str) else fmt(entry)


def sorted_by(results: Iterable[Result], keys: list[str]) -> list[Result]:
    return sorted(results, key=lambda r: tuple(map(order, fields_of(r.point, keys))))


def batch_sizes(results: list[Result]) -> str:
    sizes = sorted({r.point.batch for r in results})
    return f", batch size {', '.join(map(str, sizes))}" if sizes else ""
