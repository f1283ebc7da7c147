"""Benchmark histories: saved whole and numbered safely, marked when the run stopped early, read strictly, and the
baselines that `--benchmark-compare` and the regression gate compare each point with.

pytest-benchmark saves a run as `<storage>/<machine>/NNNN_<tag>.json`, numbering it one past the highest file
there, and reads its saved runs leniently: a file it cannot read is a warning and is skipped, so a corrupted
history silently leaves a gate with nothing to compare. `Histories`, the pytest plugin systems.bench.plugin
registers, adds what that lacks: two runs saving at once get distinct numbers; a run that did not go through all
its tests, or was interrupted inside a point, is saved as partial with the points it finished; a history that
cannot be read (not JSON, another shape, another schema) stops the run before anything is timed, naming the file
and why, so nothing is saved over it; `--benchmark-compare` without a run compares with the newest complete run,
never a partial one; and the gate compares each point with the newest complete run of the same GPU kind that
holds it.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from pytest_benchmark.storage.file import FileStorage
from pytest_benchmark.utils import safe_dumps

from systems.bench.schema import SchemaError, check_schema
from systems.bench.workers import WORKER_STOPPED

COMPLETE = "systems_lab_complete"  # False in the history of a run that stopped early
NUMBERS = ("min", "max", "mean", "stddev", "rounds", "median")  # the statistics a comparison reads


class HistoryError(Exception):
    """A saved history that cannot be read: the message names the file and why."""


def is_complete(history: dict) -> bool:
    """Whether a saved run went through all its tests; runs saved before this was recorded count as complete."""
    return history.get(COMPLETE, True) is not False


def saved_gpu(history: dict) -> str | None:
    """The GPU kind a saved run was timed on (None for a CPU run)."""
    return ((history.get("machine_info") or {}).get("systems_lab") or {}).get("gpu")


def check_history(path: Path, history) -> dict:
    """The history if it is one this code can compare with, else a HistoryError saying why."""
    def bad(why: str) -> HistoryError:
        return HistoryError(f"{path}: {why}")

    if not isinstance(history, dict) or not isinstance(history.get("benchmarks"), list):
        raise bad("not a pytest-benchmark history (no list of benchmarks)")
    try:
        check_schema(history)
    except SchemaError as exc:
        raise bad(str(exc)) from None
    for index, bench in enumerate(history["benchmarks"]):
        if not isinstance(bench, dict) or not isinstance(bench.get("fullname"), str):
            raise bad(f"benchmark {index} has no fullname")
        stats = bench.get("stats")
        if not isinstance(stats, dict) or any(not isinstance(stats.get(key), (int, float)) for key in NUMBERS):
            raise bad(f"{bench['fullname']}: its stats lack {', '.join(NUMBERS)}")
    return history


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
    """pytest-benchmark's file storage, safe for runs that save into it at once, strict in what it reads.

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

    def load(self, *globs_or_files) -> Iterator[tuple[Path, dict]]:
        """Every history the globs select, oldest first; one that cannot be read is a HistoryError."""
        for path in self.query(*globs_or_files or ("[0-9][0-9][0-9][0-9]_",)):
            try:
                history = json.loads(path.read_text(encoding="utf8"))
            except (OSError, ValueError) as exc:
                raise HistoryError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from None
            yield path, check_history(path, history)


class Histories:
    """The pytest plugin: safe and strict storage, partial runs marked, and `--benchmark-compare`'s baseline."""

    def __init__(self, config):
        self.stopped = False
        # pytest-benchmark would load what --benchmark-compare names, leniently, in its own pytest_configure (which
        # runs after this plugin's): this plugin loads it instead, once the storage is strict.
        self.compare = config.option.benchmark_compare
        config.option.benchmark_compare = None

    def pytest_sessionstart(self, session) -> None:
        benchmarks = session.config._benchmarksession  # made by pytest-benchmark's pytest_configure
        if type(benchmarks.storage) is not FileStorage:  # Elasticsearch: as pytest-benchmark keeps it
            return
        old = benchmarks.storage
        benchmarks.storage = LockedFileStorage(old.path, old.logger, old.default_machine_id)
        try:
            if self.compare:
                benchmarks.compared_mapping = self.compared(benchmarks.storage)
        except HistoryError as exc:
            pytest.exit(f"benchmark history: {exc}", returncode=pytest.ExitCode.USAGE_ERROR)

    def compared(self, storage: LockedFileStorage) -> dict[Path, dict[str, dict]]:
        """--benchmark-compare's runs: those it names (partial ones too), else the newest complete one."""
        if self.compare is True:
            complete = [(path, history) for path, history in storage.load() if is_complete(history)]
            if not complete:
                raise HistoryError(f"{storage.path}: no complete run to compare with (--benchmark-compare)")
            chosen = complete[-1:]
        else:
            chosen = list(storage.load(self.compare))
            if not chosen:
                raise HistoryError(f"{storage.path}: no saved run matches --benchmark-compare={self.compare}")
        print(f"benchmark compare: against {', '.join(str(path) for path, _ in chosen)}")
        return {path: {bench["fullname"]: bench for bench in history["benchmarks"]} for path, history in chosen}

    def pytest_keyboard_interrupt(self) -> None:  # Ctrl-C, a collection error, pytest.exit
        self.stopped = True

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_sessionfinish(self, session):
        # Before pytest-benchmark saves: a point interrupted before its first timed round (in its warm-up, say)
        # has no timings, and would take every finished point down with it.
        benchmarks = session.config._benchmarksession
        benchmarks.benchmarks = [bench for bench in benchmarks.benchmarks if bench.stats]
        return (yield)

    def pytest_benchmark_update_json(self, config, output_json: dict) -> None:
        session = config.pluginmanager.get_plugin("session")
        stopped = self.stopped or config.stash.get(WORKER_STOPPED, False)  # Ctrl-C, an xdist worker that crashed
        output_json[COMPLETE] = not (stopped or session.shouldfail or session.shouldstop)  # -x, --maxfail
