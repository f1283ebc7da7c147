"""One table per deliverable of the benchmarks of the model and of attention, a table per test of modules this
report does not know, and the comparison of two runs."""

from __future__ import annotations

from collections import defaultdict

from systems.accounting import checkpoint_levels, model_state, peak_memory
from systems.bench.schema import ATTENTION_PASSES, MODEL_PHASES, scheme_name
from systems.model import get_config
from systems.precision import get_precision
from systems.report.breakdown import breakdown_tables
from systems.report.distributed import allreduce_tables, ddp_tables, fsdp_tables, fullstep_tables, optimizer_tables
from systems.report.markdown import Table, batch_sizes, cell, mib, ms, ms_pm, number, order, pivot, sorted_by
from systems.report.runs import Result, Run

REGRESSION = 1.10  # a time this much above the baseline's is flagged
KNOWN_MODULES = {"bench_model", "bench_attention", "bench_allreduce", "bench_ddp", "bench_checkpoint", "bench_fsdp",
                 "bench_fullstep"}


def build_tables(run: Run) -> list[Table]:
    return (model_tables(run) + warmup_tables(run) + attention_tables(run) + allreduce_tables(run)
            + ddp_tables(run) + fsdp_tables(run) + fullstep_tables(run) + breakdown_tables(run) + optimizer_tables(run)
            + checkpoint_tables(run) + other_tables(run))


def model_tables(run: Run) -> list[Table]:
    results = run.select("bench_model", "test_model")
    keys = ["preset", "context", "precision", "compile"]
    grid = pivot(results, keys, "phase", run.oom("bench_model", "test_model"))
    if not grid:
        return []
    batch = batch_sizes(results)
    phases = [p for p in MODEL_PHASES if any(p in row for row in grid.values())]
    timings = Table("model", f"Model: time per call{batch}, mean ± std (ms; OOM: out of memory)", keys + phases)
    for key, row in grid.items():
        timings.rows.append([number(k) for k in key] + [cell(row.get(p), ms_pm) for p in phases])

    precision = Table("precision", f"Mixed precision: fp32 vs bf16 autocast{batch}, mean (ms)",
                      ["preset", "context", "compile", "phase", "fp32", "bf16", "fp32 / bf16"])
    for key, row in pivot(results, ["preset", "context", "compile", "phase"], "precision").items():
        if "fp32" in row and "bf16" in row:
            precision.rows.append([number(k) for k in key] + [ms(row["fp32"].mean), ms(row["bf16"].mean),
                                                              f"{row['fp32'].mean / row['bf16'].mean:.2f}x"])
    tables = [timings] + ([precision] if precision.rows else [])

    measured = [r for r in results if r.get("peak_memory_mb") is not None]
    if measured:
        grid = pivot(measured, keys, "phase")
        memory = Table("memory", f"Peak memory per preset{batch} (MiB): measured in each phase, and predicted "
                                 "by systems.accounting", keys + phases + ["predicted forward", "predicted backward",
                                                                           "predicted step"],
                       note="Predictions are for eager models (compiled ones save other tensors); the backward "
                            "phases run without optimizer state.")
        for key, row in grid.items():
            memory.rows.append([number(k) for k in key]
                               + [cell(row.get(p), lambda r: f"{r.get('peak_memory_mb'):,.0f}") for p in phases]
                               + _predicted_memory(next(iter(row.values()))))
        tables.append(memory)
    return tables


def _predicted_memory(result: Result) -> list[str]:
    if result.get("compile", "eager") != "eager":
        return ["", "", ""]
    try:
        config = get_config(result.get("preset"), attention=result.get("attention", "sdpa"),
                            context_length=result.get("context"))
        peak = peak_memory(config, result.get("batch_size"), result.get("context"),
                           get_precision(result.get("precision")))
    except (ValueError, TypeError):  # a point the arithmetic does not know
        return ["", "", ""]
    return [mib(peak.forward), mib(peak.forward_backward), mib(peak.train_step)]


def warmup_tables(run: Run) -> list[Table]:
    results = sorted_by(run.select("bench_model", "test_warmup_study"), ["warmup_steps"])
    if not results:
        return []
    table = Table("warmup", f"Warm-up study: forward+backward after n untimed steps{batch_sizes(results)} (ms)",
                  ["warm-up steps", "preset", "context", "precision", "mean ± std", "min", "max", "rounds"])
    for r in results:
        table.rows.append([number(r.get(k)) for k in ("warmup_steps", "preset", "context", "precision")]
                          + [ms_pm(r), ms(r.min), ms(r.max), str(r.rounds)])
    return [table]


