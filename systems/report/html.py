"""The HTML report: one static page of every saved history, opened from disk with no server.

    python -m systems.report.html --out DIR [--storage .benchmarks] [--no-plots]

Writes DIR/report.html and, per machine, the markdown report's PNG plots (DIR/<machine>/*.png, linked by the
page). The page holds the regressions view, each point's median over the complete runs of a machine, commit by
commit, picked by machine, point kind and point (systems.report.history_view: a Bokeh chart, BokehJS inlined, and a
few lines of script over the embedded JSON), and under it the chosen machine's tables and plots: each point's latest
result over that machine's runs. A missing or malformed history is a one-line error, exit 2.

Bokeh rather than plotly: the page must open in under 2 s on a 2-core laptop, and plotly's Python package ships
only its whole plotly.js, several times BokehJS's core and slower to start (docs/design-notes.md).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from html import escape
from pathlib import Path

from bokeh.document import Document
from bokeh.embed import components
from bokeh.events import DocumentReady
from bokeh.models import ColumnDataSource, CustomJS, DataRange1d, FactorRange
from bokeh.plotting import figure
from bokeh.resources import Resources

from systems.report.history_view import Saved, histories, load_saved, machines
from systems.report.markdown import Table
from systems.report.plots import build_plots
from systems.report.runs import ReportError, merge_runs
from systems.report.tables import build_tables

PAGE = "report.html"
CELL = re.compile(r"(?<!\\)\|")  # a markdown table's cell border: a bar the markdown has not escaped
STYLE = """
body { font: 14px system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; padding: 0 1em; color: #222; }
label { margin-right: 1.2em; }
select { font: inherit; max-width: 36em; }
#history-caption { color: #555; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
th { background: #f3f3f3; }
img { max-width: 100%; display: block; margin: 1em 0; }
"""
# The view: the selects pick from the embedded histories (each kind's longest history first, shown first) and the
# chosen point's runs become the chart's data, one marker per run at its commit (runs at one commit share its place
# on the axis). Bokeh hands over its data source and plot once its document is ready.
SCRIPT = """
const view = JSON.parse(document.getElementById("histories").textContent);
const pick = {machine: document.getElementById("machine"), kind: document.getElementById("kind"),
              point: document.getElementById("point")};
const commits = runs => [...new Set(runs.map(run => run.commit))];
const count = (n, noun) => `${n} ${noun}${n === 1 ? "" : "s"}`;
let chart;

function fill(select, options) {
  select.replaceChildren(...options.map(([value, text]) => new Option(text, value)));
}

function showMachine() {
  const kinds = Object.entries(view[pick.machine.value]);
  fill(pick.kind, kinds.map(([kind, points]) => [kind, `${kind} (${Object.keys(points).length} points)`]));
  document.querySelectorAll("section[data-machine]").forEach(
    section => section.hidden = section.dataset.machine !== pick.machine.value);
  showKind();
}

function showKind() {
  const points = Object.entries(view[pick.machine.value][pick.kind.value]);
  fill(pick.point, points.map(([name, runs]) => [name, `${name} (${count(commits(runs).length, "commit")})`]));
  showPoint();
}

function showPoint() {
  const runs = view[pick.machine.value][pick.kind.value][pick.point.value];
  chart.source.data = Object.fromEntries(Object.keys(runs[0]).map(key => [key, runs.map(run => run[key])]));
  chart.plot.x_range.factors = commits(runs);
  chart.plot.title.text = pick.point.value;
  document.getElementById("history-caption").textContent = `${pick.point.value} on ${pick.machine.value}: ` +
    `${count(runs.length, "run")} at ${count(commits(runs).length, "commit")}`;
}

function startView(source, plot) {
  chart = {source, plot};
  pick.machine.onchange = showMachine;
  pick.kind.onchange = showKind;
  pick.point.onchange = showPoint;
  showMachine();
  document.body.dataset.ready = performance.now().toFixed(0);
}
"""
TOOLTIPS = [("commit", "@commit"), ("median", "@median_ms{0.0000} ms"), ("run", "@run"), ("at", "@time"),
            ("rounds", "@rounds"), ("", "@changes")]


def write_page(storage: Path, out: Path, plots: bool = True) -> Path:
    """Writes the page (and with `plots` each machine's PNGs beside it) into `out`; returns the page's path."""
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out} is a file; name a folder")
    saved = load_saved(storage)
    try:
        out.mkdir(parents=True, exist_ok=True)
        sections = [machine_section(machine, [s for s in saved if s.machine == machine], out, plots)
                    for machine in machines(saved)]
        page = out / PAGE
        page.write_text(render_page(storage, saved, sections))
    except OSError as exc:  # a file on the way to --out, no permission, a full disk
        raise ReportError(f"cannot write into {out}: {exc.strerror or exc}") from None
    return page


def render_page(storage: Path, saved: list[Saved], sections: list[str]) -> str:
    view = histories(saved)
    newest = saved[-1].machine  # picked first, as the markdown report picks the newest run's machine
    options = "".join(f'<option value="{escape(m)}"{" selected" * (m == newest)}>{escape(m)} '
                      f"({sum(s.machine == m for s in saved)} runs)</option>" for m in view)
    name, runs = next(iter(next(iter(view[newest].values())).items()))  # what the selects show first
    script, div, bokeh_js = chart(name, runs)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Benchmark report</title>
<style>{STYLE}</style>
{bokeh_js}
</head>
<body>
<h1>Benchmark report</h1>
<p>{len(saved)} complete runs from <code>{escape(str(storage))}</code> at {len({s.commit for s in saved})} commits,
on {len(view)} machines (the GPU kind and how many the host had). Runs that stopped early are left out.</p>
<h2>Each point over the runs of a machine, commit by commit</h2>
<p><label>machine <select id="machine">{options}</select></label>
<label>point kind <select id="kind"></select></label>
<label>point <select id="point"></select></label></p>
{div}
<p id="history-caption"></p>
{"".join(sections)}
<script type="application/json" id="histories">{_json(view)}</script>
<script>{SCRIPT}</script>
{script}
</body>
</html>
"""


def chart(name: str, runs: list[dict]) -> tuple[str, str, str]:
    """The Bokeh chart of a point's runs: its script, its element and BokehJS's core, inlined. The page's script
    draws the other points into it."""
    source = ColumnDataSource({key: [run[key] for run in runs] for key in runs[0]})
    plot = figure(name="history", title=name, height=420, sizing_mode="stretch_width",
                  x_range=FactorRange(factors=list(dict.fromkeys(run["commit"] for run in runs))),
                  y_range=DataRange1d(start=0), x_axis_label="commit (oldest first)",
                  y_axis_label="median of its rounds (ms)", tooltips=TOOLTIPS,
                  tools="pan,wheel_zoom,box_zoom,reset,save")
    plot.line("commit", "median_ms", source=source)
    plot.scatter("commit", "median_ms", source=source, size=8)
    document = Document()
    document.add_root(plot)
    document.js_on_event(DocumentReady, CustomJS(args=dict(source=source, plot=plot),
                                                 code="startView(source, plot)"))
    script, div = components(plot)
    return script, div, Resources(mode="inline", components=["bokeh"]).render_js()


def machine_section(machine: str, saved: list[Saved], out: Path, plots: bool) -> str:
    """The machine's tables and plots of each point's latest result over its runs, hidden until it is picked."""
    run = merge_runs([s.run for s in saved])
    parts = [f'<section data-machine="{escape(machine)}" hidden>', f"<h2>Tables and plots: {escape(machine)}</h2>",
             f"<p>Each point's latest result over the machine's {len(saved)} complete runs, at commits "
             f"{escape(', '.join(dict.fromkeys(s.commit for s in saved)))}.</p>"]
    parts += [table_html(table) for table in build_tables(run)]
    if plots:
        folder = re.sub(r"[^A-Za-z0-9]+", "-", machine).strip("-")
        (out / folder).mkdir(exist_ok=True)
        parts += [f'<img src="{folder}/{path.name}" alt="{escape(path.stem)}" loading="lazy">'
                  for path in build_plots(run, out / folder)]
    return "\n".join(parts + ["</section>"])


def table_html(table: Table) -> str:
    """The table as its markdown shows it (the same columns, and the machine and runs it names), in HTML."""
    lines = table.markdown().splitlines()
    rows = [[escape(cell.strip().replace("\\|", "|")) for cell in CELL.split(line.strip())[1:-1]]
            for line in lines if line.startswith("|")]
    note = f"<p>{escape(table.note)}</p>" if table.note else ""
    head = "".join(f"<th>{cell}</th>" for cell in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows[2:])
    return f"<h3>{escape(lines[0].removeprefix('### '))}</h3>{note}<table><tr>{head}</tr>{body}</table>"


def _json(value) -> str:
    """JSON safe inside a script element: no '</' to close it early."""
    return json.dumps(value).replace("</", "<\\/")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m systems.report.html", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help=f"folder for {PAGE} and the plots")
    parser.add_argument("--storage", default=".benchmarks", help="pytest-benchmark storage (default .benchmarks)")
    parser.add_argument("--no-plots", action="store_true", help="tables and histories only, no PNG plots "
                        "(faster: the plots of every machine take about a minute)")
    args = parser.parse_args(argv)
    try:
        page = write_page(Path(args.storage.removeprefix("file://")), args.out, plots=not args.no_plots)
    except ReportError as exc:
        print(f"report: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
