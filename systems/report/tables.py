"""One table per deliverable of the benchmarks of the model and of attention, a table per test of benchmarks that
hold no point (another project's), and the comparison of two runs. Results are selected by their point's kind;
each machine's tables are built from its own results alone (a ratio, a baseline or a prediction never takes another
machine's figure), then put together a table per deliverable, the machine named in each row."""

from __future__ import annotations

from collections import defaultdict

from systems.accounting import checkpointed, model_state, peak_memory
from systems.bench.schema import ATTENTION_PASSES, MODEL_PHASES, CheckpointPoint, ModelPoint
from systems.levers.checkpointing import Checkpointing
from systems.model import get_config
from systems.recompute import Saves
from systems.report.breakdown import breakdown_tables
from systems.report.course import course_tables
from systems.report.distributed import allreduce_tables, ddp_tables, fsdp_tables, fullstep_tables, optimizer_tables
from systems.report.layouts import layout_tables
from systems.report.markdown import (BATCH, Table, batch_sizes, bytes_as_mib, cell, combined, fields_of, mib, ms,
                                     ms_pm, number, order, pivot, sorted_by)
from systems.report.runs import OutOfMemory, Result, Run

REGRESSION = 1.10  # a time this much above the baseline's is flagged


def build_tables(run: Run) -> list[Table]:
    machines = [run.on(machine) for machine in run.machines]
    tables = []
    for build in (model_tables, warmup_tables, attention_tables, allreduce_tables, ddp_tables, fsdp_tables,
                  layout_tables, fullstep_tables, breakdown_tables, optimizer_tables, checkpoint_tables, course_tables,
                  other_tables):
        by_name = defaultdict(list)
        for machine in machines:
            for table in build(machine):
                by_name[table.name].append(table)
        tables += [combined(same) for same in by_name.values()]
    return tables


def model_tables(run: Run) -> list[Table]:
    results = run.select("model")
    keys = ["preset", "context", "precision", "compile"]
    grid = pivot(results, keys, "phase", run.oom("model"))
    if not grid:
        return []
    batch = batch_sizes(results)
    phases = [p for p in MODEL_PHASES if any(p in row for row in grid.values())]
    timings = Table("model", f"Model: time per call{BATCH}, mean ± std (ms; OOM: out of memory)", keys + phases,
                    batches=batch)
    for key, row in grid.items():
        timings.add([number(k) for k in key] + [cell(row.get(p), ms_pm) for p in phases], *row.values())

    precision = Table("precision", f"Mixed precision: fp32 vs bf16 autocast{BATCH}, mean (ms)",
                      ["preset", "context", "compile", "phase", "fp32", "bf16", "fp32 / bf16"], batches=batch)
    for key, row in pivot(results, ["preset", "context", "compile", "phase"], "precision").items():
        if "fp32" in row and "bf16" in row:
            precision.add([number(k) for k in key] + [ms(row["fp32"].mean), ms(row["bf16"].mean),
                                                      f"{row['fp32'].mean / row['bf16'].mean:.2f}x"],
                          row["fp32"], row["bf16"])
    tables = [timings] + ([precision] if precision.rows else [])

    measured = [r for r in results if r.measured.peak_memory_mb is not None]
    if measured:
        grid = pivot(measured, keys, "phase")
        memory = Table("memory", f"Peak memory per preset{BATCH} (MiB): measured in each phase, and predicted "
                                 "by systems.accounting", keys + phases + ["predicted forward", "predicted backward",
                                                                           "predicted step"],
                       note="Predictions are for eager models (compiled ones save other tensors); the backward "
                            "phases run without optimizer state.", batches=batch)
        for key, row in grid.items():
            memory.add([number(k) for k in key]
                       + [cell(row.get(p), lambda r: f"{r.measured.peak_memory_mb:,.0f}") for p in phases]
                       + _predicted_memory(next(iter(row.values())).point), *row.values())
        tables.append(memory)
    return tables


def _predicted_memory(point: ModelPoint) -> list[str]:
    if point.compile != "eager":
        return ["", "", ""]
    config = get_config(point.preset, point.edition, attention=point.attention, context_length=point.context)
    peak = peak_memory(config, point.batch, point.context, point.precision)
    return [bytes_as_mib(peak.forward), bytes_as_mib(peak.forward_backward), bytes_as_mib(peak.train_step)]


def warmup_tables(run: Run) -> list[Table]:
    results = sorted_by(run.select("warmup"), ["warmup_steps"])
    if not results:
        return []
    table = Table("warmup", f"Warm-up study: forward+backward after n untimed steps{BATCH} (ms)",
                  ["warm-up steps", "preset", "context", "precision", "mean ± std", "min", "max", "rounds"],
                  batches=batch_sizes(results))
    for r in results:
        table.add([number(k) for k in fields_of(r.point, ["warmup_steps", "preset", "context", "precision"])]
                  + [ms_pm(r), ms(r.min), ms(r.max), str(r.rounds)], r)
    return [table]


