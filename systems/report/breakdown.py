"""Where a step's GPU time goes: the profiled step each rank of a training bench records on a GPU
(`breakdown_per_rank`, systems.bench.breakdown's StepBreakdown), one row per point and rank."""

from __future__ import annotations

from systems.bench.breakdown import StepBreakdown
from systems.bench.schema import FSDP_VARIANTS, FSDPMeasured
from systems.report.distributed import FULLSTEP_KEYS, point_cells, sorted_by_point
from systems.report.markdown import Table, ms
from systems.report.runs import Run

# The kinds split the GPU activity by kernel; exposed communication is the part of it no compute overlaps.
KINDS = ("matmul", "attention_forward", "attention_backward", "communication", "communication_exposed", "other")
RANGES = ("optimizer", "loss", "recompute")  # cut across the kinds: a recomputed matmul counts in both
POINT_KEYS = [*FULLSTEP_KEYS, "fsdp_prefetch"]  # a full step's fields, and FSDP's prefetch depth, which it leaves at 1


def breakdown_tables(run: Run) -> list[Table]:
    results = [r for r in run.results if isinstance(r.measured, FSDPMeasured) and r.measured.breakdown_per_rank]
    if not results:
        return []
    table = Table("breakdown", "Where a step's GPU time goes, per rank: one profiled step (ms; in brackets, the "
                               "share of the span)",
                  ["bench", "preset", "precision", "context", "ranks", "variant", "attention", "checkpoint every",
                   "loss chunk", "gather", "fused kernels", "compiled", "prefetch", "rank", "span", "busy", "idle",
                   "matmul", "attention fwd", "attention bwd", "communication", "exposed communication", "other",
                   "optimizer", "loss", "recompute"],
                  note="Span: the first GPU activity's start to the last's end; busy: the time any ran; idle: the "
                       "span less the busy time. Matmul, attention, communication and other split the GPU activity "
                       "by kernel; they add up to more than busy where streams overlap (communication beside "
                       "compute). Exposed communication: the time only NCCL kernels ran. Optimizer, loss and "
                       "recompute are ranges of the step that cut across the kinds (systems.bench.breakdown).")
    # Kind by kind (FSDP points and full steps record breakdowns), each point named by the full step's fields,
    # of which an FSDP point has the first five and ours the levers: the table drops a column no row fills.
    for r in sorted(sorted_by_point(results, POINT_KEYS, FSDP_VARIANTS), key=lambda r: r.point.kind):
        point = [r.point.kind] + point_cells(r.point, POINT_KEYS)
        for rank, step in enumerate(r.measured.breakdown_per_rank):
            table.add(point + [str(rank)] + breakdown_cells(step), r)
    return [table]


def breakdown_cells(step: StepBreakdown) -> list[str]:
    def share(seconds: float) -> str:
        return f"{ms(seconds)} ({seconds / step.span_s:.1%})" if step.span_s else ms(seconds)

    parts = [getattr(step, f"{name}_s") for name in (*KINDS, *RANGES)]
    return [ms(step.span_s), ms(step.busy_s), share(step.span_s - step.busy_s)] + [share(s) for s in parts]
