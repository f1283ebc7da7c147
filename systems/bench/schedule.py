"""The order of work under `pytest -n`: units whole to one worker, the longest first, so that no worker ends the
run alone.

A unit is an xdist group (`pytest.mark.xdist_group`: the tests of one spawned process group, the benchmark points of
one model at one context; on a host of several GPUs, the items that hold them all), which one worker runs whole, or
else one item. The workers order the items by their units' seconds as earlier runs recorded them, longest first, an
ungrouped item's unit there being its module (so a module's items stay together); where nothing is recorded, units
holding a slow test come first. Recorded means in pytest's cache, else in the committed `durations.json` beside this
module (for the model grid: each point's warm-up and rounds at the medians of the serial grid's history 0082 on 4 x
H200, until `--save` copies a run's seconds over them), for a fresh clone and for runs without the cache (the GPU
jobs' grids), which would otherwise hand out their longest units last. `UnitScheduling` hands the units out in that
order (xdist's own `loadgroup` orders groups by their number of tests, and pytest 9 drops the node ids it marks).
Under xdist the summary shows each worker's items, busy seconds and span, so that a run's start-up and idle ends
show.

`python -m systems.bench.schedule -n 8` predicts a run's wall time from the recorded seconds; `--save PATH...`
copies the cache's seconds of the items under those paths into the committed file.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

CACHE_KEY = "systems-lab/durations"  # {node id: [seconds, the unit UnitScheduling hands it out in]}
COMMITTED = Path(__file__).with_name("durations.json")  # the same, as `--save` copied it from a run's cache
GROUPS = "groups-*.json"  # in the workers' shared folder, one per worker: {node id: xdist group}


def group_of(item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    if marker is None:
        return None
    return str(marker.args[0] if marker.args else marker.kwargs.get("name", "default"))


EVERY_GPU = "every-gpu"  # the unit of the items that hold all of a host's GPUs


def hold_every_gpu_together(items: list, holds_every_gpu: Callable[[object], bool]) -> None:
    """Make the items that hold every GPU of the host one unit, run back to back by one worker: handed out to
    several workers (they are among the longest), each would wait in its lease for the others', idle where it
    could run what needs no GPU."""
    for item in items:
        if holds_every_gpu(item):
            item.add_marker(pytest.mark.xdist_group(EVERY_GPU), append=False)  # over a spawned group's own


def unit_of(item) -> str:
    """What an item's seconds count towards: its xdist group, else its module."""
    return group_of(item) or item.nodeid.split("::")[0]


def longest_first(items: list, seconds: dict[str, float]) -> list:
    """The items, units longest first (recorded seconds, then holding a slow test), each unit in its order."""
    units = defaultdict(list)
    for item in items:
        units[unit_of(item)].append(item)

    def weight(unit: list) -> tuple:
        recorded = sum(seconds.get(item.nodeid, 0.0) for item in unit)
        return -recorded, not any(item.get_closest_marker("slow") for item in unit)

    return [item for unit in sorted(units.values(), key=weight) for item in unit]  # stable: ties keep their order


def write_groups(shared: Path, worker: str, items: list) -> None:
    """A worker's items' groups, for the controller's scheduler (before the controller hears collection ended)."""
    path = shared / GROUPS.replace("*", worker)
    path.with_suffix(".tmp").write_text(json.dumps({item.nodeid: group for item in items
                                                    if (group := group_of(item)) is not None}))
    os.replace(path.with_suffix(".tmp"), path)


def read_groups(shared: Path) -> dict[str, str]:
    paths = sorted(shared.glob(GROUPS))
    return json.loads(paths[0].read_text()) if paths else {}  # every worker collected the same items


class UnitScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with an item's xdist group, or the item alone, as its scope, handed out in the
    order the workers collected (longest first)."""

    def __init__(self, config, log, shared: Path):
        config.option.loadscopereorder = False  # keep the workers' order, not xdist's by number of tests
        super().__init__(config, log)
        self.shared, self.groups = shared, None

    def _split_scope(self, nodeid: str) -> str:
        if self.groups is None:  # called once every worker has collected
            self.groups = read_groups(self.shared)
        return self.groups.get(nodeid, nodeid)


def cached(config) -> dict[str, list]:
    """{node id: [seconds, unit]} as this checkout's earlier runs recorded them; empty under -p no:cacheprovider."""
    cache = getattr(config, "cache", None)
    return cache.get(CACHE_KEY, {}) if cache is not None else {}


def committed() -> dict[str, list]:
    """{node id: [seconds, unit]} as the committed file holds them; empty where there is none."""
    return json.loads(COMMITTED.read_text()) if COMMITTED.exists() else {}


def recorded(cache: dict[str, list]) -> dict[str, list]:
    """{node id: [seconds, unit]}: this checkout's cache, else the committed file."""
    return {**committed(), **cache}


def seconds_by_item(config) -> dict[str, float]:
    return {nodeid: seconds for nodeid, (seconds, _) in recorded(cached(config)).items()}


