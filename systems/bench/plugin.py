"""systems-lab's pytest plugin: the benchmark grids' options, GPU markers and leases, the host shared between
xdist workers and the order of their work, saved histories and the regression gate (and the baton its runs pass),
out-of-memory records, and benchmarks under `-n`.

Installing the package registers it (a `pytest11` entry point), so any project's pytest has it; a checkout that
is not installed loads it from its root conftest.py (`pytest_plugins`), and an inner pytest run with
`-p systems.bench.plugin`.
"""

from __future__ import annotations

from systems.bench.leases import share_host_with_other_workers

share_host_with_other_workers()  # before torch is imported, here or anywhere: it sizes its thread pools once

import os  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from systems.bench import baton, gate, options, schedule, tiers  # noqa: E402
from systems.bench.leases import GpuLocks, available_cores, host_lease, lease_size, visible_gpus  # noqa: E402
from systems.bench.oom import OUT_OF_MEMORY, OutOfMemoryGuard  # noqa: E402
from systems.bench.schema import SCHEMA  # noqa: E402
from systems.bench.timing import device_info  # noqa: E402
from systems.bench.workers import Controller, Worker, benchmarks_enabled  # noqa: E402

HARDWARE_MARKERS = ("gpu", "multigpu")
NEEDS_GPUS = ("systems-lab", "needs GPUs")  # a user property of an item marked gpu or multigpu


def pytest_addoption(parser) -> None:
    options.add_options(parser)
    gate.add_options(parser)
    tiers.add_options(parser)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "multigpu(n): needs at least n CUDA GPUs, which it holds while it runs")
    tiers.configure(config)
    options.configure_grid(config)
    gpus = torch.cuda.device_count()
    if gpus and benchmarks_enabled(config):  # benchmarks under -n run on GPUs: pytest-benchmark's word is moot
        config.addinivalue_line("filterwarnings", "ignore:Benchmarks are automatically disabled because xdist")
    if hasattr(config, "workerinput"):
        torch.set_num_threads(available_cores())  # the share share_host_with_other_workers gave this worker
        worker = Worker(config, gpus)
        config.pluginmanager.register(worker, "systems-lab-worker")
        if gpus:
            torch.cuda.init()  # with every GPU visible: a lease narrows CUDA_VISIBLE_DEVICES for children only
        locks = GpuLocks(worker.shared, visible_gpus()) if gpus else None
        config.pluginmanager.register(Leases(worker.shared, locks, gpus), "systems-lab-leases")
        return
    controller = Controller(config, gpus) if config.getoption("dist", "no") != "no" else None
    if controller is not None:
        config.pluginmanager.register(controller, "systems-lab-controller")
    config.pluginmanager.register(schedule.Durations(config, controller.groups if controller else dict),
                                  "systems-lab-durations")
    gate.configure(config)


class Leases:
    """In an xdist worker: each item holds the host (shared, or alone for the timing tier) and the GPUs it runs
    on (systems.bench.leases)."""

    def __init__(self, shared: Path, locks: GpuLocks | None, gpus: int):
        self.shared, self.locks, self.gpus = shared, locks, gpus

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item):
        with host_lease(self.shared, alone=tiers.tier_of(item) in tiers.ALONE):
            n = lease_size(item, self.gpus)
            if n == 0 or n > self.gpus:  # nothing to hold, or skipped for want of GPUs
                return (yield)
            with self.locks.lease(n):
                return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtestloop(session):
    baton.begin_from_env()  # a turn's run that --benchmark-gate-against started: wait for the baton
    try:
        return (yield)
    finally:
        baton.end()  # the other run's last rounds need not wait for this run's history and exit


def pytest_collection_modifyitems(config, items) -> None:
    items[:] = tiers.select(config, items)
    gpus = torch.cuda.device_count()  # the host's: an xdist worker sees every GPU
    for item in items:
        if any(item.get_closest_marker(name) for name in HARDWARE_MARKERS):
            item.user_properties.append(NEEDS_GPUS)  # for the summary, which sees reports only
        if item.get_closest_marker("gpu") and gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        marker = item.get_closest_marker("multigpu")
        if marker and gpus < marker.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"needs {marker.args[0]} GPUs, this machine has {gpus}"))
    if "PYTEST_XDIST_WORKER" in os.environ:  # the longest start first, so that they do not end the run alone
        items[:] = schedule.longest_first(items, schedule.seconds_by_item(config))


def pytest_terminal_summary(terminalreporter, config) -> None:
    """Which tiers and GPU tests ran, and why the others could not: a skip here is not a pass."""
    if line := tiers.summary_line(config):
        terminalreporter.section("test tiers")
        terminalreporter.line(line)
    reports = [report for reports in terminalreporter.stats.values() for report in reports
               if isinstance(report, pytest.TestReport) and NEEDS_GPUS in report.user_properties]
    ran = sum(report.when == "call" and not report.skipped for report in reports)
    not_run = defaultdict(list)  # reason: node ids
    for report in reports:
        if report.skipped:
            not_run[report.longrepr[2].removeprefix("Skipped: ")].append(report.nodeid)
    if ran or not_run:
        terminalreporter.section("GPU tests")
        terminalreporter.line(f"{ran} ran, {sum(map(len, not_run.values()))} could not run")
        for reason, nodeids in not_run.items():
            files = sorted({nodeid.split("::")[0] for nodeid in nodeids})
            terminalreporter.line(f"  {len(nodeids)} {reason}: {', '.join(files)}")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """This worker's GPU (its home, leased while an item runs: systems.bench.leases), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def grid(request) -> options.Grid:
    """The grid options, parsed and checked."""
    return options.grid_of(request.config)


@pytest.fixture(scope="module")
def rank_pools():
    """Spawned process groups kept for a whole module, one per (world size, backend, GPUs): the distributed
    benchmarks pay for spawning and rendezvous once, not per point."""
    from systems.parallel.ranks import RankPools

    with RankPools(timeout=600) as pools:
        yield pools


@pytest.fixture
def skip_on_oom(request) -> OutOfMemoryGuard:
    """`with skip_on_oom:` turns a CUDA out-of-memory error into a recorded skip."""
    return OutOfMemoryGuard(request)


def pytest_benchmark_update_machine_info(config, machine_info) -> None:
    machine_info["systems_lab"] = device_info()


def pytest_benchmark_update_commit_info(config, commit_info) -> None:
    """A checkout copied without its history (a GPU job's working tree) names its commit in SYSTEMS_LAB_COMMIT."""
    if os.environ.get("SYSTEMS_LAB_COMMIT"):
        commit_info.update(id=os.environ["SYSTEMS_LAB_COMMIT"], dirty=False)


def pytest_benchmark_update_json(config, benchmarks, output_json) -> None:
    output_json["systems_lab_schema"] = SCHEMA
    output_json["out_of_memory"] = config.stash.get(OUT_OF_MEMORY, [])
