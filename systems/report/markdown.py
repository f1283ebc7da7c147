"""Tables in markdown, the formats of their cells, and results grouped into rows by their points' fields. Each row
keeps the sources of its figures (runs.Source): a table names the machine and run of every row, in its title where
all rows share one, else in a column."""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from systems.bench.schema import Point
from systems.levers.checkpointing import Checkpointing
from systems.precision import Precision
from systems.report.runs import OutOfMemory, Result, Source, named_runs, run_spans


BATCH = "{batch sizes}"  # where a title names its rows' batch sizes: those of every machine's, once combined


@dataclass
class Table:
    name: str  # file stem
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    note: str = ""
    sources: list[tuple[Source, ...]] = field(default_factory=list)  # each row's
    batches: set[int] = field(default_factory=set)  # the rows' batch sizes, for a title holding BATCH

    def add(self, cells: list[str], *entries: Result | OutOfMemory) -> None:
        """A row, and the results (or out-of-memory points) whose figures it shows."""
        self.rows.append(cells)
        self.sources.append(tuple(entry.source for entry in entries))

    def markdown(self) -> str:
        assert len(self.sources) == len(self.rows), "a row comes with its sources: Table.add"
        machines = [", ".join(sorted({source.machine for source in sources})) for sources in self.sources]
        runs = [sorted({source.run for source in sources}) for sources in self.sources]
        named, columns, rows = [], self.columns, self.rows
        # A source every row shares is named once, in the title; else each row's, in a column before the others.
        for column, values in (("run", [", ".join(run_spans(numbers)) for numbers in runs]), ("machine", machines)):
            if len(set(values)) == 1:
                named.insert(0, named_runs(runs[0]) if column == "run" else values[0])
            elif values:
                columns, rows = [column] + columns, [[value] + row for value, row in zip(values, rows)]
        # Columns no row fills (a figure only some machines record) are left out.
        keep = [i for i in range(len(columns)) if any(row[i] for row in rows)] or range(len(columns))
        sizes = f", batch size {', '.join(map(str, sorted(self.batches)))}" if self.batches else ""
        lines = [f"### {self.title.replace(BATCH, sizes)}" + (f" — {', '.join(named)}" if named else ""), ""]
        lines += [self.note, ""] if self.note else []
        lines.append("| " + " | ".join(columns[i] for i in keep) + " |")
        lines.append("|" + "|".join("---" for _ in keep) + "|")
        lines += ["| " + " | ".join(row[i].replace("|", "\\|") for i in keep) + " |" for row in rows]
        return "\n".join(lines) + "\n"


def combined(tables: list[Table]) -> Table:
    """Tables of one name, each built from one machine's results, as one: their rows one machine after another,
    under all their columns (a figure only some machines record stays empty in the others' rows)."""
    keyed = [_keyed(table.columns) for table in tables]
    columns = list(keyed[0])
    for keys in keyed[1:]:
        for i, key in enumerate(keys):
            if key not in columns:
                columns.insert(columns.index(keys[i - 1]) + 1 if i else 0, key)
    out = Table(tables[0].name, tables[0].title, [name for name, _ in columns], note=tables[0].note,
                batches=set().union(*(table.batches for table in tables)))
    for table, keys in zip(tables, keyed):
        at = {key: i for i, key in enumerate(keys)}
        out.rows += [[row[at[key]] if key in at else "" for key in columns] for row in table.rows]
        out.sources += table.sources
    return out


def _keyed(columns: list[str]) -> list[tuple[str, int]]:
    """Columns told apart where two share a name: (name, how many before it have that name)."""
    return [(column, columns[:i].count(column)) for i, column in enumerate(columns)]


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


def pivot(results: Iterable[Result], keys: list[str], column: str,
          oom: Iterable[OutOfMemory] = ()) -> dict[tuple, dict]:
    """{key values: {value of `column`: result, or its point that ran out of memory}}, sorted by key."""
    grid = defaultdict(dict)
    for r in results:
        grid[fields_of(r.point, keys)][plain(getattr(r.point, column))] = r
    for entry in oom:
        grid[fields_of(entry.point, keys)].setdefault(plain(getattr(entry.point, column)), entry)
    return {key: grid[key] for key in sorted(grid, key=lambda key: tuple(map(order, key)))}


def cell(entry, fmt: Callable[[Result], str]) -> str:
    if entry is None:
        return ""
    return "OOM" if isinstance(entry, OutOfMemory) else fmt(entry)


def sorted_by(results: Iterable[Result], keys: list[str]) -> list[Result]:
    return sorted(results, key=lambda r: tuple(map(order, fields_of(r.point, keys))))


def batch_sizes(results: list[Result]) -> set[int]:
    return {r.point.batch for r in results}