def attention_tables(run: Run) -> list[Table]:
    tables = []
    keys = ["impl", "d", "seq"]
    grid = pivot(run.select("attention", sweep="handout"), keys, "pass_", run.oom("attention", sweep="handout"))
    if grid:
        table = Table("attention_handout", "Attention, batch 8, one head, no mask (ms; OOM: out of memory)",
                      keys + ["forward", "backward", "memory before backward (MiB)"])
        for key, row in grid.items():
            table.add([number(k) for k in key] + [
                cell(row.get("forward"), ms_pm), cell(row.get("backward"), ms_pm),
                cell(row.get("backward"), lambda r: mib(r.measured.memory_before_backward_mb))], *row.values())
        tables.append(table)

    keys = ["precision", "d", "seq", "pass_"]
    flash = run.select("attention", sweep="flash")
    grid = pivot(flash, keys, "impl", run.oom("attention", sweep="flash"))
    if grid:
        impls = sorted({impl for row in grid.values() for impl in row})
        table = Table("attention_flash", "FlashAttention-2 vs PyTorch vs SDPA, batch 1, causal, mean (ms; "
                                         "OOM: out of memory)", ["precision", "d", "seq", "pass"] + impls)
        for key, row in grid.items():
            table.add([number(k) for k in key] + [cell(row.get(impl), lambda r: ms(r.mean)) for impl in impls],
                      *row.values())
        tables.append(table)

    kernels = [r for r in flash if r.point.impl == "triton" and r.measured.sdpa_device_ms is not None]
    if kernels:
        table = Table("attention_forward_kernels", "FlashAttention-2 forward kernels against SDPA's, timed in turns "
                                                   "(CUDA-graph replay, median ms)",
                      ["precision", "d", "seq", "triton", "sdpa", "vs SDPA"])
        for r in sorted_by(kernels, ["precision", "d", "seq"]):
            ours, sdpa = r.measured.device_ms, r.measured.sdpa_device_ms
            table.add([number(k) for k in fields_of(r.point, ["precision", "d", "seq"])]
                      + [number(ours), number(sdpa), number(ours / sdpa)], r)
        tables.append(table)

    # The point alone, and after its compiled function first saw another sequence length (symbolic sizes).
    board = run.select("attention", sweep="leaderboard")
    if board:
        table = Table("attention_leaderboard", "Leaderboard: (16, 16384, 64) bf16 causal (ms)",
                      ["pass", "compiled first at seq", "pytest-benchmark mean", "do_bench median",
                       "SDPA do_bench median", "vs SDPA"])
        for r in sorted(board, key=lambda r: (ATTENTION_PASSES.index(r.point.pass_), r.point.first_seq is not None)):
            ours, sdpa = r.measured.do_bench_ms, r.measured.sdpa_do_bench_ms
            table.add([r.point.pass_, number(r.point.first_seq or r.point.seq), ms(r.mean), number(ours),
                       number(sdpa), number(ours / sdpa)], r)
        tables.append(table)
    return tables


def checkpoint_tables(run: Run) -> list[Table]:
    """Memory against time for each checkpointing scheme, beside no checkpointing; the longest context trained."""
    keys = ["preset", "batch", "context", "precision", "attention"]
    grid = defaultdict(dict)  # setting: {scheme: result, or its point that ran out of memory}
    for r in run.select("checkpoint"):
        grid[fields_of(r.point, keys)][str(r.point.scheme)] = r
    for oom in run.oom("checkpoint"):
        grid[fields_of(oom.point, keys)].setdefault(str(oom.point.scheme), oom)
    table = Table("checkpointing", "Activation checkpointing: an AdamW training step per scheme (ms, MiB; OOM: out "
                                   "of memory, with the accounting's prediction)",
                  keys + ["scheme", "segments", "step", "step vs none", "peak", "predicted peak", "activation",
                          "predicted activation", "activation vs none", "recomputed TFLOP"],
                  note="Activation memory: the peak less the weights, buffers and AdamW state a step starts with.")
    for key in sorted(grid, key=lambda key: tuple(map(order, key))):
        row = grid[key]
        none = row.get("none")
        for name in sorted(row, key=_scheme_order):
            entry = row[name]
            if isinstance(entry, OutOfMemory):
                table.add([number(k) for k in key] + [name, "", "OOM", ""] + _predicted_step(entry.point), entry)
                continue
            m = entry.measured
            memory = [mib(value) for value in (m.peak_memory_mb, m.predicted_peak_mb, m.activation_mb,
                                              m.predicted_activation_mb)]
            baseline = (none,) if isinstance(none, Result) else ()
            table.add([number(k) for k in key] + [name, "x".join(map(str, m.levels)), ms(entry.mean),
                                                  _ratio(entry, none, lambda r: r.mean)]
                      + memory + [_ratio(entry, none, lambda r: r.measured.activation_mb), number(m.recomputed_tflop)],
                      entry, *baseline)
    tables = [table] if table.rows else []

    searches = sorted(run.select("context_search"),
                      key=lambda r: (*map(order, fields_of(r.point, ["preset", "batch", "precision", "attention"])),
                                     _scheme_order(str(r.point.scheme))))
    if searches:
        search = Table("largest_context", "Longest context that trains (doubling until out of memory), beside the "
                                          "accounting's longest on an 80 GB H100",
                       ["preset", "batch", "precision", "attention", "scheme", "longest trained", "first OOM",
                        "predicted longest", "step at the longest (ms)", "peak (MiB)"])
        for r in searches:
            search.add([number(k) for k in fields_of(r.point, ["preset", "batch", "precision", "attention", "scheme"])]
                       + [number(k) for k in (r.measured.largest_context, r.measured.first_oom_context,
                                              r.measured.predicted_largest_context)]
                       + [ms(r.mean), mib(r.measured.at_longest.peak_memory_mb)], r)
        tables.append(search)
    return tables