def attention_tables(run: Run) -> list[Table]:
    tables = []
    keys = ["impl", "d", "seq"]
    grid = pivot(run.select("bench_attention", "test_handout_sweep"), keys, "pass",
                 run.oom("bench_attention", "test_handout_sweep"))
    if grid:
        table = Table("attention_handout", "Attention, batch 8, one head, no mask (ms; OOM: out of memory)",
                      keys + ["forward", "backward", "memory before backward (MiB)"])
        for key, row in grid.items():
            table.rows.append([number(k) for k in key] + [cell(row.get("forward"), ms_pm),
                                                          cell(row.get("backward"), ms_pm),
                                                          cell(row.get("backward"),
                                                                lambda r: number(r.get("memory_before_backward_mb")))])
        tables.append(table)

    keys = ["precision", "d", "seq", "pass"]
    grid = pivot(run.select("bench_attention", "test_flash_sweep"), keys, "impl",
                 run.oom("bench_attention", "test_flash_sweep"))
    if grid:
        impls = sorted({impl for row in grid.values() for impl in row})
        table = Table("attention_flash", "FlashAttention-2 vs PyTorch vs SDPA, batch 1, causal, mean (ms; "
                                         "OOM: out of memory)", keys + impls)
        for key, row in grid.items():
            table.rows.append([number(k) for k in key] + [cell(row.get(impl), lambda r: ms(r.mean)) for impl in impls])
        tables.append(table)

    kernels = [r for r in run.select("bench_attention", "test_flash_sweep")
               if r.get("impl") == "triton" and r.get("sdpa_device_ms") is not None]
    if kernels:
        table = Table("attention_forward_kernels", "FlashAttention-2 forward kernels against SDPA's, timed in turns "
                                                   "(CUDA-graph replay, median ms)",
                      ["precision", "d", "seq", "triton", "sdpa", "vs SDPA"])
        for r in sorted_by(kernels, ["precision", "d", "seq"]):
            table.rows.append([number(r.get(k)) for k in ("precision", "d", "seq", "device_ms", "sdpa_device_ms",
                                                          "vs_sdpa")])
        tables.append(table)

    # The point alone, and after its compiled function first saw another sequence length (symbolic sizes).
    board = run.select("bench_attention", "test_leaderboard") + run.select(
        "bench_attention", "test_leaderboard_after_a_second_shape")
    if board:
        table = Table("attention_leaderboard", "Leaderboard: (16, 16384, 64) bf16 causal (ms)",
                      ["pass", "compiled first at seq", "pytest-benchmark mean", "do_bench median",
                       "SDPA do_bench median", "vs SDPA"])
        for r in sorted(board, key=lambda r: (ATTENTION_PASSES.index(r.get("pass", "forward")),
                                              r.get("first_seq") is not None)):
            table.rows.append([number(r.get("pass")), number(r.get("first_seq") or 16384), ms(r.mean)]
                              + [number(r.get(k)) for k in ("do_bench_ms", "sdpa_do_bench_ms", "vs_sdpa")])
        tables.append(table)
    return tables



def checkpoint_tables(run: Run) -> list[Table]:
    """Memory against time for each checkpointing scheme, beside no checkpointing; the longest context trained."""
    keys = ["preset", "batch", "context", "precision", "attention"]
    grid = defaultdict(dict)  # setting: {scheme name: result, or "OOM"}
    for r in run.select("bench_checkpoint", "test_checkpoint"):
        grid[tuple(r.get(k) for k in keys)][scheme_name(r.get("scheme"), r.get("blocks"))] = r
    for point in run.oom("bench_checkpoint", "test_checkpoint"):
        grid[tuple(point[k] for k in keys)].setdefault(scheme_name(point["scheme"], point["blocks"]), "OOM")
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
            if entry == "OOM":
                table.rows.append([number(k) for k in key] + [name, "", "OOM", ""] + _predicted_step(key, name))
                continue
            memory = [_mib(entry.get(k)) for k in ("peak_memory_mb", "predicted_peak_mb", "activation_mb",
                                                   "predicted_activation_mb")]
            segments = "x".join(map(str, entry.get("checkpoint")))
            table.rows.append([number(k) for k in key] + [name, segments, ms(entry.mean),
                                                          _ratio(entry, none, lambda r: r.mean)]
                              + memory + [_ratio(entry, none, lambda r: r.get("activation_mb")),
                                          number(entry.get("recomputed_tflop"))])
    tables = [table] if table.rows else []

    searches = sorted(run.select("bench_checkpoint", "test_largest_context"),
                      key=lambda r: (*(order(r.get(k)) for k in ("preset", "batch", "precision", "attention")),
                                     _scheme_order(scheme_name(r.get("scheme"), r.get("blocks")))))
    if searches:
        search = Table("largest_context", "Longest context that trains (doubling until out of memory), beside the "
                                          "accounting's longest on an 80 GB H100",
                       ["preset", "batch", "precision", "attention", "scheme", "longest trained", "first OOM",
                        "predicted longest", "step at the longest (ms)", "peak (MiB)"])
        search.rows = [[number(r.get(k)) for k in ("preset", "batch", "precision", "attention")]
                       + [scheme_name(r.get("scheme"), r.get("blocks"))]
                       + [number(r.get(k)) for k in ("largest_context", "first_oom_context",
                                                     "predicted_largest_context")]
                       + [ms(r.mean), _mib(r.get("peak_memory_mb"))] for r in searches]
        tables.append(search)
    return tables


