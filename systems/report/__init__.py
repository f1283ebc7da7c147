"""Writeup tables and plots from pytest-benchmark histories.

    python -m systems.report --out DIR [--run ID] [--compare ID] [--storage .benchmarks] [--machine MACHINE_ID]

Reads one saved run, `.benchmarks/<machine>/NNNN_*.json` (by default the latest complete one: a run that
stopped early is saved as `NNNN_*_partial.json` and read only when named), and writes into DIR
`report.md` with one table per deliverable (each also as `<table>.md`) and PNG plots; with
--compare, the ratio of every benchmark's time to the other run's, regressions flagged. Benchmarks
a run does not have are simply absent. A missing or malformed history is a one-line error, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from systems.accounting import BucketedAllReduce, count_parameters, peak_memory
from systems.bench.history import is_complete
from systems.model import get_config
from systems.precision import get_precision

REGRESSION = 1.10  # a time this much above the baseline's is flagged
MODEL_PHASES = ("forward", "backward", "forward_backward", "step")
ATTENTION_PASSES = ("forward", "backward", "forward_backward")
DDP_VARIANTS = ("single", "torch", "naive", "flat", "individual", "bucketed")
KNOWN_MODULES = {"bench_model", "bench_attention", "bench_allreduce", "bench_ddp"}
# Ids of the points that ran out of memory: they leave no benchmark behind, only their test name.
MODEL_ID = re.compile(r"\[(?P<preset>[^-\]]+)-ctx(?P<context>\d+)-(?P<precision>[\w-]+)-(?P<compile>\w+)"
                      r"-(?P<phase>\w+)\]")
ATTENTION_ID = re.compile(r"\[(?P<impl>\w+)-seq(?P<seq>\d+)-d(?P<d>\d+)-(?P<precision>\w+)-(?P<pass>\w+)\]")
ALLREDUCE_ID = re.compile(r"\[(?P<backend>\w+)-(?P<world_size>\d+)ranks-(?P<size_mb>[\d.]+)MiB\]")
DDP_ID = re.compile(r"\[(?P<variant>[a-z]+)(?:-(?P<bucket_size_mb>[\d.]+)MiB)?-(?P<precision>[\w-]+?)"
                    r"-ctx(?P<context>\d+)-(?P<world_size>\d+)ranks\]")
RUN_RANGE = re.compile(r"(?P<first>\d+)-(?P<last>\d+)")  # --run 16-20


class ReportError(Exception):
    """A problem with the history, reported as one line."""


@dataclass(frozen=True)
class Result:
    module: str  # "bench_model"
    test: str  # "test_model"
    name: str  # "test_model[tiny-ctx128-fp32-eager-forward]"
    fields: dict  # the point: serializable params overlaid with extra_info
    mean: float  # seconds, over pytest-benchmark's rounds
    stddev: float
    min: float
    max: float
    rounds: int

    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    @property
    def seconds(self) -> float:
        """The benchmark's figure: the distributed benches time inside their ranks (time_s, step_s),
        so pytest-benchmark's own mean there is only the cost of a measurement."""
        return self.get("time_s") or self.get("step_s") or self.mean


@dataclass(frozen=True)
class Run:
    paths: tuple[Path, ...]  # one history, or several merged (merge_runs)
    machine: str  # what ran it, e.g. "NVIDIA H100 80GB HBM3, torch 2.11.0"
    commit: str
    datetime: str
    results: list[Result]
    out_of_memory: list[tuple[str, str]]  # (module, test name) of each point that ran out of memory

    @property
    def id(self) -> str:
        return "+".join(path.stem.split("_")[0] for path in self.paths)

    def select(self, module: str, test: str) -> list[Result]:
        return [r for r in self.results if r.module == module and r.test == test]

    def oom(self, module: str, test: str, pattern: re.Pattern) -> list[dict]:
        """The points of `test` that ran out of memory, as the fields their ids spell."""
        points = []
        for mod, name in self.out_of_memory:
            match = pattern.search(name)
            if mod == module and name.split("[")[0] == test and match:
                points.append({k: _parse(v) for k, v in match.groupdict().items()})
        return points


