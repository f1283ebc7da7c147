"""The 2026 edition's tables and plots: section 8's layouts of one SwiGLU layer, measured beside the accounting's
prediction with this run's own C and W, and the leaderboard's step as the course times it.

Prediction (systems.accounting.ffn_layouts): each pass's collectives, each at the bus bandwidth this run measured
for its kind over a group of its size (an ffn_bandwidth point of the same backend and precision, the largest size:
where bandwidth dominates), so W = busbw; its matmuls at C, the point's own whole-layer TFLOP/s on one device. A
pass is communication-bound when its collectives take longer than its matmuls: predicted from those figures,
measured from the collectives alone against the matmuls alone. `course_tables(run)` is what the report's
build_tables calls, `communication_lines(run)` what build_plots draws.
"""

from __future__ import annotations

from collections import defaultdict

from systems.accounting.ffn_layouts import (Accelerator, PassCost, SwiGLULayer, largest_dp_devices,
                                            largest_fsdp_devices, largest_fsdp_tp_grid, largest_tp_devices)
from systems.bench.ffn import handout_cost
from systems.model import Fused
from systems.parallel.swiglu import FFNLayout
from systems.report.markdown import Table, mib, ms, number, order
from systems.report.runs import Result, Run

SHAPE = ("batch", "d_model", "d_ff", "precision")


def course_tables(run: Run) -> list[Table]:
    return ffn_tables(run) + leaderboard_tables(run)


def _bandwidth_points(run: Run) -> dict[tuple, Result]:
    """(backend, ranks, precision name) -> its ffn_bandwidth point of the largest size measured."""
    return {(r.point.backend, r.point.world_size, r.point.precision.name): r
            for r in sorted(run.select("ffn_bandwidth"), key=lambda r: r.point.size_mb)}


def _bandwidths(run: Run) -> dict[tuple, dict[str, float]]:
    """(backend, ranks, precision name) -> {kind: W in bytes/s}, from the largest size measured."""
    return {key: {kind: figure.busbw_gbps * 1e9 for kind, figure in r.measured.by_kind().items()}
            for key, r in _bandwidth_points(run).items()}


def _w_points(run: Run, r: Result) -> list[Result]:
    """The ffn_bandwidth points a prediction for `r` reads: its backend's and precision's."""
    return [w for (backend, _, precision), w in _bandwidth_points(run).items()
            if (backend, precision) == (r.point.backend, r.point.precision.name)]


def _layer(r: Result) -> SwiGLULayer:
    p = r.point
    return SwiGLULayer(p.batch, p.d_model, p.d_ff, p.precision.compute.itemsize)


def predicted_comm_s(r: Result, cost: PassCost, bandwidths: dict) -> float | None:
    """The pass's collectives one after another, each at its kind's W over a group of its size."""
    seconds = 0.0
    for collective in (c for axis in cost.collectives.values() for c in axis if c.devices > 1):
        w = bandwidths.get((r.point.backend, collective.devices, r.point.precision.name), {}).get(collective.kind)
        if w is None:
            return None
        seconds += collective.bytes_sent / w
    return seconds


def _c(r: Result) -> Accelerator:
    return Accelerator(r.measured.layer_tflops * 1e12, 1.0)  # W unused: compute_seconds reads C alone


def _ratio(measured: float, predicted: float | None) -> str:
    return "" if not predicted else f"{measured / predicted:.2f}"


def _bound(comm: float | None, compute: float) -> str:
    return "" if comm is None else ("yes" if comm > compute else "no")