class Durations:
    """Records each item's seconds (setup, call and teardown) and unit into pytest's cache at the end of a run:
    a serial run, or xdist's controller, which hears every worker's reports and reads their groups. Under xdist,
    also each worker's items, from the reports' clocks."""

    def __init__(self, config, groups: Callable[[], dict[str, str]]):
        self.config, self.groups = config, groups  # the workers' groups, under xdist
        self.seconds: dict[str, float] = defaultdict(float)
        self.units: dict[str, str] = {}
        self.started = time.time()  # the run's start, on the clock of the reports' start and stop
        self.workers: dict[str, WorkerSpan] = {}

    def pytest_collection_modifyitems(self, items) -> None:  # serial runs only: a controller collects nothing
        self.units = {item.nodeid: group_of(item) or item.nodeid for item in items}

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[report.nodeid] += report.duration
        node = getattr(report, "node", None)  # the worker that ran it, under xdist
        if node is not None:
            span = self.workers.setdefault(node.gateway.id, WorkerSpan(report.start, report.stop))
            span.add(report)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.workers:
            terminalreporter.section("workers")
            for worker, span in sorted(self.workers.items(), key=lambda pair: int(pair[0].removeprefix("gw"))):
                terminalreporter.line(f"{worker}: {span.describe(self.started)}")

    def pytest_sessionfinish(self) -> None:
        cache = getattr(self.config, "cache", None)
        if cache is None or not self.seconds:
            return
        groups = self.groups()
        units = {nodeid: self.units.get(nodeid) or groups.get(nodeid) or nodeid for nodeid in self.seconds}
        cache.set(CACHE_KEY, {**cached(self.config),
                              **{nodeid: [seconds, units[nodeid]] for nodeid, seconds in self.seconds.items()}})


class WorkerSpan:
    """What one worker ran: its items, their seconds, and when its first began and its last ended."""

    def __init__(self, start: float, stop: float):
        self.items, self.busy, self.start, self.stop = set(), 0.0, start, stop

    def add(self, report) -> None:
        self.items.add(report.nodeid)
        self.busy += report.duration
        self.start, self.stop = min(self.start, report.start), max(self.stop, report.stop)

    def describe(self, started: float) -> str:
        """Its span in seconds from `started` (the run's start): the worker's start-up before it, idle after."""
        return (f"{len(self.items)} items, {self.busy:.1f} s busy, from {self.start - started:.1f} s "
                f"to {self.stop - started:.1f} s")


def predict(seconds: list[float], workers: int) -> float:
    """Wall seconds of units lasting `seconds` on `workers` workers, each unit given to the first free worker in
    order: with the units longest first, the longest-processing-time rule."""
    free = [0.0] * workers
    for duration in seconds:
        heapq.heapreplace(free, free[0] + duration)
    return max(free)


def save(cache: dict[str, list], paths: list[str]) -> int:
    """Copy the cache's seconds of the items under `paths` (node id prefixes) into the committed file, over what
    it held for them; the number copied."""
    chosen = {nodeid: [round(seconds, 2), unit] for nodeid, (seconds, unit) in cache.items()
              if nodeid.startswith(tuple(paths))}
    merged = sorted({**committed(), **chosen}.items())
    lines = [f"{json.dumps(nodeid)}: {json.dumps(entry)}" for nodeid, entry in merged]
    COMMITTED.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # an item a line: diffs show what changed
    return len(chosen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m systems.bench.schedule", description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("-n", type=int, help="predict the wall time of this many workers")
    what.add_argument("--save", nargs="+", metavar="PATH", help=f"copy the cache's seconds of the items under "
                      f"these paths (node id prefixes: benches/bench_model.py) into {COMMITTED.name}")
    parser.add_argument("--cache", type=Path, default=Path(".pytest_cache"), help="pytest's cache folder")
    parser.add_argument("paths", nargs="*", metavar="PATH", help="with -n, only the items under these paths "
                        "(node id prefixes: tests/); default every item recorded")
    args = parser.parse_args(argv)
    path = args.cache / "v" / CACHE_KEY
    cache = json.loads(path.read_text()) if path.exists() else {}
    if args.save:
        print(f"schedule: {save(cache, args.save)} items' seconds from {path} saved in {COMMITTED}")
        return 0
    if not cache and not COMMITTED.exists():
        print(f"schedule: no durations recorded in {path} nor {COMMITTED}; run pytest once first", file=sys.stderr)
        return 2
    units = defaultdict(float)
    for nodeid, (duration, unit) in recorded(cache).items():
        if nodeid.startswith(tuple(args.paths or [""])):
            units[unit] += duration
    if not units:
        print(f"schedule: no item recorded under {' '.join(args.paths)}", file=sys.stderr)
        return 2
    wall = predict(sorted(units.values(), reverse=True), args.n)
    print(f"{len(units)} units, {sum(units.values()):.0f} s of items: predicted wall time on {args.n} workers "
          f"{wall:.0f} s (the longest unit {max(units.values()):.0f} s); items only: not start-up, collection or "
          "waits for GPUs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