def _scheme_order(name: str) -> tuple:
    return (name != "none", name == "nested", int(name.removeprefix("every")) if name.startswith("every") else 0)


def _mib(value: float | None) -> str:
    return "" if value is None else f"{value:,.0f}"


def _ratio(result: Result, baseline, figure) -> str:
    if not isinstance(baseline, Result) or figure(result) is None or not figure(baseline):
        return ""
    return f"{figure(result) / figure(baseline):.3f}"


def _predicted_step(key: tuple, name: str) -> list[str]:
    """The accounting's peak and activation memory of a point that ran out of memory, in MiB."""
    preset, batch, context, precision, attention = key
    precision = get_precision(precision)
    config = get_config(preset, attention=attention, context_length=context)
    scheme, blocks = ("blocks", int(name.removeprefix("every"))) if name.startswith("every") else (name, None)
    levels = checkpoint_levels(scheme, config, batch, context, precision, blocks=blocks)
    peak = peak_memory(get_config(preset, attention=attention, context_length=context, checkpoint=levels), batch,
                       context, precision).train_step
    state = model_state(config, precision).training
    return ["", mib(peak), "", mib(peak - state), "", ""]


def other_tables(run: Run) -> list[Table]:
    """One table per test of modules this report does not know: the point's fields, then its time."""
    by_test = defaultdict(list)
    for r in run.results:
        if r.module not in KNOWN_MODULES:
            by_test[r.module, r.test].append(r)
    tables = []
    for (module, test), results in sorted(by_test.items()):
        columns = sorted({k for r in results for k, v in r.fields.items() if isinstance(v, (str, int, float, bool))})
        table = Table(f"{module}_{test}", f"{module}::{test} (ms)", columns + ["mean ± std"])
        table.rows = [[number(r.get(k)) for k in columns] + [ms_pm(r)] for r in sorted_by(results, columns)]
        tables.append(table)
    return tables



def comparison_table(run: Run, baseline: Run) -> Table:
    before = {f"{r.module}::{r.name}": r for r in baseline.results}
    after = {f"{r.module}::{r.name}": r for r in run.results}
    common = sorted(before.keys() & after.keys(), key=lambda k: after[k].seconds / before[k].seconds, reverse=True)
    table = Table("comparison", f"Run {run.id} against run {baseline.id}: time ratio (above 1 is slower)",
                  ["benchmark", f"run {baseline.id} (ms)", f"run {run.id} (ms)", "ratio", "peak memory ratio", ""])
    for name in common:
        ratio = after[name].seconds / before[name].seconds
        old_mb, new_mb = before[name].get("peak_memory_mb"), after[name].get("peak_memory_mb")
        flag = "REGRESSION" if ratio > REGRESSION else "faster" if ratio < 1 / REGRESSION else ""
        table.rows.append([name, ms(before[name].seconds), ms(after[name].seconds), f"{ratio:.3f}",
                           f"{new_mb / old_mb:.3f}" if old_mb and new_mb else "", flag])
    regressions = sum(row[-1] == "REGRESSION" for row in table.rows)
    notes = [f"{regressions} of {len(common)} benchmarks slower by more than {REGRESSION - 1:.0%}."]
    if run.machine != baseline.machine:
        notes.append(f"Different machines: {run.machine} against {baseline.machine}.")
    for only, names in ((run, after.keys() - before.keys()), (baseline, before.keys() - after.keys())):
        if names:
            modules = defaultdict(int)
            for name in names:
                modules[name.split("::")[0]] += 1
            counts = ", ".join(f"{n} of {module}" for module, n in sorted(modules.items()))
            notes.append(f"Only in run {only.id}: {counts}.")
    table.note = " ".join(notes)
    return table