@dataclass
class Table:
    name: str  # file stem
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    note: str = ""

    def markdown(self) -> str:
        # Columns no row fills (a figure only some machines record) are left out.
        keep = [i for i in range(len(self.columns)) if any(row[i] for row in self.rows)] or range(len(self.columns))
        lines = [f"### {self.title}", ""] + ([self.note, ""] if self.note else [])
        lines.append("| " + " | ".join(self.columns[i] for i in keep) + " |")
        lines.append("|" + "|".join("---" for _ in keep) + "|")
        lines += ["| " + " | ".join(row[i].replace("|", "\\|") for i in keep) + " |" for row in self.rows]
        return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Reading histories


def find_run(storage: Path, machine: str | None, run_id: str | None) -> Path:
    """The run file `run_id` names (a number, a file-name prefix or a path, partial runs included), else the
    latest complete run."""
    if run_id is not None and Path(run_id).is_file():
        return Path(run_id)
    if not storage.is_dir():
        raise ReportError(f"no benchmark history at {storage}")
    machines = {d.name: sorted(d.glob("*.json")) for d in storage.iterdir() if d.is_dir()}
    machines = {name: runs for name, runs in machines.items() if runs}
    if machine is None:
        if not machines:
            raise ReportError(f"no saved runs under {storage}")
        machine = max(machines, key=lambda name: _saved_at(machines[name][-1]))
    if machine not in machines:
        raise ReportError(f"no saved runs for machine {machine!r} under {storage}; have {sorted(machines) or 'none'}")
    runs = machines[machine]
    if run_id is None:
        return _latest_complete(runs)
    prefix = f"{int(run_id):04d}_" if run_id.isdigit() else run_id
    matches = [path for path in runs if path.name.startswith(prefix)]
    if len(matches) != 1:
        raise ReportError(f"run {run_id!r} matches {len(matches)} files in {storage / machine}")
    return matches[0]


def _latest_complete(runs: list[Path]) -> Path:
    """The newest run that went through all its tests (an interrupted one is saved as partial)."""
    for path in reversed(runs):
        if is_complete(_read(path)):
            return path
    raise ReportError(f"no complete run in {runs[0].parent}, only partial ones ({', '.join(p.name for p in runs)}); "
                      "name one with --run")


def find_runs(storage: Path, machine: str | None, run_ids: str | None) -> list[Path]:
    """The run files of `run_ids`: one run as find_run takes it, or several separated by commas, where
    `16-20` stands for 16, 17, 18, 19, 20. All come from the machine folder of the first."""
    if run_ids is None or ("," not in run_ids and not RUN_RANGE.fullmatch(run_ids)):
        return [find_run(storage, machine, run_ids)]
    ids = _run_ids(run_ids)
    first = find_run(storage, machine, ids[0])
    return [first] + [find_run(storage, machine or first.parent.name, run_id) for run_id in ids[1:]]


def _run_ids(run_ids: str) -> list[str]:
    """The run ids a --run value lists: `16-20,23` is 16, 17, 18, 19, 20, 23, in that order."""
    ids = []
    for item in (item.strip() for item in run_ids.split(",")):
        span = RUN_RANGE.fullmatch(item)
        if not item:
            raise ReportError(f"empty run id in {run_ids!r}")
        if span and int(span["first"]) > int(span["last"]):
            raise ReportError(f"run range {item!r} counts down; write {span['last']}-{span['first']}, or list the "
                              "runs one by one in the order to merge them")
        ids += [str(n) for n in range(int(span["first"]), int(span["last"]) + 1)] if span else [item]
    return ids


def merge_runs(runs: list[Run]) -> Run:
    """One run of several, e.g. a sweep saved in chunks: where runs share a point, the later one's
    result (or its out-of-memory) wins."""
    if len(runs) == 1:
        return runs[0]
    points: dict[tuple[str, str], Result | tuple[str, str]] = {}
    for run in runs:
        points.update(((r.module, r.name), r) for r in run.results)
        points.update((oom, oom) for oom in run.out_of_memory)
    return Run(paths=tuple(path for run in runs for path in run.paths),
               machine=_distinct(run.machine for run in runs), commit=_distinct(run.commit for run in runs),
               datetime=f"{runs[0].datetime} to {runs[-1].datetime}",
               results=[point for point in points.values() if isinstance(point, Result)],
               out_of_memory=[point for point in points.values() if isinstance(point, tuple)])


def _distinct(values: Iterable[str]) -> str:
    return "; ".join(dict.fromkeys(values))


