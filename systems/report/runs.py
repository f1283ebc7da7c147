"""Saved runs: finding them in the storage, loading them into results, merging runs saved in chunks. Every result
and out-of-memory point keeps its source (the run, its commit, the GPU kind and count that measured it), so that
runs of several machines merge without one machine's point standing for another's."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from systems.bench.history import is_complete
from systems.bench.schema import (MEASURED, POINT, Measured, Point, SchemaError, check_schema, read_measured,
                                  read_point)

RUN_RANGE = re.compile(r"(?P<first>\d+)-(?P<last>\d+)")  # --run 16-20
GPU_MEMORY = re.compile(r"\d+GB")  # where a GPU's name turns from its kind to its variant: "H100 80GB HBM3"


class ReportError(Exception):
    """A problem with the history, reported as one line."""


@dataclass(frozen=True)
class Source:
    """What measured a figure: the tables and plots name it beside the figure."""
    run: str  # the history's number, "0073"
    commit: str
    machine: str  # the GPU kind and count, "2 x H200", or "CPU"


@dataclass(frozen=True)
class OutOfMemory:
    """A point that ran out of memory, and where."""
    point: Point
    source: Source


@dataclass(frozen=True)
class Result:
    name: str  # the test id: "test_model[tiny-2025-b4-ctx128-fp32-sdpa-eager-forward]"
    point: Point | None  # None for a benchmark of another project's, saved without a point
    measured: Measured | None
    fields: dict  # such a benchmark's serializable params and extra_info, for its table
    mean: float  # seconds, over pytest-benchmark's rounds
    stddev: float
    min: float
    max: float
    rounds: int
    source: Source

    @property
    def seconds(self) -> float | None:
        """The figure runs are compared by: the kind's headline time (systems.bench.schema.Measured.seconds)."""
        return self.mean if self.measured is None else self.measured.seconds(self.mean)

    @property
    def test(self) -> str:
        return self.name.split("[")[0]


@dataclass(frozen=True)
class Run:
    paths: tuple[Path, ...]  # one history, or several merged (merge_runs)
    sources: tuple[Source, ...]  # each history's
    machine: str  # what ran it, e.g. "NVIDIA H100 80GB HBM3, torch 2.11.0"
    commit: str
    datetime: str
    results: list[Result]
    out_of_memory: list[OutOfMemory]

    @property
    def id(self) -> str:
        """The run's number, or the merged runs' as ranges: 0016-0020+0023-0029+0032."""
        return "+".join(run_spans(path.stem.split("_")[0] for path in self.paths))

    def select(self, kind: str, **fields) -> list[Result]:
        """The results of a point kind whose points have these field values."""
        return [r for r in self.results if r.point is not None and r.point.kind == kind
                and all(getattr(r.point, field) == value for field, value in fields.items())]

    def oom(self, kind: str, **fields) -> list[OutOfMemory]:
        """The points of a kind that ran out of memory."""
        return [oom for oom in self.out_of_memory if oom.point.kind == kind
                and all(getattr(oom.point, field) == value for field, value in fields.items())]

    @property
    def machines(self) -> list[str]:
        """The machines that measured the run's points, in the order they first come."""
        return list(dict.fromkeys(entry.source.machine for entry in [*self.results, *self.out_of_memory]))

    def on(self, machine: str) -> Run:
        """The run's results and out-of-memory points measured on `machine`."""
        return dataclasses.replace(self, results=[r for r in self.results if r.source.machine == machine],
                                   out_of_memory=[oom for oom in self.out_of_memory if oom.source.machine == machine])


def run_spans(numbers: Iterable[str]) -> list[str]:
    """Run numbers, consecutive ones as a range: 0016-0020, 0023."""
    spans = []
    for number in numbers:
        if spans and number.isdigit() and spans[-1][-1].isdigit() and int(number) == int(spans[-1][-1]) + 1:
            spans[-1].append(number)
        else:
            spans.append([number])
    return [span[0] if len(span) == 1 else f"{span[0]}-{span[-1]}" for span in spans]


