"""Every point's value over the saved runs of each machine, commit by commit: the data of the HTML report's
regressions view (systems.report.html).

A machine is the GPU kind and how many the host had ("2 x H200"), or "CPU": histories of every GPU kind share one
folder per Python and OS, and a point timed on 1 and on 4 H100s is two histories. Runs are read with the report's
typed loader, complete runs only (like the gate and the markdown report), ordered by their commit's time and then
their own, and each point shows the median of its rounds: the statistic the gate compares.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from systems.bench.history import HistoryError, check_history, is_complete
from systems.report.runs import ReportError, Run, load_run

CPU = "CPU"  # systems.report.runs.machine_label's name for a run without a GPU


@dataclass(frozen=True)
class Saved:
    """One complete saved run, with what the typed Run leaves out: its commit time and medians."""

    run: Run
    commit_time: datetime  # the run's own time where the history has no commit time
    run_time: datetime
    dirty: bool  # timed with uncommitted changes
    medians: dict[str, float]  # benchmark name: median of its rounds, seconds

    @property
    def machine(self) -> str:
        return self.run.sources[0].machine

    @property
    def file(self) -> str:
        return self.run.paths[0].name

    @property
    def commit(self) -> str:
        """The commit as the view labels it: its first 7 characters ("unknown" for histories saved without)."""
        return self.run.commit[:7]


def load_saved(storage: Path) -> list[Saved]:
    """Every complete run under `storage` (all its machine folders), oldest commit first."""
    if not storage.is_dir():
        raise ReportError(f"no benchmark history at {storage}")
    paths = sorted(storage.glob("*/*.json"))
    if not paths:
        raise ReportError(f"no saved runs under {storage}")
    saved = [_saved(path) for path in paths]
    return sorted((s for s in saved if s is not None), key=lambda s: (s.commit_time, s.run_time))


def _saved(path: Path) -> Saved | None:
    run = load_run(path)  # a malformed history stops here, named
    try:
        history = check_history(path, json.loads(path.read_text()))  # and one without the medians, here
    except HistoryError as exc:
        raise ReportError(str(exc)) from None
    if not is_complete(history):
        return None
    commit = history.get("commit_info") or {}
    return Saved(run=run, commit_time=_when(commit.get("time") or run.datetime, path.name),
                 run_time=_when(run.datetime, path.name), dirty=bool(commit.get("dirty")),
                 medians={bench["name"]: float(bench["stats"]["median"]) for bench in history["benchmarks"]})


def _when(text: str, file: str) -> datetime:
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError:
        raise ReportError(f"{file}: its time {text!r} is not an ISO date") from None
    # Histories written without a zone were timed in UTC, as pytest-benchmark writes them.
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=timezone.utc)


def kind_of(result) -> str:
    """The point kind a result is picked by: its point's, or its test's for a benchmark saved without a point."""
    return result.point.kind if result.point is not None else result.test


def machines(saved: list[Saved]) -> list[str]:
    """The machines in the order the page lists them: the CPU first, then by GPU kind and count."""
    def order(label: str) -> tuple:
        count, _, gpu = label.partition(" x ")
        return (label != CPU, gpu, int(count) if count.isdigit() else 0)

    return sorted({s.machine for s in saved}, key=order)


def histories(saved: list[Saved]) -> dict:
    """{machine: {kind: {benchmark name: [one entry per run that holds it, in commit order]}}}, as the page embeds
    it, each kind's points longest history first (the page shows the first). An entry: run file, commit, run time,
    median (ms), rounds, and "uncommitted changes" where the run was timed with some."""
    view: dict = {machine: defaultdict(lambda: defaultdict(list)) for machine in machines(saved)}
    for s in saved:
        for result in s.run.results:
            view[s.machine][kind_of(result)][result.name].append(
                {"run": s.file, "commit": s.commit, "time": s.run.datetime[:19].replace("T", " "),
                 "median_ms": s.medians[result.name] * 1e3, "rounds": result.rounds,
                 "changes": "uncommitted changes" if s.dirty else ""})
    return {machine: {kind: dict(sorted(points.items(), key=lambda item: (-commits(item[1]), item[0])))
                      for kind, points in sorted(kinds.items())}
            for machine, kinds in view.items()}


def commits(entries: list[dict]) -> int:
    """How many commits a point's history spans."""
    return len({entry["commit"] for entry in entries})