def _saved_at(path: Path) -> str:
    # pytest-benchmark names runs NNNN_<commit>_YYYYMMDD_HHMMSS[_uncommited-changes].json
    stamp = re.search(r"_(\d{8}_\d{6})", path.stem)
    return stamp.group(1) if stamp else ""


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ReportError(f"{path} is not a pytest-benchmark history ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path} is not a pytest-benchmark history (a JSON {type(data).__name__})")
    return data


def load_run(path: Path) -> Run:
    data = _read(path)
    try:
        return Run(
            paths=(path,),
            machine=_describe_machine(data.get("machine_info") or {}),
            commit=str((data.get("commit_info") or {}).get("id", "unknown")),
            datetime=str(data.get("datetime", "")),
            results=[_result(bench) for bench in data["benchmarks"]],
            out_of_memory=[(_module(entry["fullname"]), entry["name"]) for entry in data.get("out_of_memory", [])],
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ReportError(f"{path} is not a pytest-benchmark history ({type(exc).__name__}: {exc})") from None


def _module(fullname: str) -> str:
    return Path(fullname.split("::")[0]).stem  # "benches/bench_model.py::test_model[...]" -> "bench_model"


def _result(bench: dict) -> Result:
    params = {k: v for k, v in (bench.get("params") or {}).items()
              if not (isinstance(v, str) and v.startswith("UNSERIALIZABLE["))}
    stats = bench["stats"]
    return Result(module=_module(bench["fullname"]), test=bench["name"].split("[")[0], name=bench["name"],
                  fields={**params, **(bench.get("extra_info") or {})}, mean=float(stats["mean"]),
                  stddev=float(stats["stddev"]), min=float(stats["min"]), max=float(stats["max"]),
                  rounds=int(stats["rounds"]))


def _describe_machine(info: dict) -> str:
    lab = info.get("systems_lab") or {}
    device = lab.get("gpu") or (info.get("cpu") or {}).get("brand_raw") or info.get("machine", "unknown")
    count = lab.get("gpu_count") or 0
    device = f"{count}x {device}" if count > 1 else device
    return f"{device}, torch {lab['torch']}" if lab.get("torch") else device


def _parse(text: str | None):
    for kind in (int, float):
        try:
            return kind(text)
        except (TypeError, ValueError):
            pass
    return text


# ---------------------------------------------------------------------------------------------
# Formatting and grouping


def ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.4g}"


def ms_pm(result: Result) -> str:
    return f"{ms(result.mean)} ± {result.stddev * 1e3:.2g}"


def number(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.0f}"


def _order(value) -> tuple:
    """Sorts numbers before text, None last, within a column."""
    if value is None:
        return (2, 0, "")
    return (0, value, "") if isinstance(value, (int, float)) else (1, 0, str(value))


def pivot(results: Iterable[Result], keys: list[str], column: str, oom: Iterable[dict] = ()) -> dict[tuple, dict]:
    """{key values: {value of `column`: result, or "OOM"}}, sorted by key."""
    grid = defaultdict(dict)
    for r in results:
        grid[tuple(r.get(k) for k in keys)][r.get(column)] = r
    for point in oom:
        grid[tuple(point.get(k) for k in keys)].setdefault(point.get(column), "OOM")
    return {key: grid[key] for key in sorted(grid, key=lambda key: tuple(map(_order, key)))}


def _cell(entry, fmt: Callable[[Result], str]) -> str:
    if entry is None:
        return ""
    return entry if isinstance(entry, str) else fmt(entry)


def _sorted(results: Iterable[Result], keys: list[str]) -> list[Result]:
    return sorted(results, key=lambda r: tuple(_order(r.get(k)) for k in keys))


def _batch_sizes(results: list[Result], key: str = "batch_size") -> str:
    sizes = sorted({r.get(key) for r in results if r.get(key) is not None})
    return f", batch size {', '.join(map(str, sizes))}" if sizes else ""


# ---------------------------------------------------------------------------------------------
# One table per deliverable


