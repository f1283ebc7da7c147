"""The report's plots: log-log lines of time and throughput against size, one PNG per figure. A series is one
machine's: the machine and runs of a figure are named in its title where all its series share them, else in each
series' name."""

from __future__ import annotations

import textwrap
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from systems.bench.schema import MODEL_PHASES
from systems.levers.variant import Variant
from systems.report.course import communication_lines
from systems.report.markdown import order
from systems.report.runs import Result, Run, named_runs

Series = dict[str, list[tuple[float, float, str | None]]]  # label -> (x, y, the point's name) points
# (label, machine) -> (x, y, the point's name, its run) points: a series before its source is named
Sourced = dict[tuple[str, str], list[tuple[float, float, str | None, str]]]
MAX_TICKS = 8  # x ticks a panel labels before they would overlap
# With matplotlib's 10 colours, a marker and a colour per series change together: 40 series before a pair repeats,
# then the line style changes.
MARKERS = "osD^vP*X"
LINESTYLES = ("-", "--", ":", "-.")
LEADER = dict(arrowstyle="-", color="0.6", linewidth=0.5, shrinkA=0, shrinkB=3)  # a moved label to its point
Figure = Callable[[Result], float | None]


def build_plots(run: Run, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    model = run.select("model")
    for phase in MODEL_PHASES:
        figures.append((f"model_{phase}", f"Model, {phase}", "context length (tokens)", _panels(
            [r for r in model if r.point.phase == phase], lambda r: r.point.context,
            lambda r: f"{r.point.preset} {r.point.precision.name} {r.point.compile}",
            [("time (ms)", lambda r: r.mean * 1e3), ("throughput (TFLOP/s)", _tflops)])))
    attention = run.select("attention", sweep="handout") + run.select("attention", sweep="flash")
    for sweep, pass_, precision in sorted({(r.point.sweep, r.point.pass_, r.point.precision.name)
                                           for r in attention}):
        # One column per head dim, time above TFLOP/s, one line per implementation: a whole grid in one line
        # per (implementation, d, precision) would be unreadable.
        points = [r for r in attention if (r.point.sweep, r.point.pass_, r.point.precision.name)
                  == (sweep, pass_, precision)]
        dims = sorted({r.point.d for r in points}, key=order)
        panels = [panel for ylabel, y in (("time (ms)", lambda r: r.mean * 1e3), ("throughput (TFLOP/s)", _tflops))
                  for d in dims
                  for panel in _panels([r for r in points if r.point.d == d], lambda r: r.point.seq,
                                       lambda r: r.point.impl, [(f"{ylabel}, d={d}", y)])]
        figures.append((f"attention_{sweep}_{pass_}_{precision}", f"Attention, {sweep} sweep, {pass_}, {precision}",
                        "sequence length (tokens)", panels, len(dims)))
    figures.append(("allreduce_bandwidth", "All-reduce", "size (MiB)", _panels(
        run.select("allreduce"), lambda r: r.point.size_mb,
        lambda r: f"{r.point.backend}, {r.point.world_size} ranks",
        [("bus bandwidth (GB/s)", lambda r: r.measured.busbw_gbps),
         ("time per all-reduce (ms)", lambda r: None if r.seconds is None else r.seconds * 1e3)])))
    figures.append(("ddp_buckets", "DDPBucketed step against bucket size", "bucket size (MiB)", _panels(
        [r for r in run.select("ddp") if r.point.spec.variant == Variant.BUCKETED],
        lambda r: r.point.spec.bucket_size_mb,
        lambda r: f"{r.point.spec.precision.name} context {r.point.spec.context}, {r.point.world_size} ranks",
        [("step (ms)", lambda r: r.seconds * 1e3), ("comm wait (ms)", lambda r: r.measured.phases.comm_wait_s * 1e3)])))
    # Schemes are not a sequence: a point each, named, no line between them.
    figures.append(("checkpointing", "Activation checkpointing: step time against activation memory, a point per "
                    "scheme", "activation memory (MiB)", _panels(
        run.select("checkpoint"), lambda r: r.measured.activation_mb,
        lambda r: (f"{r.point.preset}, batch {r.point.batch}, context {r.point.context}, {r.point.precision.name}, "
                   f"{r.point.attention}"),
        [("step (ms)", lambda r: r.mean * 1e3)], name=lambda r: str(r.point.scheme)), None))
    # Section 8's layouts keep a line of one device count: a layout measured at one size is still a figure.
    figures.append(("ffn_communication", "SwiGLU layer's communication, measured and predicted from its machine's W",
                    "devices (ranks)", [(ylabel, _sourced(lines, 1)) for ylabel, lines in communication_lines(run)], 3))
    return [path for figure in figures if (path := _plot(plt, out, *figure)) is not None]


def _tflops(result: Result) -> float | None:
    return None if result.measured.throughput is None else result.measured.throughput.tflops


def _panels(results: list[Result], x: Figure, label: Callable[[Result], str], panels: list[tuple[str, Figure]],
            name: Callable[[Result], str] | None = None) -> list[tuple[str, Sourced]]:
    """For each (y label, y of a result): the points of each label's line on each machine, each (x, y, its name or
    None, its run), x sorted; lines of one point are dropped. Named points are drawn apart, each with its name, not
    joined."""
    return [(ylabel, _sourced([(label(r), r, x(r), y(r), name(r) if name else None) for r in results
                               if x(r) is not None and y(r) is not None], 2)) for ylabel, y in panels]


def _sourced(points: list[tuple], fewest: int) -> Sourced:
    """(label, result, x, y[, name]) points as lines, one per label and machine, of `fewest` points or more."""
    series = defaultdict(list)
    for label, r, x, y, *name in points:
        series[(label, r.source.machine)].append((x, y, *(name or [None]), r.source.run))
    return {key: sorted(line) for key, line in sorted(series.items()) if len(line) >= fewest}


def _named(title: str, panels: list[tuple[str, Sourced]]) -> tuple[str, list[tuple[str, Series]]]:
    """The title and the panels with each series named by its source: the machine, then the runs, in the title
    where every series shares them, else after the series' label."""
    runs = defaultdict(set)
    for _, series in panels:
        for key, points in series.items():
            runs[key].update(run for *_, run in points)
    runs = {key: named_runs(numbers) for key, numbers in runs.items()}
    shared = [names.pop() for names in ({machine for _, machine in runs}, set(runs.values())) if len(names) == 1]

    def label(key: tuple[str, str]) -> str:
        own = [part for part in (key[1], runs[key]) if part not in shared]
        return f"{key[0]} ({', '.join(own)})" if own else key[0]

    return (f"{title} — {', '.join(shared)}" if shared else title,
            [(ylabel, {label(key): [point[:3] for point in points] for key, points in series.items()})
             for ylabel, series in panels])


def _plot(plt, out: Path, name: str, title: str, xlabel: str, panels: list[tuple[str, Sourced]],
          columns: int | None = None) -> Path | None:
    """The figure of `_figure`, its series named by their sources, saved as `name`.png; nothing without a series."""
    title, panels = _named(title, panels)
    fig = _figure(plt, title, xlabel, panels, columns)
    if fig is None:
        return None
    path = out / f"{name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def styles(labels: list[str]) -> dict[str, dict]:
    """A colour, marker and line style per label, no two labels alike."""
    return {label: dict(color=f"C{i % 10}", marker=MARKERS[i % len(MARKERS)],
                        linestyle=LINESTYLES[i // 40 % len(LINESTYLES)]) for i, label in enumerate(labels)}


def _figure(plt, title: str, xlabel: str, panels: list[tuple[str, Series]], columns: int | None = None):
    """Panels in rows of `columns` (default: one row), log-log, one line per series, each series in one style
    throughout and named once in a legend below the panels; named points' labels moved apart until none overlap.
    None when no series has two points."""
    panels = [(ylabel, series) for ylabel, series in panels if series]
    if not panels:
        return None
    from matplotlib.ticker import FuncFormatter, LogLocator

    columns = min(columns or len(panels), len(panels))
    rows = -(-len(panels) // columns)
    labels = sorted({label for _, series in panels for label in series})
    legend_columns = 2 * columns
    legend_rows = -(-len(labels) // legend_columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4.5 * rows + 0.25 * legend_rows), squeeze=False,
                             layout="constrained")
    style = styles(labels)
    names = []
    for ax, (ylabel, series) in zip(axes.flat, panels):
        for label, points in series.items():
            xs, ys, point_names = zip(*points)
            named = any(point_names)
            ax.plot(xs, ys, label=label, **style[label] | ({"linestyle": "none"} if named else {}))
            for x, y, text in points if named else ():
                names.append(ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize="small",
                                         arrowprops=LEADER))
        xs = sorted({x for points in series.values() for x, *_ in points})
        ys = [y for points in series.values() for _, y, _ in points]
        # Log scales where the values span a decade or more, so that sizes doubling read as steps; else linear,
        # whose ticks a narrow range still gets.
        ax.set(xscale="log" if xs[-1] >= 10 * xs[0] else "linear",
               yscale="log" if max(ys) >= 10 * min(ys) else "linear", xlabel=xlabel, ylabel=ylabel)
        if len(xs) <= MAX_TICKS:  # every measured size a tick; more would overlap, so then the scale's own
            ax.set_xticks(xs)
        elif ax.get_xscale() == "log":
            ax.xaxis.set_major_locator(LogLocator(numticks=MAX_TICKS))
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            axis.set_minor_formatter(plt.NullFormatter())
        ax.tick_params(axis="x", labelrotation=30)
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    handles = {label: line for ax in axes.flat for line, label in zip(*ax.get_legend_handles_labels())}
    fig.legend([handles[label] for label in labels], labels, loc="outside lower center", ncols=legend_columns,
               fontsize="small")
    fig.suptitle("\n".join(textwrap.wrap(title, 25 * columns + 40)))
    _spread(fig, names)
    return fig


def _spread(fig, texts: list) -> None:
    """Move each label to the nearest free line above or below its point, inside its panel where one is free: no
    two labels overlap (the layout is drawn first, so the positions are the saved figure's)."""
    if not texts:  # nothing to move: a draw here would only repeat the one that saves the figure
        return
    from matplotlib.text import Text

    for text in texts:
        text.set_in_layout(False)  # the labels move; the panels' layout must not follow them
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()

    def box(text):  # the text's own extent: leader lines to nearby points may cross
        return Text.get_window_extent(text, renderer)

    placed = []
    for text in sorted(texts, key=lambda text: box(text).y0):
        panel = text.axes.get_window_extent(renderer)
        if box(text).x1 > panel.x1:  # a point at the right edge: its label to its left
            text.set_horizontalalignment("right")
            text.xyann = (-text.xyann[0], text.xyann[1])
        step, (dx, dy) = text.get_fontsize() * 1.2, text.xyann  # a line, in points: the offset's unit
        outside = None  # the nearest free line outside the panel, where none inside is free
        for lines in sorted(range(-2 * len(texts), 2 * len(texts) + 1), key=lambda k: (abs(k), -k)):
            text.xyann = (dx, dy + lines * step)
            if any(box(text).overlaps(other) for other in placed):
                continue
            if panel.y0 <= box(text).y0 and box(text).y1 <= panel.y1:
                break
            outside = outside or text.xyann
        else:
            text.xyann = outside or (dx, dy)
        placed.append(box(text))
