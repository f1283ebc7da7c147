"""The tables of the distributed benchmarks: all-reduce, data-parallel steps with the bucket model beside the
bucket-size sweep, FSDP beside DDP, the whole training step the leaderboard times, and the sharded optimizer's
memory."""

from __future__ import annotations

import math

from systems.accounting import BucketedAllReduce, count_parameters, fit_bucketed_allreduce, flops
from systems.bench.predictions import predicted_peak_mb
from systems.bench.schema import DDP_VARIANTS, FSDP_VARIANTS, Phases, TrainingPoint
from systems.bench.schema.distributed import SHAPE
from systems.levers.checkpointing import Checkpointing
from systems.levers.variant import Variant
from systems.model import get_config
from systems.report.markdown import BATCH, Table, fields_of, mib, ms, number, order, sorted_by
from systems.report.runs import OutOfMemory, Result, Run

PHASES = ("step", "forward", "backward", "comm_wait", "optimizer")


def allreduce_tables(run: Run) -> list[Table]:
    keys = ["backend", "world_size", "size_mb"]
    results = sorted_by(run.select("allreduce"), keys)
    oom = run.oom("allreduce")
    if not results and not oom:
        return []
    table = Table("allreduce", "All-reduce of float32 tensors (times: mean over ranks of their medians)",
                  ["backend", "ranks", "MiB", "per call, sync each (ms)", "spread across ranks (ms)",
                   "per call busbw (GB/s)", "back-to-back, nccl-tests (ms)", "spread across ranks (ms)",
                   "algbw (GB/s)", "busbw (GB/s)", "bare loop busbw (GB/s)", "back-to-back / bare"],
                  note="Per call: one all-reduce at a time, after a barrier, ended by a synchronize: latency at small "
                       "sizes. Back-to-back: nccl-tests' time per all-reduce, over calls issued with no host "
                       "synchronization in between; its algbw and busbw compare with nccl-tests'. The bare loop is "
                       "one uninterrupted loop of them. Runs saved before the back-to-back figures have per-call "
                       "ones only.")
    for r in results:
        m = r.measured
        table.add([number(k) for k in fields_of(r.point, keys)]
                  + [ms(m.latency_s), ms(m.latency_spread_s), number(m.latency_busbw_gbps), ms(m.loop_time_s),
                     ms(m.loop_spread_s)]
                  + [number(v) for v in (m.algbw_gbps, m.busbw_gbps, m.bare_busbw_gbps, m.loop_vs_bare)], r)
    for entry in oom:
        table.add([number(k) for k in fields_of(entry.point, keys)] + ["OOM"] + [""] * 8, entry)
    return [table]


def sorted_by_point(results: list[Result], keys: list[str], variants: tuple[Variant, ...] = ()) -> list[Result]:
    """Sorted by `keys`, the variants in their table order (baselines first), others after them by name."""
    rank = {variant: i for i, variant in enumerate(variants)}
    return sorted(results, key=lambda r: tuple(order(rank.get(value, value) if key == "variant" else value)
                                               for key, value in zip(keys, point_values(r.point, keys))))


def point_values(point: TrainingPoint, keys: list[str]) -> list:
    """A training point's values of `keys`: its ranks, or its spec's fields its id names (TrainingPoint.shows);
    None for the others (a lever its kind does not vary, our FSDP's beside the other variants)."""
    return [point.world_size if key == "world_size" else getattr(point.spec, key) if point.shows(key) else None
            for key in keys]


def training_batches(results: list[Result]) -> set[int]:
    return {r.point.spec.batch_size for r in results}


def _training_steps(run: Run, kind: str, keys: list[str],
                    variants: tuple[Variant, ...]) -> tuple[list[Result], list[OutOfMemory]]:
    """A training bench's results, sorted by `keys` with the variants in their table order, and its OOM points."""
    return sorted_by_point(run.select(kind), keys, variants), run.oom(kind)


def phase_cells(phases: Phases, names: tuple[str, ...] = PHASES) -> list[str]:
    return [ms(getattr(phases, f"{name}_s")) for name in names]


