"""Tables in markdown, the formats of their cells, and results grouped into rows."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

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


def number(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.0f}"


def order(value) -> tuple:
    """Sorts numbers before text, None last, within a column."""
    if value is None:
        return (2, 0, "")
    return (0, value, "") if isinstance(value, (int, float)) else (1, 0, str(value))


def pivot(results: Iterable[Result], keys: list[str], column: str, oom: Iterable[dict] = ()) -> dict[tuple, dict]:
    """{key values: {value of `column`: result, or "OOM"}}, sorted by key."""
    grid = defaultdict(dict)
    for r in results:
        grid[tuple(r.get(k) for k in keys)][r.get(column)] = r
    for point in oom:
        grid[tuple(point.get(k) for k in keys)].setdefault(point.get(column), "OOM")
    return {key: grid[key] for key in sorted(grid, key=lambda key: tuple(map(order, key)))}


def cell(entry, fmt: Callable[[Result], str]) -> str:
    if entry is None:
        return ""
    return entry if isinstance(entry, str) else fmt(entry)


def sorted_by(results: Iterable[Result], keys: list[str]) -> list[Result]:
    return sorted(results, key=lambda r: tuple(order(r.get(k)) for k in keys))


def batch_sizes(results: list[Result], key: str = "batch_size") -> str:
    sizes = sorted({r.get(key) for r in results if r.get(key) is not None})
    return f", batch size {', '.join(map(str, sizes))}" if sizes else ""
