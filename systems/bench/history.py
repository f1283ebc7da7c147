"""Benchmark histories: saved whole and numbered safely, marked when the run stopped early, and the baseline
that the regression gate compares each point with.

pytest-benchmark saves a run as `<storage>/<machine>/NNNN_<tag>.json`, numbering it one past the highest file
there. `Histories` is the pytest plugin systems.bench.plugin registers to add what that lacks: two runs saving at
once get distinct numbers, a run that did not go through all its tests is saved as partial, and the gate
compares each point with the newest complete run of the same GPU kind that holds it.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from pytest_benchmark.storage.file import FileStorage
from pytest_benchmark.utils import RegressionCheck, safe_dumps

from systems.bench.workers import WORKER_STOPPED

COMPLETE = "systems_lab_complete"  # False in the history of a run that stopped early


def is_complete(history: dict) -> bool:
    """Whether a saved run went through all its tests; runs saved before this was recorded count as complete."""
    return history.get(COMPLETE, True) is not False


def saved_gpu(history: dict) -> str | None:
    """The GPU kind a saved run was timed on (None for a CPU run)."""
    return ((history.get("machine_info") or {}).get("systems_lab") or {}).get("gpu")


def latest_per_point(histories: Iterable[tuple[Path, dict]], gpu: str | None) -> dict[Path, dict[str, dict]]:
    """{history: {full name: benchmark}}: each point's result in the newest complete history timed on `gpu`
    that holds it, grouped by that history. `histories` come oldest first."""
    latest = {}
    for path, history in histories:
        if is_complete(history) and saved_gpu(history) == gpu:
            latest.update((bench["fullname"], (path, bench)) for bench in history["benchmarks"])
    grouped: dict[Path, dict[str, dict]] = {}
    for fullname, (path, bench) in latest.items():
        grouped.setdefault(path, {})[fullname] = bench
    return grouped


class LockedFileStorage(FileStorage):
    """pytest-benchmark's file storage, safe for runs that save into it at once.

    Numbering and writing happen under an exclusive lock on the machine folder. A history is written aside and
    then linked to its number, so readers never see half of one, and a link never replaces an existing file
    (one saved by a writer that does not take the lock). A run that stopped early gets a `_partial` suffix.
    """

    def save(self, output_json: dict, save: str) -> None:
        name = save if is_complete(output_json) else f"{save}_partial"
        text = safe_dumps(output_json, ensure_ascii=True, indent=4).encode()
        with open(self.get(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            path = self.get(f"{self._next_num}_{name}.json")
            with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as aside:
                aside.write(text)
            try:
                os.link(aside.name, path)
            finally:
                os.unlink(aside.name)
        self.logger.info(f"Saved benchmark data in: {path}")


class Histories:
    """The pytest plugin: safe saving, partial runs marked, and, with `gate`, the per-point baseline.

    pytest-benchmark compares with a single saved run; the gate hands it, instead, the newest result of each
    point, grouped by the run it comes from, so a point that the newest run lacks is still gated.
    """

    def __init__(self, gate: RegressionCheck | None = None, gpu: str | None = None):
        self.gate = gate
        self.gpu = gpu
        self.stopped = False

    def pytest_sessionstart(self, session) -> None:
        benchmarks = session.config._benchmarksession  # made by pytest-benchmark's pytest_configure
        if type(benchmarks.storage) is FileStorage:  # not Elasticsearch
            storage = benchmarks.storage
            benchmarks.storage = LockedFileStorage(storage.path, storage.logger, storage.default_machine_id)
        if self.gate is None:
            return
        baseline = latest_per_point(benchmarks.storage.load(), self.gpu)
        if baseline:
            benchmarks.compared_mapping = baseline
            benchmarks.compare_fail = [self.gate]
        else:
            print(f"benchmark gate: no complete baseline for {benchmarks.machine_id} on {self.gpu or 'CPU'} yet; "
                  "this run becomes it")

    def pytest_keyboard_interrupt(self) -> None:  # Ctrl-C, a collection error, pytest.exit
        self.stopped = True

    def pytest_benchmark_update_json(self, config, output_json: dict) -> None:
        session = config.pluginmanager.get_plugin("session")
        stopped = self.stopped or config.stash.get(WORKER_STOPPED, False)  # Ctrl-C, an xdist worker that crashed
        output_json[COMPLETE] = not (stopped or session.shouldfail or session.shouldstop)  # -x, --maxfail
