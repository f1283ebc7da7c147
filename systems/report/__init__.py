"""Writeup tables and plots from pytest-benchmark histories.

    python -m systems.report --out DIR [--run ID] [--compare ID] [--storage .benchmarks] [--machine MACHINE_ID]

Reads one saved run, `.benchmarks/<machine>/NNNN_*.json` (by default the latest complete one: a run that
stopped early is saved as `NNNN_*_partial.json` and read only when named), and writes into DIR
`report.md` with one table per deliverable (each also as `<table>.md`) and PNG plots; with
--compare, the ratio of every benchmark's time to the other run's, regressions flagged. Benchmarks
a run does not have are simply absent. Every table row and plot series names the machine (GPU kind and count,
"2 x H200") and the run that measured it. A missing or malformed history is a one-line error, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from systems.report.plots import build_plots
from systems.report.runs import ReportError, Run, find_runs, load_run, merge_runs
from systems.report.tables import build_tables, comparison_table


def write_report(run: Run, out: Path, baseline: Run | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tables = build_tables(run) + ([comparison_table(run, baseline)] if baseline else [])
    plots = build_plots(run, out)
    sections = [f"# Benchmark report: run {run.id}", "", header(run), ""]
    if not run.results:
        sections += ["The run holds no benchmarks.", ""]
    for table in tables:
        (out / f"{table.name}.md").write_text(table.markdown())
        sections.append(table.markdown())
    sections += [f"![{path.stem}]({path.name})\n" for path in plots]
    if len(run.paths) > 1:
        sections += ["### Sources", ""] + [f"- run {source.run}: {source.machine}, commit {source.commit}, `{path}`"
                                           for source, path in zip(run.sources, run.paths)] + [""]
    report = out / "report.md"
    report.write_text("\n".join(sections))
    return report


def header(run: Run) -> str:
    """What ran it, at which commit, when, from where: one line for a run; for runs merged, two, the runs' machines
    and commits counted (each table row and plot series names its own, the sources at the end each run's)."""
    if len(run.paths) == 1:
        return f"{run.machine}; commit {run.commit}; {run.datetime}; from `{run.paths[0]}`."
    machines = list(dict.fromkeys(source.machine for source in run.sources))
    commits = len({source.commit for source in run.sources})
    return (f"{len(run.paths)} histories merged, {run.datetime}: {len(machines)} machine{'s' * (len(machines) > 1)} "
            f"({', '.join(machines)}), {commits} commit{'s' * (commits > 1)} (each run's in the sources at the end).\n"
            "Each row and plot series names the machine and run that measured it; where runs of one machine share a "
            "point, the later one's wins.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m systems.report", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for report.md, the tables and the plots")
    parser.add_argument("--run", help="run number (3 or 0003), file-name prefix or path; default the latest "
                        "complete run. Several, e.g. 16-20,23, are merged, the later run winning where runs of one "
                        "machine share a point")
    parser.add_argument("--compare", help="a second run (or runs), named as for --run, to compare against")
    parser.add_argument("--storage", default=".benchmarks", help="pytest-benchmark storage (default .benchmarks)")
    parser.add_argument("--machine", help="machine folder in the storage; default the one with the newest run")
    args = parser.parse_args(argv)
    storage = Path(args.storage.removeprefix("file://"))
    try:
        if args.out.exists() and not args.out.is_dir():
            raise ReportError(f"--out {args.out} is a file; name a folder")
        run = merge_runs([load_run(path) for path in find_runs(storage, args.machine, args.run)])
        baseline = None
        if args.compare:
            machine = args.machine or run.paths[0].parent.name
            baseline = merge_runs([load_run(path) for path in find_runs(storage, machine, args.compare)])
        try:
            report = write_report(run, args.out, baseline)
        except OSError as exc:  # a file on the way to --out, no permission, a full disk
            raise ReportError(f"cannot write into {args.out}: {exc.strerror or exc}") from None
    except ReportError as exc:
        print(f"report: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {report}")
    return 0