def ffn_tables(run: Run) -> list[Table]:
    results = sorted(run.select("ffn"), key=lambda r: tuple(order(getattr(r.point, k)) for k in
                                                              (*SHAPE, "data", "tensor", "layout")))
    bandwidths = _bandwidths(run)
    tables = []
    if bandwidths:
        table = Table("ffn_bandwidth", "W: bus bandwidth of each collective (GB/s; the largest size measured)",
                      ["backend", "ranks", "precision", "all-reduce", "all-gather", "reduce-scatter"])
        points = _bandwidth_points(run)
        for key, w in sorted(bandwidths.items()):
            backend, ranks, precision = key
            table.add([backend, str(ranks), precision]
                      + [number(w[kind] / 1e9) for kind in ("all-reduce", "all-gather", "reduce-scatter")],
                      points[key])
        tables.append(table)
    if not results:
        return tables
    layouts = Table("ffn_layouts", "One SwiGLU layer under section 8's layouts: measured against predicted with "
                                   "this run's C and W (ms per step: forward + backward; bytes per rank)",
                    ["layout", "ranks", "B", "D", "D_FF", "precision", "step", "compute", "comm alone",
                     "comm predicted", "measured / predicted", "exposed", "bytes sent", "bytes predicted",
                     "fwd comm-bound: predicted", "measured"],
                    note="comm alone: the handout's collectives of the layout, back to back; exposed: the step less "
                         "its compute alone. C: the whole layer's TFLOP/s on one device, W: ffn_bandwidth's busbw. "
                         "Under gloo our all-reduce is an all-gather (n-1 times S sent): CPU figures check the "
                         "code path, not the model.")
    for r in results:
        m, cost = r.measured, handout_cost(r.point.placement, _layer(r))
        predicted = [predicted_comm_s(r, p, bandwidths) for p in (cost.forward, cost.backward)]
        total = None if None in predicted else sum(predicted)
        sent = sum(m.sent_forward.values()) + sum(m.sent_backward.values())
        layouts.add(
            [str(r.point.layout), f"{r.point.data}x{r.point.tensor}"]
            + [number(getattr(r.point, k)) for k in SHAPE]
            + [ms(m.step.step_s), ms(m.compute.step_s), ms(m.comm.step_s), ms(total), _ratio(m.comm.step_s, total),
               ms(m.exposed.step_s), f"{sent:,.0f}", f"{cost.forward.bytes_sent + cost.backward.bytes_sent:,.0f}",
               _bound(predicted[0], cost.forward.compute_seconds(_c(r))),
               _bound(m.comm.forward_s, m.compute.forward_s)], r, *_w_points(run, r))
    tables.append(layouts)
    tables += _crossover(run, results, bandwidths) + _ours_against_torch(results)
    return tables


def _chapter_bound(layout: FFNLayout, layer: SwiGLULayer, c: float, w: dict[str, float]) -> float | None:
    """The chapter's largest device count before the forward (DP: backward) is communication-bound."""
    match layout:
        case FFNLayout.DP:
            return largest_dp_devices(layer, Accelerator(c, w["all-reduce"])).backward
        case FFNLayout.FSDP:
            return largest_fsdp_devices(layer, Accelerator(c, w["all-gather"])).forward
        case FFNLayout.TP | FFNLayout.TORCH_TP:
            return largest_tp_devices(layer, Accelerator(c, w["all-reduce"])).forward
        case FFNLayout.FSDP_TP:
            return largest_fsdp_tp_grid(layer, Accelerator(c, w["all-gather"]), overlap_axes=False).devices
    return None


def _crossover(run: Run, results: list[Result], bandwidths: dict) -> list[Table]:
    """Per layout and shape: where the chapter says the layout turns communication-bound, and whether each
    measured device count agrees (comm alone longer than compute alone, the pass the bound is about)."""
    table = Table("ffn_crossover", "Where each layout turns communication-bound: the chapter's bound with this run's "
                                   "C and W, against the device counts measured",
                  ["layout", "B", "D", "D_FF", "precision", "chapter: bound at N <=", "measured comm-bound at",
                   "not bound at", "agrees"])
    groups = defaultdict(list)
    for r in results:
        if r.point.layout != FFNLayout.SINGLE:
            groups[(r.point.layout, *(getattr(r.point, k) for k in SHAPE))].append(r)
    for (layout, *shape), group in groups.items():
        largest = max(group, key=lambda r: r.point.world_size)
        w = bandwidths.get((largest.point.backend, largest.point.world_size, largest.point.precision.name))
        bound = None if w is None else _chapter_bound(layout, _layer(largest), largest.measured.layer_tflops * 1e12, w)

        def bound_at(r: Result) -> bool:
            m = r.measured
            return (m.comm.backward_s > m.compute.backward_s) if layout == FFNLayout.DP else \
                (m.comm.forward_s > m.compute.forward_s)
        bound_counts = sorted({r.point.world_size for r in group if bound_at(r)})
        free = sorted({r.point.world_size for r in group if not bound_at(r)})
        agrees = "" if bound is None else ("yes" if all(n > bound for n in bound_counts)
                                           and all(n <= bound for n in free) else "no")
        table.add([str(layout)] + [number(v) for v in shape]
                  + [number(bound), ", ".join(map(str, bound_counts)), ", ".join(map(str, free)), agrees],
                  *group, *_w_points(run, largest))
    return [table] if table.rows else []