def model_tables(run: Run) -> list[Table]:
    results = run.select("bench_model", "test_model")
    keys = ["preset", "context", "precision", "compile"]
    grid = pivot(results, keys, "phase", run.oom("bench_model", "test_model", MODEL_ID))
    if not grid:
        return []
    batch = _batch_sizes(results)
    phases = [p for p in MODEL_PHASES if any(p in row for row in grid.values())]
    timings = Table("model", f"Model: time per call{batch}, mean ± std (ms; OOM: out of memory)", keys + phases)
    for key, row in grid.items():
        timings.rows.append([number(k) for k in key] + [_cell(row.get(p), ms_pm) for p in phases])

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
                               + [_cell(row.get(p), lambda r: f"{r.get('peak_memory_mb'):,.0f}") for p in phases]
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
    results = _sorted(run.select("bench_model", "test_warmup_study"), ["warmup_steps"])
    if not results:
        return []
    table = Table("warmup", f"Warm-up study: forward+backward after n untimed steps{_batch_sizes(results)} (ms)",
                  ["warm-up steps", "preset", "context", "precision", "mean ± std", "min", "max", "rounds"])
    for r in results:
        table.rows.append([number(r.get(k)) for k in ("warmup_steps", "preset", "context", "precision")]
                          + [ms_pm(r), ms(r.min), ms(r.max), str(r.rounds)])
    return [table]


def attention_tables(run: Run) -> list[Table]:
    tables = []
    keys = ["impl", "d", "seq"]
    grid = pivot(run.select("bench_attention", "test_handout_sweep"), keys, "pass",
                 run.oom("bench_attention", "test_handout_sweep", ATTENTION_ID))
    if grid:
        table = Table("attention_handout", "Attention, batch 8, one head, no mask (ms; OOM: out of memory)",
                      keys + ["forward", "backward", "memory before backward (MiB)"])
        for key, row in grid.items():
            table.rows.append([number(k) for k in key] + [_cell(row.get("forward"), ms_pm),
                                                          _cell(row.get("backward"), ms_pm),
                                                          _cell(row.get("backward"),
                                                                lambda r: number(r.get("memory_before_backward_mb")))])
        tables.append(table)

    keys = ["precision", "d", "seq", "pass"]
    grid = pivot(run.select("bench_attention", "test_flash_sweep"), keys, "impl",
                 run.oom("bench_attention", "test_flash_sweep", ATTENTION_ID))
    if grid:
        impls = sorted({impl for row in grid.values() for impl in row})
        table = Table("attention_flash", "FlashAttention-2 vs PyTorch vs SDPA, batch 1, causal, mean (ms; "
                                         "OOM: out of memory)", keys + impls)
        for key, row in grid.items():
            table.rows.append([number(k) for k in key] + [_cell(row.get(impl), lambda r: ms(r.mean)) for impl in impls])
        tables.append(table)

    kernels = [r for r in run.select("bench_attention", "test_flash_sweep")
               if r.get("impl") == "triton" and r.get("sdpa_device_ms") is not None]
    if kernels:
        table = Table("attention_forward_kernels", "FlashAttention-2 forward kernels against SDPA's, timed in turns "
                                                   "(CUDA-graph replay, median ms)",
                      ["precision", "d", "seq", "triton", "sdpa", "vs SDPA"])
        for r in _sorted(kernels, ["precision", "d", "seq"]):
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
        for r in sorted(board, key=lambda r: (ATTENTION_PASSES.index(r.get("pass_", "forward")),
                                              r.get("first_seq") is not None)):
            table.rows.append([number(r.get("pass_")), number(r.get("first_seq") or 16384), ms(r.mean)]
                              + [number(r.get(k)) for k in ("do_bench_ms", "sdpa_do_bench_ms", "vs_sdpa")])
        tables.append(table)
    return tables


def allreduce_tables(run: Run) -> list[Table]:
    keys = ["backend", "world_size", "size_mb"]
    results = _sorted(run.select("bench_allreduce", "test_allreduce"), keys)
    oom = run.oom("bench_allreduce", "test_allreduce", ALLREDUCE_ID)
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