def named_runs(numbers: Iterable[str]) -> str:
    """The runs a figure comes from, as its title or legend names them: "run 0073", "runs 0016-0020, 0023"."""
    numbers = sorted(set(numbers))
    return f"run{'s' * (len(numbers) > 1)} {', '.join(run_spans(numbers))}"


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
    """One run of several, e.g. a sweep saved in chunks: where runs of one machine share a point, the later one's
    result (or its out-of-memory) wins; another machine's keeps its own."""
    if len(runs) == 1:
        return runs[0]
    points: dict[tuple[str, str], Result | OutOfMemory] = {}
    for run in runs:
        points.update(((result.source.machine, result.name), result) for result in run.results)
        points.update(((oom.source.machine, f"{oom.point.kind}[{oom.point}]"), oom) for oom in run.out_of_memory)
    return Run(paths=tuple(path for run in runs for path in run.paths),
               sources=tuple(source for run in runs for source in run.sources),
               machine=_distinct(run.machine for run in runs), commit=_distinct(run.commit for run in runs),
               datetime=f"{runs[0].datetime} to {runs[-1].datetime}",
               results=[point for point in points.values() if isinstance(point, Result)],
               out_of_memory=[point for point in points.values() if isinstance(point, OutOfMemory)])


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
        check_schema(data)
        machine_info = data.get("machine_info") or {}
        commit = str((data.get("commit_info") or {}).get("id", "unknown"))
        source = Source(path.stem.split("_")[0], commit, machine_label(machine_info))
        return Run(
            paths=(path,),
            sources=(source,),
            machine=_describe_machine(machine_info),
            commit=commit,
            datetime=str(data.get("datetime", "")),
            results=[_result(bench, source) for bench in data["benchmarks"]],
            out_of_memory=[OutOfMemory(read_point(entry[POINT]), source) for entry in data.get("out_of_memory", [])],
        )
    except SchemaError as exc:
        raise ReportError(f"{path}: {exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ReportError(f"{path} is not a pytest-benchmark history ({type(exc).__name__}: {exc})") from None


def _result(bench: dict, source: Source) -> Result:
    extra_info = bench.get("extra_info") or {}
    point = read_point(extra_info[POINT]) if POINT in extra_info else None
    if point is not None and MEASURED not in extra_info:
        raise SchemaError(f"{bench['name']}: a point without its measurements")
    measured = read_measured(point, extra_info[MEASURED]) if point is not None else None
    params = {k: v for k, v in (bench.get("params") or {}).items()
              if not (isinstance(v, str) and v.startswith("UNSERIALIZABLE["))}
    stats = bench["stats"]
    return Result(name=bench["name"], point=point, measured=measured, fields={**params, **extra_info},
                  mean=float(stats["mean"]), stddev=float(stats["stddev"]), min=float(stats["min"]),
                  max=float(stats["max"]), rounds=int(stats["rounds"]), source=source)


def machine_label(info: dict) -> str:
    """The GPU kind and count a run was measured on, short: "2 x H200" ("NVIDIA H200" on a 2-GPU host), "CPU"."""
    lab = info.get("systems_lab") or {}
    if not lab.get("gpu"):
        return "CPU"
    words = lab["gpu"].removeprefix("NVIDIA ").split()
    kind = " ".join(itertools.takewhile(lambda word: not GPU_MEMORY.fullmatch(word), words)) or lab["gpu"]
    return f"{lab.get('gpu_count') or 1} x {kind}"


def _describe_machine(info: dict) -> str:
    lab = info.get("systems_lab") or {}
    device = lab.get("gpu") or (info.get("cpu") or {}).get("brand_raw") or info.get("machine", "unknown")
    count = lab.get("gpu_count") or 0
    device = f"{count}x {device}" if count > 1 else device
    return f"{device}, torch {lab['torch']}" if lab.get("torch") else device