def baseline(run: Run, result: Result, variant: Variant, world_size: int) -> Result | None:
    """The same run's `variant` at the result's shape on `world_size` ranks (None if absent, or the result's own)."""
    others = [other for other in run.select(result.point.kind, world_size=world_size)
              if other.point.spec.variant == variant and shape_of(other.point) == shape_of(result.point)]
    return None if not others or result.point.spec.variant == variant else others[0]


def shape_of(point: TrainingPoint) -> tuple:
    return tuple(getattr(point.spec, key) for key in SHAPE)


def vs(result: Result, other: Result | None) -> float | None:
    """The step against another's (None without one)."""
    return None if other is None else result.measured.phases.step_s / other.measured.phases.step_s


def ddp_tables(run: Run) -> list[Table]:
    keys = ["precision", "context", "world_size", "variant", "bucket_size_mb"]
    results, oom = _training_steps(run, "ddp", keys, DDP_VARIANTS)
    if not results and not oom:
        return []
    steps = Table("ddp", f"Data-parallel training step{BATCH} per rank (ms; mean over ranks of their "
                         "medians)",
                  ["precision", "context", "ranks", "variant", "bucket MiB", "step", "forward", "backward",
                   "comm wait", "optimizer", "comm share", "vs single", "vs torch DDP", "TFLOP/s per GPU"],
                  batches=training_batches(results))
    for r in results:
        single, torch = baseline(run, r, Variant.SINGLE, 1), baseline(run, r, Variant.TORCH, r.point.world_size)
        steps.add([number(k) for k in point_values(r.point, keys)] + phase_cells(r.measured.phases)
                  + [f"{r.measured.comm_share:.1%}"]
                  + [number(v) for v in (vs(r, single), vs(r, torch), r.measured.throughput.tflops)],
                  r, *filter(None, (single, torch)))
    for entry in oom:
        steps.add([number(k) for k in point_values(entry.point, keys)] + ["OOM"] + [""] * 8, entry)

    bucketed = [r for r in results if r.point.spec.variant == Variant.BUCKETED]
    if not bucketed:
        return [steps]
    sweep = Table("ddp_buckets", "DDPBucketed bucket-size sweep (ms), beside the bucket model of "
                                 "systems.accounting.BucketedAllReduce",
                  ["precision", "context", "ranks", "bucket MiB", "step", "backward", "comm wait",
                   "predicted comm wait", "predicted best bucket (MiB)"],
                  note="The model takes the one-process backward as compute time and the all-reduce benchmark's "
                       "latency and bus bandwidth (fitted over its sizes) for the same backend and ranks.")
    for r in bucketed:
        model, inputs = _bucket_model(run, r)
        predicted, best = "", ""
        if model is not None:
            buckets = max(1, math.ceil(model.param_bytes / (r.point.spec.bucket_size_mb * 2**20)))
            predicted = ms(model.overhead(buckets))
            if model.latency > 0:  # without a latency the model wants ever smaller buckets
                best = number(model.optimal_bucket_bytes() / 2**20)
        sweep.add([number(k) for k in point_values(r.point, ["precision", "context", "world_size", "bucket_size_mb"])]
                  + phase_cells(r.measured.phases, ("step", "backward", "comm_wait")) + [predicted, best], r, *inputs)
    return [steps, sweep]


def _bucket_model(run: Run, step: Result) -> tuple[BucketedAllReduce | None, list[Result]]:
    """The bucket model for a DDPBucketed point, from the same run's single-process and all-reduce points, and
    those points."""
    spec = step.point.spec
    single = [r for r in run.select("ddp") if r.point.spec.variant == Variant.SINGLE
              and (r.point.spec.precision, r.point.spec.context) == (spec.precision, spec.context)]
    calls = run.select("allreduce", backend=step.measured.backend, world_size=step.point.world_size)
    if not single:
        return None, []
    params = count_parameters(get_config(spec.preset, spec.edition, context_length=spec.context))
    model = fit_bucketed_allreduce(backward_seconds=single[0].measured.phases.backward_s,
                                   param_bytes=spec.precision.grad_bytes * params, world_size=step.point.world_size,
                                   allreduces=[(r.measured.bytes, r.measured.latency_s) for r in calls])
    return model, [single[0], *calls]


