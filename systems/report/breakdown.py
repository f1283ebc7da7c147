"""Where a step's GPU time goes: the profiled step each rank of a training bench records on a GPU
(`breakdown_per_rank`, systems.bench.breakdown's StepBreakdown), one row per point and rank."""

from __future__ import annotations

from systems.bench.breakdown import StepBreakdown
from systems.bench.schema import FSDP_VARIANTS
from systems.report.distributed import FULLSTEP_KEYS, point_cells, sorted_by_point
from systems.report.markdown import Table, ms
from systems.report.runs import ReportError, Result, Run

# The kinds split the GPU activity by kernel; exposed communication is the part of it no compute overlaps.
KINDS = ("matmul", "attention_forward", "attention_backward", "communication", "communication_exposed", "other")
RANGES = ("optimizer", "loss", "recompute")  # cut across the kinds: a recomputed matmul counts in both
POINT_KEYS = [*FULLSTEP_KEYS, "prefetch"]  # a full step's fields, and FSDP's prefetch depth, which it leaves at 1


def breakdown_tables(run: Run) -> list[Table]:
    results = [r for r in run.results if r.get("breakdown_per_rank")]
    if not results:
        return []
    table = Table("breakdown", "Where a step's GPU time goes, per rank: one profiled step (ms; in brackets, the "
                               "share of the span)",
                  ["bench", "preset", "precision", "context", "ranks", "variant", "attention", "checkpoint every",
                   "loss chunk", "gather", "prefetch", "rank", "span", "busy", "idle", "matmul", "attention fwd",
                   "attention bwd", "communication", "exposed communication", "other", "optimizer", "loss",
                   "recompute"],
                  note="Span: the first GPU activity's start to the last's end; busy: the time any ran; idle: the "
                       "span less the busy time. Matmul, attention, communication and other split the GPU activity "
                       "by kernel; they add up to more than busy where streams overlap (communication beside "
                       "compute). Exposed communication: the time only NCCL kernels ran. Optimizer, loss and "
                       "recompute are ranges of the step that cut across the kinds (systems.bench.breakdown).")
    # Bench by bench (bench_fsdp, bench_fullstep record breakdowns), each point named by the full step's fields,
    # of which an FSDP point has the first five and ours the gather: the table drops a column no row fills.
    for r in sorted(sorted_by_point(results, POINT_KEYS, FSDP_VARIANTS), key=lambda r: r.module):
        point = [r.module.removeprefix("bench_")] + point_cells(r.fields, POINT_KEYS)
        table.rows += [point + [str(rank)] + breakdown_cells(step) for rank, step in enumerate(steps_of(r))]
    return [table]


def steps_of(result: Result) -> list[StepBreakdown]:
    """Each rank's breakdown; a record that is not a StepBreakdown's is a bad history, not a traceback."""
    try:
        return [StepBreakdown(**record) for record in result.get("breakdown_per_rank")]
    except TypeError as exc:
        raise ReportError(f"{result.name}: breakdown_per_rank is not StepBreakdown records ({exc})") from None


def breakdown_cells(step: StepBreakdown) -> list[str]:
    def share(seconds: float) -> str:
        return f"{ms(seconds)} ({seconds / step.span_s:.1%})" if step.span_s else ms(seconds)

    parts = [getattr(step, f"{name}_s") for name in (*KINDS, *RANGES)]
    return [ms(step.span_s), ms(step.busy_s), share(step.span_s - step.busy_s)] + [share(s) for s in parts]