def _ours_against_torch(results: list[Result]) -> list[Table]:
    ours = {(r.point.tensor, *(getattr(r.point, k) for k in SHAPE)): r for r in results
            if r.point.layout == FFNLayout.TP}
    table = Table("ffn_tp_ours_vs_torch", "Tensor parallelism of the layer: ours (Megatron's f and g) against torch's "
                                          "(parallelize_module), the same shapes (ms per step)",
                  ["ranks", "B", "D", "D_FF", "precision", "ours", "torch", "ours / torch"])
    for r in results:
        key = (r.point.tensor, *(getattr(r.point, k) for k in SHAPE))
        if r.point.layout == FFNLayout.TORCH_TP and key in ours:
            mine, theirs = ours[key].measured.step.step_s, r.measured.step.step_s
            table.add([number(v) for v in key] + [ms(mine), ms(theirs), f"{mine / theirs:.3f}"], ours[key], r)
    return [table] if table.rows else []


def leaderboard_tables(run: Run) -> list[Table]:
    results = sorted(run.select("leaderboard"), key=lambda r: str(r.point))
    if not results:
        return []
    table = Table("leaderboard", "The leaderboard's step timed as the course times it (do_bench: the handout's "
                                 "figure is its mean; ms)",
                  ["model", "preset", "context", "batch", "ranks", "levers", "timer", "budgets rep / warmup",
                   "mean", "median", "steps timed", "first loss", "peak MiB", "cold start (s)"])
    for r in results:
        p, m = r.point, r.measured
        levers = "" if p.model != "ours" else (f"{p.attention}, {p.checkpoint}, loss chunk {p.loss_chunk or 'full'}"
                                               + ("" if p.fused == Fused.NONE else f", fused {p.fused}")
                                               + (", compiled" if p.compile else ""))
        table.add([p.model, p.preset, str(p.context), str(p.batch), str(p.world_size), levers, m.timer,
                   f"{p.rep_ms:g} / {p.warmup_ms:g}", ms(m.mean_s), ms(m.median_s), str(m.timed_steps),
                   number(m.first_loss), mib(m.peak_mb()), number(m.cold_start_s)], r)
    return [table]


def communication_lines(run: Run) -> list[tuple[str, list[tuple[str, Result, float, float]]]]:
    """Section 8's figure: per shape a panel (its y label naming the shape) of communication per step (ms) against
    device count, measured and predicted from its machine's W for each layout, each point with its result."""
    panels = defaultdict(list)  # shape -> (line, result, devices, ms)
    for machine in map(run.on, run.machines):
        bandwidths = _bandwidths(machine)
        for r in machine.select("ffn"):
            if r.point.layout == FFNLayout.SINGLE:
                continue
            cost = handout_cost(r.point.placement, _layer(r))
            predicted = [predicted_comm_s(r, p, bandwidths) for p in (cost.forward, cost.backward)]
            shape = tuple(getattr(r.point, k) for k in SHAPE)
            panels[shape].append((f"{r.point.layout} measured", r, r.point.world_size, r.measured.comm.step_s * 1e3))
            if None not in predicted:
                panels[shape].append((f"{r.point.layout} predicted", r, r.point.world_size, sum(predicted) * 1e3))
    return [(f"B={batch} D={d_model} D_FF={d_ff} {precision.name}\ncommunication per step (ms)",
             panels[(batch, d_model, d_ff, precision)])
            for batch, d_model, d_ff, precision in sorted(panels, key=lambda shape: tuple(map(order, shape)))]
