"""Benchmarks under `pytest -n N`: each worker times its points on the GPUs it leases, and the controller
gathers every worker's points into one session, so one history is saved, compared and gated as a serial run's.

pytest-benchmark switches itself off under xdist: parallel workers would disturb each other's timings. On a
GPU host they do not, as long as each point holds its GPUs alone (systems.bench.leases): this plugin switches
it back on in the workers, which then save nothing themselves, and hands their results to the controller
through xdist's `workeroutput`. Without GPUs, `-n` with benchmarks is refused before any runs, unless
--benchmark-disable. The controller also hands the work out in units, longest first (systems.bench.schedule).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from pytest_benchmark.stats import Metadata
from pytest_benchmark.utils import safe_dumps

from systems.bench import schedule
from systems.bench.leases import lease_size
from systems.bench.oom import OUT_OF_MEMORY

# A worker's workeroutput: its benchmarks, its out-of-memory points, and whether it stopped early.
RESULTS, OOM, STOPPED = "systems_lab_benchmarks", "systems_lab_out_of_memory", "systems_lab_stopped"
WORKER_STOPPED = pytest.StashKey[bool]()  # on the controller: a worker crashed or stopped early
SHARED = "systems-lab"  # the folder the workers of a run share, beside their temporary folders


def benchmarks_enabled(config) -> bool:
    return not (config.getoption("benchmark_disable") and not config.getoption("benchmark_enable"))


class Worker:
    """An xdist worker's side: benchmarks on, nothing saved or compared here, results sent to the controller."""

    def __init__(self, config, gpus: int):
        self.config, self.gpus = config, gpus
        self.shared = Path(config.option.basetemp).parent / SHARED
        self.shared.mkdir(exist_ok=True)

    def pytest_collection_modifyitems(self, items) -> None:
        # Tell the controller before it hears that collection finished (which it checks; see Controller).
        worker = self.config.workerinput["workerid"]
        if any("benchmark" in getattr(item, "fixturenames", ()) for item in items):
            (self.shared / f"benchmarks-{worker}").touch()
        if self.gpus > 1:
            schedule.hold_every_gpu_together(items, lambda item: lease_size(item, self.gpus) == self.gpus)
        schedule.write_groups(self.shared, worker, items)

    def pytest_sessionstart(self, session) -> None:
        benchmarks = self.config._benchmarksession  # made by pytest-benchmark's (trylast) pytest_configure
        if self.gpus and benchmarks_enabled(self.config):
            benchmarks.disabled = benchmarks.xdist_warning = False
        benchmarks.save = benchmarks.autosave = benchmarks.json = benchmarks.compare_fail = None

    def pytest_sessionfinish(self, session) -> None:
        benchmarks = self.config._benchmarksession.benchmarks
        records = [bench.as_dict(include_data=True) for bench in benchmarks if bench and not bench.has_error]
        # What execnet can send: JSON, as pytest-benchmark would save it (unserializable params named).
        self.config.workeroutput[RESULTS] = json.loads(safe_dumps(records))
        self.config.workeroutput[OOM] = self.config.stash.get(OUT_OF_MEMORY, [])
        self.config.workeroutput[STOPPED] = bool(session.shouldfail or session.shouldstop)


class Controller:
    """The controller's side: refuse CPU timings in parallel; hand out units of work; gather the workers' benchmarks
    in collection order."""

    def __init__(self, config, gpus: int):
        self.config, self.gpus = config, gpus
        self.order: dict[str, int] = {}  # node id -> position in collection order
        config.stash[WORKER_STOPPED] = False

    @property
    def shared(self) -> Path:
        return self.config._tmp_path_factory.getbasetemp() / SHARED  # beside the workers' folders, which are in it

    def groups(self) -> dict[str, str]:
        return schedule.read_groups(self.shared)

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_xdist_make_scheduler(self, config, log):
        """`-n`'s default mode (load): units whole, longest first (systems.bench.schedule)."""
        return schedule.UnitScheduling(config, log, self.shared) if config.getoption("dist") == "load" else None

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        self.order = self.order or {nodeid: i for i, nodeid in enumerate(ids)}
        collected = self.shared / f"benchmarks-{node.gateway.id}"
        if collected.exists() and not self.gpus and benchmarks_enabled(self.config):
            pytest.exit("benchmarks under -n need GPUs, each point timed on its own: on the CPU, parallel workers "
                        "would time each other (run them without -n, or pass --benchmark-disable)",
                        returncode=pytest.ExitCode.USAGE_ERROR)

    def pytest_sessionstart(self, session) -> None:
        if self.gpus and benchmarks_enabled(self.config):
            benchmarks = self.config._benchmarksession
            benchmarks.disabled = benchmarks.xdist_warning = False

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        output = getattr(node, "workeroutput", {})
        self.config.stash[WORKER_STOPPED] |= error is not None or output.get(STOPPED, True)
        benchmarks = self.config._benchmarksession.benchmarks
        benchmarks += map(_metadata, output.get(RESULTS, []))
        benchmarks.sort(key=lambda bench: self.order.get(bench.fullname, len(self.order)))
        self.config.stash.setdefault(OUT_OF_MEMORY, []).extend(output.get(OOM, []))


def _metadata(record: dict) -> Metadata:
    """A worker's benchmark as pytest-benchmark's own record of it, its rounds as the worker timed them."""
    fixture = SimpleNamespace(name=record["name"], fullname=record["fullname"], group=record["group"],
                              param=record["param"], params=record["params"], extra_info=record["extra_info"],
                              cprofile_stats=None, has_error=False)
    stats = record["stats"]
    metadata = Metadata(fixture, iterations=stats["iterations"], options=record["options"])
    for seconds in stats["data"]:  # each already per iteration
        metadata.stats.update(seconds)
    return metadata