def ddp_tables(run: Run) -> list[Table]:
    results = run.select("bench_ddp", "test_ddp_step")
    oom = run.oom("bench_ddp", "test_ddp_step", DDP_ID)
    if not results and not oom:
        return []
    keys = ["precision", "context", "world_size", "variant", "bucket_size_mb"]
    rank = {variant: i for i, variant in enumerate(DDP_VARIANTS)}
    results = sorted(results, key=lambda r: tuple(_order(rank.get(r.get(k), r.get(k)) if k == "variant"
                                                         else r.get(k)) for k in keys))
    batch = _batch_sizes(results, "batch_size_per_rank")
    phases = ["step_s", "forward_s", "backward_s", "comm_wait_s", "optimizer_s"]
    steps = Table("ddp", f"Data-parallel training step{batch} per rank (ms; mean over ranks of their medians)",
                  ["precision", "context", "ranks", "variant", "bucket MiB", "step", "forward", "backward",
                   "comm wait", "optimizer", "comm share", "vs single", "vs torch DDP", "TFLOP/s per GPU"])
    for r in results:
        share = r.get("comm_share")
        steps.rows.append([number(r.get(k)) for k in keys] + [ms(r.get(p)) for p in phases]
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
                          + [ms(r.get(k)) for k in ("step_s", "backward_s", "comm_wait_s")] + [predicted, best])
    return [steps, sweep]


def _bucket_model(run: Run, step: Result) -> BucketedAllReduce | None:
    """The bucket model for a DDPBucketed point, from the same run's single-process and all-reduce points."""
    single = [r for r in run.select("bench_ddp", "test_ddp_step") if r.get("variant") == "single"
              and r.get("precision") == step.get("precision") and r.get("context") == step.get("context")]
    calls = [r for r in run.select("bench_allreduce", "test_allreduce")
             if r.get("backend") == step.get("backend") and r.get("world_size") == step.get("world_size")]
    if not single or len({r.get("bytes") for r in calls}) < 2:
        return None
    # time = latency + ring bytes / busbw: a least-squares line through (ring bytes, time).
    ring = 2 * (step.get("world_size") - 1) / step.get("world_size")
    xs, ys = [ring * r.get("bytes") for r in calls], [r.get("latency_s", r.get("time_s")) for r in calls]
    x_mean, y_mean = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys)) / sum((x - x_mean) ** 2 for x in xs)
    if slope <= 0:
        return None
    try:
        params = count_parameters(get_config(step.get("preset"), context_length=step.get("context")))
        gradient_bytes = get_precision(step.get("precision")).weights.itemsize  # bf16 with bf16-weights
    except (ValueError, TypeError):
        return None
    return BucketedAllReduce(backward_seconds=single[0].get("backward_s"), param_bytes=gradient_bytes * params,
                             world_size=step.get("world_size"), bandwidth=1 / slope,
                             latency=max(0.0, y_mean - slope * x_mean))


def optimizer_tables(run: Run) -> list[Table]:
    keys = ["world_size", "optimizer"]
    results = _sorted(run.select("bench_ddp", "test_optimizer_memory"), keys)
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
                          + [number(r.get(m)) for m in moments] + [ms(r.get("optimizer_s")), ms(r.get("step_s"))])
    return [table]


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
        table.rows = [[number(r.get(k)) for k in columns] + [ms_pm(r)] for r in _sorted(results, columns)]
        tables.append(table)
    return tables


def build_tables(run: Run) -> list[Table]:
    return (model_tables(run) + warmup_tables(run) + attention_tables(run) + allreduce_tables(run)
            + ddp_tables(run) + optimizer_tables(run) + other_tables(run))


# ---------------------------------------------------------------------------------------------
# Plots

Series = dict[str, list[tuple[float, float]]]  # label -> (x, y) points


