"""The tables of the distributed benchmarks: all-reduce, data-parallel steps with the bucket model beside the
bucket-size sweep, FSDP beside DDP, the whole training step the leaderboard times, and the sharded optimizer's
memory."""

from __future__ import annotations

import math

from systems.accounting import BucketedAllReduce, count_parameters, fit_bucketed_allreduce
from systems.bench.schema import DDP_TIMINGS, DDP_VARIANTS, FSDP_TIMINGS, FSDP_VARIANTS, seconds_key
from systems.model import get_config
from systems.precision import get_precision
from systems.report.markdown import Table, batch_sizes, ms, number, order, sorted_by
from systems.report.runs import Result, Run


def allreduce_tables(run: Run) -> list[Table]:
    keys = ["backend", "world_size", "size_mb"]
    results = sorted_by(run.select("bench_allreduce", "test_allreduce"), keys)
    oom = run.oom("bench_allreduce", "test_allreduce")
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
        table.rows.append([number(r.get(k)) for k in keys] + _allreduce_figures(r))
    table.rows += [[number(point[k]) for k in keys] + ["OOM"] + [""] * 8 for point in oom]
    return [table]


def _allreduce_figures(r: Result) -> list[str]:
    if r.get("loop_time_s") is None:  # saved before the back-to-back figures: its time and busbw are per call
        return ([ms(r.get("time_s")), ms(r.get("time_spread_s")), number(r.get("busbw_gbps"))] + [""] * 4
                + [number(r.get("bare_busbw_gbps")), ""])
    return ([ms(r.get(k)) for k in ("latency_s", "latency_spread_s")] + [number(r.get("latency_busbw_gbps"))]
            + [ms(r.get(k)) for k in ("loop_time_s", "loop_spread_s")]
            + [number(r.get(k)) for k in ("algbw_gbps", "busbw_gbps", "bare_busbw_gbps", "loop_vs_bare")])


def sorted_by_point(results: list[Result], keys: list[str], variants: tuple[str, ...]) -> list[Result]:
    """Sorted by `keys`, the variants in their table order (baselines first), others after them by name."""
    rank = {variant: i for i, variant in enumerate(variants)}
    return sorted(results, key=lambda r: tuple(
        order(rank.get(r.get(k), r.get(k)) if k == "variant" else r.get(k)) for k in keys))


def _training_steps(run: Run, module: str, test: str, keys: list[str],
                    variants: tuple[str, ...]) -> tuple[list[Result], list[dict]]:
    """A training bench's results, sorted by `keys` with the variants in their table order, and its OOM points."""
    return sorted_by_point(run.select(module, test), keys, variants), run.oom(module, test)


def ddp_tables(run: Run) -> list[Table]:
    keys = ["precision", "context", "world_size", "variant", "bucket_size_mb"]
    results, oom = _training_steps(run, "bench_ddp", "test_ddp_step", keys, DDP_VARIANTS)
    if not results and not oom:
        return []
    batch = batch_sizes(results, "batch_size_per_rank")
    steps = Table("ddp", f"Data-parallel training step{batch} per rank (ms; mean over ranks of their medians)",
                  ["precision", "context", "ranks", "variant", "bucket MiB", "step", "forward", "backward",
                   "comm wait", "optimizer", "comm share", "vs single", "vs torch DDP", "TFLOP/s per GPU"])
    for r in results:
        share = r.get("comm_share")
        steps.rows.append([number(r.get(k)) for k in keys] + [ms(r.get(seconds_key(t))) for t in DDP_TIMINGS]
                          + ["" if share is None else f"{share:.1%}"]
                          + [number(r.get(k)) for k in ("vs_single", "vs_torch_ddp", "tflops")])
    steps.rows += [[number(point.get(k)) for k in keys] + ["OOM"] + [""] * 8 for point in oom]

    bucketed = [r for r in results if r.get("variant") == "bucketed"]
    if not bucketed:
        return [steps]
    sweep = Table("ddp_buckets", "DDPBucketed bucket-size sweep (ms), beside the bucket model of "
                                 "systems.accounting.BucketedAllReduce",
                  ["precision", "context", "ranks", "bucket MiB", "step", "backward", "comm wait",
                   "predicted comm wait", "predicted best bucket (MiB)"],
                  note="The model takes the one-process backward as compute time and the all-reduce benchmark's "
                       "latency and bus bandwidth (fitted over its sizes) for the same backend and ranks.")
    for r in bucketed:
        model = _bucket_model(run, r)
        predicted, best = "", ""
        if model is not None:
            buckets = max(1, math.ceil(model.param_bytes / (r.get("bucket_size_mb") * 2**20)))
            predicted = ms(model.overhead(buckets))
            if model.latency > 0:  # without a latency the model wants ever smaller buckets
                best = number(model.optimal_bucket_bytes() / 2**20)
        sweep.rows.append([number(r.get(k)) for k in ("precision", "context", "world_size", "bucket_size_mb")]
                          + [ms(r.get(seconds_key(t))) for t in ("step", "backward", "comm_wait")] + [predicted, best])
    return [steps, sweep]