def _scheme_order(name: str) -> tuple:
    """none first, then one level by segment size, then two levels, nested; each before its selective forms."""
    scheme = Checkpointing.parse(name)
    levels = scheme.levels or ()
    return (scheme.levels != (), scheme.levels is None, len(levels), levels, scheme.saves != Saves.INPUTS,
            str(scheme.saves), scheme.keep)


def _ratio(result: Result, baseline, figure) -> str:
    if not isinstance(baseline, Result) or figure(result) is None or not figure(baseline):
        return ""
    return f"{figure(result) / figure(baseline):.3f}"


def _predicted_step(point: CheckpointPoint) -> list[str]:
    """The accounting's peak and activation memory of a point that ran out of memory, in MiB."""
    config = get_config(point.preset, point.edition, attention=point.attention, context_length=point.context)
    config = checkpointed(point.scheme, config, point.batch, point.context, point.precision)
    peak = peak_memory(config, point.batch, point.context, point.precision).train_step
    state = model_state(config, point.precision).training
    return ["", bytes_as_mib(peak), "", bytes_as_mib(peak - state), "", ""]


def other_tables(run: Run) -> list[Table]:
    """One table per test of benchmarks that hold no point: their parameters and figures, then their time."""
    by_test = defaultdict(list)
    for r in run.results:
        if r.point is None:
            by_test[r.test].append(r)
    tables = []
    for test, results in sorted(by_test.items()):
        columns = sorted({k for r in results for k, v in r.fields.items() if isinstance(v, (str, int, float, bool))})
        table = Table(test, f"{test} (ms)", columns + ["mean ± std"])
        for r in sorted(results, key=lambda r: tuple(order(r.fields.get(k)) for k in columns)):
            table.add([number(r.fields.get(k)) for k in columns] + [ms_pm(r)], r)
        tables.append(table)
    return tables


def comparison_table(run: Run, baseline: Run) -> Table:
    """Each benchmark both runs hold on one machine, by its headline time (Measured.seconds); those without one
    (figures a run did not measure) are left out and counted. Two runs of a machine each are compared across their
    machines, which the note names where they differ."""
    across = len(run.machines) == len(baseline.machines) == 1

    def key(result: Result) -> str | tuple[str, str]:
        return result.name if across else (result.source.machine, result.name)

    before = {key(r): r for r in baseline.results}
    after = {key(r): r for r in run.results}
    shared = before.keys() & after.keys()
    common = sorted((name for name in shared if before[name].seconds and after[name].seconds),
                    key=lambda name: after[name].seconds / before[name].seconds, reverse=True)
    table = Table("comparison", f"Run {run.id} against run {baseline.id}: time ratio (above 1 is slower)",
                  ["benchmark", f"run {baseline.id} (ms)", f"run {run.id} (ms)", "ratio", "peak memory ratio", ""])
    for name in common:
        ratio = after[name].seconds / before[name].seconds
        old_mb, new_mb = (r.measured.peak_mb() if r.measured else None for r in (before[name], after[name]))
        flag = "REGRESSION" if ratio > REGRESSION else "faster" if ratio < 1 / REGRESSION else ""
        table.add([after[name].name, ms(before[name].seconds), ms(after[name].seconds), f"{ratio:.3f}",
                   f"{new_mb / old_mb:.3f}" if old_mb and new_mb else "", flag], before[name], after[name])
    regressions = sum(row[-1] == "REGRESSION" for row in table.rows)
    notes = [f"{regressions} of {len(common)} benchmarks slower by more than {REGRESSION - 1:.0%}."]
    if len(common) < len(shared):
        notes.append(f"{len(shared) - len(common)} more in both runs without a time in one of them.")
    if run.machine != baseline.machine:
        notes.append(f"Different machines: {run.machine} against {baseline.machine}.")
    for only, results, names in ((run, after, after.keys() - before.keys()),
                                 (baseline, before, before.keys() - after.keys())):
        if names:
            tests = defaultdict(int)
            for name in names:
                tests[results[name].test] += 1
            counts = ", ".join(f"{n} of {test}" for test, n in sorted(tests.items()))
            notes.append(f"Only in run {only.id}: {counts}.")
    table.note = " ".join(notes)
    return table