def fsdp_tables(run: Run) -> list[Table]:
    keys = ["preset", "precision", "context", "world_size", "variant", "fsdp_prefetch", "fsdp_gather"]
    results, oom = _training_steps(run, "fsdp", keys, FSDP_VARIANTS)
    if not results and not oom:
        return []
    table = Table("fsdp", f"FSDP beside DDP: training step{BATCH} per rank (ms; mean over ranks of "
                          "their medians) and peak memory (MiB, the largest rank's)",
                  ["preset", "precision", "context", "ranks", "variant", "prefetch", "gather", "step", "forward",
                   "backward", "comm wait", "optimizer", "all-gather wait", "vs single", "TFLOP/s per GPU", "peak",
                   "predicted peak", "peak / predicted", "gathered weights"],
                  note="fsdp is ours, fsdp2 torch's fully_shard; prefetch is how many all-gathers ours keeps in "
                       "flight ahead of the computing layer, gather what one of its collectives covers (a layer's "
                       "weight or a block's); the all-gather wait is the time the compute stream waited for "
                       "all-gathers that prefetching did not hide. Predicted peaks: today's accounting's for each "
                       "point's levers (systems.bench.predictions), fsdp_memory for ours, peak_memory for one "
                       "process and DDP (which leaves out DDP's buckets), none for fsdp2; where the run stored "
                       "another, it follows in brackets.",
                  batches=training_batches(results))
    for r in results:
        m = r.measured
        peak, (predicted, predicted_cell) = m.peak_mb(), predicted_peak(r, mib)
        single = baseline(run, r, Variant.SINGLE, 1)
        table.add(point_cells(r.point, keys) + phase_cells(m.phases, (*PHASES, "gather_wait"))
                  + [number(vs(r, single)), number(m.throughput.tflops)]
                  + [mib(peak), predicted_cell,
                     "" if peak is None or not predicted else f"{peak / predicted:.2f}",
                     mib(m.peak_gathered_mb)], r, *filter(None, (single,)))
    for entry in oom:
        table.add(point_cells(entry.point, keys) + ["OOM"] + [""] * 11, entry)
    return [table]


FULLSTEP_KEYS = ["preset", "precision", "context", "world_size", "variant", "attention", "checkpoint",
                 "loss_chunk", "fsdp_gather", "fused", "compile"]


def fullstep_tables(run: Run) -> list[Table]:
    results, oom = _training_steps(run, "fullstep", FULLSTEP_KEYS, FSDP_VARIANTS)
    if not results and not oom:
        return []
    table = Table("fullstep", f"Whole training step{BATCH} per rank, as the leaderboard times it: "
                              "step (s), throughput and peak memory (GiB)",
                  ["preset", "precision", "context", "ranks", "variant", "attention", "checkpoint every",
                   "loss chunk", "gather", "fused kernels", "compiled", "step", "do_bench step", "MFU",
                   "MFU, torchtitan's count", "tokens/s", "peak per rank", "predicted peak", "peak / predicted",
                   "cold start (s)"],
                  note="Step: mean over ranks of their medians of the timed steps; do_bench step: the leaderboard's "
                       "figure, triton's do_bench median on the slowest rank (GPU only). MFU and tokens/s come from "
                       "the do_bench step where there is one; MFU counts model FLOPs, recomputation left out: "
                       "attention's causal half, its backward 2.5 times its forward (the leaderboard's count, "
                       "FlashAttention's); torchtitan's count takes attention whole, its backward twice its forward. "
                       "Predicted peak: the largest rank's, today's accounting's for the point's levers "
                       "(systems.bench.predictions: fsdp_memory for our FSDP), the run's own in brackets where it "
                       "differs. Cold "
                       "start: from the pytest process's start to the end of the point's timed job.",
                  batches=training_batches(results))
    for r in results:
        m = r.measured
        peaks, (predicted, predicted_cell) = m.peak_memory_mb_per_rank or [], predicted_peak(r, _gib)
        mfu = m.throughput.mfu
        spec = r.point.spec
        model = flops(get_config(spec.preset, spec.edition, context_length=spec.context), spec.batch_size,
                      spec.context)
        table.add(point_cells(r.point, FULLSTEP_KEYS) + [number(m.phases.step_s), number(m.do_bench_s)]
                  + ["" if mfu is None else f"{mfu:.1%}",
                     "" if mfu is None else f"{mfu * model.full_attention_step / model.flash_step:.1%}",
                     f"{m.tokens_per_s:,.0f}",
                     ", ".join(map(_gib, peaks)), predicted_cell,
                     f"{max(peaks) / predicted:.2f}" if peaks and predicted else "",
                     number(m.cold_start_s)], r)
    for entry in oom:
        table.add(point_cells(entry.point, FULLSTEP_KEYS) + ["OOM"] + [""] * 8, entry)
    return [table]