def _bucket_model(run: Run, step: Result) -> BucketedAllReduce | None:
    """The bucket model for a DDPBucketed point, from the same run's single-process and all-reduce points."""
    single = [r for r in run.select("bench_ddp", "test_ddp_step") if r.get("variant") == "single"
              and r.get("precision") == step.get("precision") and r.get("context") == step.get("context")]
    calls = [r for r in run.select("bench_allreduce", "test_allreduce")
             if r.get("backend") == step.get("backend") and r.get("world_size") == step.get("world_size")]
    if not single:
        return None
    try:
        params = count_parameters(get_config(step.get("preset"), context_length=step.get("context")))
        grad_bytes = get_precision(step.get("precision")).grad_bytes
    except (ValueError, TypeError):
        return None
    # Runs saved before the back-to-back figures timed one call at a time as time_s.
    allreduces = [(r.get("bytes"), r.get("latency_s", r.get("time_s"))) for r in calls]
    return fit_bucketed_allreduce(backward_seconds=single[0].get(seconds_key("backward")),
                                  param_bytes=grad_bytes * params, world_size=step.get("world_size"),
                                  allreduces=allreduces)


def fsdp_tables(run: Run) -> list[Table]:
    keys = ["preset", "precision", "context", "world_size", "variant", "prefetch", "gather"]
    results, oom = _training_steps(run, "bench_fsdp", "test_fsdp_step", keys, FSDP_VARIANTS)
    if not results and not oom:
        return []
    table = Table("fsdp", f"FSDP beside DDP: training step{batch_sizes(results)} per rank (ms; mean over ranks of "
                          "their medians) and peak memory (MiB, the largest rank's)",
                  ["preset", "precision", "context", "ranks", "variant", "prefetch", "gather", "step", "forward",
                   "backward",
                   "comm wait", "optimizer", "all-gather wait", "vs single", "TFLOP/s per GPU", "peak",
                   "predicted peak", "peak / predicted", "gathered weights"],
                  note="fsdp is ours, fsdp2 torch's fully_shard; prefetch is how many all-gathers ours keeps in "
                       "flight ahead of the computing layer, gather what one of its collectives covers (a layer's "
                       "weight or a block's); the all-gather wait is the time the compute stream "
                       "waited for all-gathers that prefetching did not hide. Predicted peaks: "
                       "systems.accounting.fsdp_memory for ours, peak_memory for one process and DDP "
                       "(which leaves out DDP's buckets); none for fsdp2 (older histories hold one process's).")
    for r in results:
        peak = max((r.get(k) for k in r.fields if k.startswith("memory_") and k.endswith("_mb")), default=None)
        predicted = r.get("predicted_peak_mb")
        table.rows.append(point_cells(r.fields, keys) + [ms(r.get(seconds_key(t))) for t in FSDP_TIMINGS]
                          + [number(r.get(k)) for k in ("vs_single", "tflops")]
                          + [number(peak), number(predicted),
                             "" if peak is None or not predicted else f"{peak / predicted:.2f}",
                             number(r.get("peak_gathered_mb"))])
    table.rows += [point_cells(point, keys) + ["OOM"] + [""] * 11 for point in oom]
    return [table]


FULLSTEP_KEYS = ["preset", "precision", "context", "world_size", "variant", "attention", "checkpoint_blocks",
                 "loss_chunk", "gather"]