def build_plots(run: Run, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    model = run.select("bench_model", "test_model")
    for phase in MODEL_PHASES:
        figures.append((f"model_{phase}", f"Model, {phase}", "context length", _panels(
            [r for r in model if r.get("phase") == phase], "context",
            lambda r: f"{r.get('preset')} {r.get('precision')} {r.get('compile')}",
            [("ms", lambda r: r.mean * 1e3), ("TFLOP/s", lambda r: r.get("tflops"))])))
    attention = (run.select("bench_attention", "test_handout_sweep")
                 + run.select("bench_attention", "test_flash_sweep"))
    for sweep, pass_, precision in sorted({(r.get("sweep"), r.get("pass"), r.get("precision")) for r in attention},
                                          key=str):
        # One column per head dim, time above TFLOP/s, one line per implementation: a whole grid in one line
        # per (implementation, d, precision) would be unreadable.
        points = [r for r in attention if (r.get("sweep"), r.get("pass"), r.get("precision")) == (sweep, pass_, precision)]
        dims = sorted({r.get("d") for r in points}, key=_order)
        panels = [panel for ylabel, y in (("ms", lambda r: r.mean * 1e3), ("TFLOP/s", lambda r: r.get("tflops")))
                  for d in dims
                  for panel in _panels([r for r in points if r.get("d") == d], "seq", lambda r: r.get("impl"),
                                       [(f"{ylabel}, d={d}", y)])]
        figures.append((f"attention_{sweep}_{pass_}_{precision}", f"Attention, {sweep} sweep, {pass_}, {precision}",
                        "sequence length", panels, len(dims)))
    figures.append(("allreduce_bandwidth", "All-reduce", "MiB", _panels(
        run.select("bench_allreduce", "test_allreduce"), "size_mb",
        lambda r: f"{r.get('backend')}, {r.get('world_size')} ranks",
        [("bus bandwidth (GB/s)", lambda r: r.get("busbw_gbps")), ("ms", lambda r: r.seconds * 1e3)])))
    figures.append(("ddp_buckets", "DDPBucketed step against bucket size", "bucket MiB", _panels(
        [r for r in run.select("bench_ddp", "test_ddp_step") if r.get("variant") == "bucketed"], "bucket_size_mb",
        lambda r: f"{r.get('precision')} context {r.get('context')}, {r.get('world_size')} ranks",
        [("step (ms)", lambda r: r.seconds * 1e3), ("comm wait (ms)", lambda r: ms_or_none(r.get("comm_wait_s")))])))
    return [path for figure in figures if (path := _plot(plt, out, *figure)) is not None]


def ms_or_none(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _panels(results: list[Result], x: str, label: Callable[[Result], str],
            panels: list[tuple[str, Callable[[Result], float | None]]]) -> list[tuple[str, Series]]:
    """For each (y label, y of a result): the points of each label's line; lines of one point are dropped."""
    out = []
    for ylabel, y in panels:
        series = defaultdict(list)
        for r in results:
            if isinstance(r.get(x), (int, float)) and y(r) is not None:
                series[label(r)].append((r.get(x), y(r)))
        out.append((ylabel, {name: sorted(points) for name, points in sorted(series.items()) if len(points) > 1}))
    return out


def _plot(plt, out: Path, name: str, title: str, xlabel: str, panels: list[tuple[str, Series]],
          columns: int | None = None) -> Path | None:
    """Panels in rows of `columns` (default: one row), log-log, one line per series, each series in one color
    throughout; nothing when no series has two points."""
    panels = [(ylabel, series) for ylabel, series in panels if series]
    if not panels:
        return None
    from matplotlib.ticker import FuncFormatter

    columns = min(columns or len(panels), len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4.5 * rows), squeeze=False)
    labels = sorted({label for _, series in panels for label in series})
    color = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    for ax, (ylabel, series) in zip(axes.flat, panels):
        for label, points in series.items():
            ax.plot(*zip(*points), marker="o", label=label, color=color[label])
        xs = sorted({x for points in series.values() for x, _ in points})
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel, xticks=xs)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            axis.set_minor_formatter(plt.NullFormatter())
        ax.tick_params(axis="x", labelrotation=45 if len(xs) > 6 else 0)
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    handles = {label: line for ax in axes.flat for line, label in zip(*ax.get_legend_handles_labels())}
    axes[0][0].legend([handles[label] for label in labels], labels, fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Comparing two runs


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


# ---------------------------------------------------------------------------------------------
# The command


def write_report(run: Run, out: Path, baseline: Run | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tables = build_tables(run) + ([comparison_table(run, baseline)] if baseline else [])
    plots = build_plots(run, out)
    sources = ", ".join(f"`{path}`" for path in run.paths)
    sections = [f"# Benchmark report: run {run.id}", "",
                f"{run.machine}; commit {run.commit}; {run.datetime}; from {sources}.", ""]
    if not run.results:
        sections += ["The run holds no benchmarks.", ""]
    for table in tables:
        (out / f"{table.name}.md").write_text(table.markdown())
        sections.append(table.markdown())
    sections += [f"![{path.stem}]({path.name})\n" for path in plots]
    report = out / "report.md"
    report.write_text("\n".join(sections))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m systems.report", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for report.md, the tables and the plots")
    parser.add_argument("--run", help="run number (3 or 0003), file-name prefix or path; default the latest "
                        "complete run. Several, e.g. 16-20,23, are merged, the later run winning where they share "
                        "a point")
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