def predicted_peak(r: Result, cell) -> tuple[float | None, str]:
    """Today's accounting's peak for the run of `r`'s point, MiB, and its cell written by `cell`, with the
    prediction stored by the run in brackets where it differs by more than rounding."""
    device = "cuda" if r.measured.backend == "nccl" else "cpu"
    today, stored = predicted_peak_mb(r.point.spec, r.point.world_size, device), r.measured.predicted_peak_mb
    shown = cell(today)
    if stored is not None and (today is None or abs(today / stored - 1) > 1e-3):
        shown += f" ({cell(stored)})"
    return today, shown.strip()


LEVERS_OFF = {"checkpoint": "none", "loss_chunk": "full"}  # a full step's levers, by name where they are off


def point_cells(point: TrainingPoint, keys: list[str]) -> list[str]:
    """A training point's values of `keys` as cells (point_values): a lever it leaves off by name; a lever its kind
    does not vary, or our FSDP's for the other variants, empty."""

    def cell(key: str, value) -> str:
        if key != "world_size" and not point.shows(key):
            return ""
        if isinstance(value, bool):
            return "yes" if value else "no"
        if key == "checkpoint":  # one level of segments by their size, as the tables' "checkpoint" column says
            plain = value.levels is not None and len(value.levels) == 1 and value == Checkpointing(value.levels)
            return str(value.levels[0]) if plain else str(value)
        return LEVERS_OFF[key] if value is None and key in LEVERS_OFF else number(value)

    return [cell(key, value) for key, value in zip(keys, point_values(point, keys))]


def _gib(mb: float | None) -> str:
    return "" if mb is None else f"{mb / 1024:.2f}"


def optimizer_tables(run: Run) -> list[Table]:
    keys = ["world_size", "optimizer"]
    results = sorted_by_point(run.select("optimizer"), keys)
    if not results:
        return []
    moments = sorted({moment for r in results for moment in r.measured.memory_mb or {}})
    table = Table("sharded_optimizer", "Optimizer state and peak memory per rank (MiB): AdamW, ShardedOptimizer, "
                                       "torch ZeroRedundancyOptimizer",
                  ["ranks", "optimizer", "state per rank", "unsharded state", "largest share", "ideal share"]
                  + [f"peak {moment.replace('_', ' ')}" for moment in moments] + ["optimizer (ms)", "step (ms)"])
    for r in results:
        m = r.measured
        table.add([number(k) for k in point_values(r.point, keys)]
                  + [mib(max(m.state_mb)), mib(m.unsharded_state_mb), number(m.state_fraction),
                     number(m.ideal_fraction)]
                  + [mib((m.memory_mb or {}).get(moment)) for moment in moments]
                  + [ms(m.optimizer_s), ms(m.step_s)], r)
    return [table]