def fullstep_tables(run: Run) -> list[Table]:
    results, oom = _training_steps(run, "bench_fullstep", "test_fullstep", FULLSTEP_KEYS, FSDP_VARIANTS)
    if not results and not oom:
        return []
    table = Table("fullstep", f"Whole training step{batch_sizes(results)} per rank, as the leaderboard times it: "
                              "step (s), throughput and peak memory (GiB)",
                  ["preset", "precision", "context", "ranks", "variant", "attention", "checkpoint every",
                   "loss chunk", "gather", "step", "do_bench step", "MFU", "tokens/s", "peak per rank",
                   "predicted peak", "peak / predicted", "cold start (s)"],
                  note="Step: mean over ranks of their medians of the timed steps; do_bench step: the leaderboard's "
                       "figure, triton's do_bench median on the slowest rank (GPU only). MFU and tokens/s come from "
                       "the do_bench step where there is one; MFU counts model FLOPs, recomputation left out. "
                       "Predicted peak: the largest rank's (systems.accounting.fsdp_memory for our FSDP). Cold "
                       "start: from the pytest process's start to the end of the point's timed job.")
    for r in results:
        peaks, predicted = r.get("peak_memory_mb_per_rank") or [], r.get("predicted_peak_mb")
        mfu, tokens = r.get("mfu"), r.get("tokens_per_s")
        table.rows.append(point_cells(r.fields, FULLSTEP_KEYS) + [number(r.get(k)) for k in ("step_s", "do_bench_s")]
                          + ["" if mfu is None else f"{mfu:.1%}", "" if tokens is None else f"{tokens:,.0f}",
                             ", ".join(map(_gib, peaks)), _gib(predicted),
                             f"{max(peaks) / predicted:.2f}" if peaks and predicted else "",
                             number(r.get("cold_start_s"))])
    table.rows += [point_cells(point, FULLSTEP_KEYS) + ["OOM"] + [""] * 7 for point in oom]
    return [table]


LEVERS_OFF = {"checkpoint_blocks": "none", "loss_chunk": "full"}  # a full step's levers, by name where None
OURS_ONLY = ("prefetch", "gather")  # our FSDP's levers, which the other variants have not
SAVED_BEFORE = {"prefetch": 1, "gather": "layer"}  # what our FSDP ran with before its point recorded the lever


def point_cells(fields: dict, keys: list[str]) -> list[str]:
    """A point's fields as cells: a lever the point has but leaves off by name, our FSDP's levers blank for the
    other variants and as they ran where an older record lacks them, another field a point lacks empty."""
    def cell(key: str) -> str:
        if key in OURS_ONLY:
            return number(fields.get(key, SAVED_BEFORE[key])) if fields.get("variant") == "fsdp" else ""
        return LEVERS_OFF.get(key, "") if fields.get(key) is None and key in fields else number(fields.get(key))

    return [cell(key) for key in keys]


def _gib(mb: float | None) -> str:
    return "" if mb is None else f"{mb / 1024:.2f}"


def optimizer_tables(run: Run) -> list[Table]:
    keys = ["world_size", "optimizer"]
    results = sorted_by(run.select("bench_ddp", "test_optimizer_memory"), keys)
    if not results:
        return []
    moments = sorted({k for r in results for k in r.fields if k.startswith("memory_") and k.endswith("_mb")})
    table = Table("sharded_optimizer", "Optimizer state and peak memory per rank (MiB): AdamW, ShardedOptimizer, "
                                       "torch ZeroRedundancyOptimizer",
                  ["ranks", "optimizer", "state per rank", "unsharded state", "largest share", "ideal share"]
                  + [f"peak {m.removeprefix('memory_').removesuffix('_mb').replace('_', ' ')}" for m in moments]
                  + ["optimizer (ms)", "step (ms)"])
    for r in results:
        state = r.get("state_mb")
        table.rows.append([number(r.get(k)) for k in keys] + [number(max(state)) if state else "",
                                                              number(r.get("unsharded_state_mb")),
                                                              number(r.get("state_fraction")),
                                                              number(r.get("ideal_fraction"))]
                          + [number(r.get(m)) for m in moments]
                          + [ms(r.get(seconds_key(t))) for t in ("optimizer", "step")])
    return [table]
