"""`--benchmark-gate-against REV`: time a baseline revision and the working tree in the same job, in turns.

Saved histories drift from one day to the next (clocks, temperature, drivers), so a gate against them needs a
wide margin. This gate checks REV out in a temporary git worktree and runs the session's selection of
benchmarks in both trees, alternately, `turns` times, each run a fresh `pytest` process. The working tree's
last turn is the session that asked for the gate: it prints and saves its results as any run does, and fails
if a point is slower than REV's by more than the --benchmark-gate threshold, significantly (systems.bench.verdicts
decides each point from its paired turns).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from pytest_benchmark.utils import PercentageRegressionCheck, RegressionCheck, get_tag, parse_compare_fail

from systems.bench.history import Histories
from systems.bench.verdicts import CONFIDENCE, Verdict, decide

BASELINE, WORK = "baseline", "working tree"
# Options of the session that its turns must not repeat: the gate's own, and saving (only the session saves).
_OPTIONS_WITH_VALUE = ("--benchmark-gate", "--benchmark-gate-against", "--benchmark-gate-turns",
                       "--benchmark-save", "--benchmark-json")
_FLAGS = ("--benchmark-autosave",)
_RUN_OK = (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED)


def add_options(parser) -> None:
    group = parser.getgroup("benchmark gate", "fail a run on regressions, against saved runs or a revision")
    group.addoption("--benchmark-gate", metavar="EXPR", type=parse_compare_fail, default=None,
                    help="fail on regressions (e.g. median:5%%): each point against the newest complete saved run of "
                         "this machine and GPU kind that holds it (a first run just saves itself), or with "
                         "--benchmark-gate-against against a revision timed in the same job")
    group.addoption("--benchmark-gate-against", metavar="REV", default=None,
                    help="time git revision REV (checked out in a temporary worktree) and the working tree in "
                         "turns, and gate the working tree against REV")
    group.addoption("--benchmark-gate-turns", metavar="K", type=int, default=3,
                    help="turns of --benchmark-gate-against, each running the benchmarks once in either tree; "
                         "default 3")


def configure(config) -> None:
    """Register the plugins that save histories safely (partial runs marked) and, with --benchmark-gate, gate.
    Runs before pytest-benchmark reads its options (its pytest_configure is trylast)."""
    from systems.bench.timing import device_info

    check, against = config.getoption("benchmark_gate"), config.getoption("benchmark_gate_against")
    if against is not None and check is None:
        raise pytest.UsageError("--benchmark-gate-against needs --benchmark-gate EXPR, e.g. median:5%")
    if check is not None:
        config.option.benchmark_autosave = get_tag()
    if against is not None:
        config.pluginmanager.register(RevisionGate(config, against, config.getoption("benchmark_gate_turns"), check),
                                      "systems-lab-revision-gate")
    # One Python/OS folder holds the runs of every GPU kind (H100 and H200 alike): compare like with like.
    history_gate = check if against is None else None
    gpu = device_info()["gpu"] if history_gate else None
    config.pluginmanager.register(Histories(config, history_gate, gpu), "systems-lab-histories")


def turn_orders(turns: int) -> list[tuple[str, str]]:
    """Which tree runs first in each turn. Alternating (ABBA...) so that a trend through the job (a GPU warming
    up, a neighbour's job starting) favours neither tree; the last turn ends with the working tree, which is the
    session's own run."""
    return [(BASELINE, WORK) if (turns - 1 - turn) % 2 == 0 else (WORK, BASELINE) for turn in range(turns)]


def describe(check: RegressionCheck) -> str:
    """The check as --benchmark-gate spells it: median:5% or mean:0.001."""
    unit = "%" if isinstance(check, PercentageRegressionCheck) else ""
    return f"{check.field}:{check.threshold}{unit}"


def report_lines(verdicts: list[Verdict], against: str, turns: int, check: RegressionCheck) -> list[str]:
    width = max([len(v.name) for v in verdicts] + [5])
    unit = "%" if isinstance(check, PercentageRegressionCheck) else " ms"
    lines = [f"benchmark gate: the working tree against {against}, turns: {turns}; fails where the change is above "
             f"{describe(check)} and its {CONFIDENCE:.0%} interval above no change (the {check.field} of each run's "
             "rounds; times are medians over turns, changes means)",
             f"{'point':<{width}}  {'baseline (ms)':>13}  {'working tree (ms)':>17}  {'change [interval]' + unit:>28}  "
             f"{'per turn':>{9 * turns}}"]
    for v in verdicts:
        interval = "" if v.change is None else (
            f"{_change(v.change, check)} [{_change(v.low, check)}, {_change(v.high, check)}]")
        per_turn = " ".join(_change(c, check) for c in v.changes)
        needed = "" if v.status != "too noisy" else (f" to gate at {turns} turns: needs {v.turns_needed}"
                                                     if v.turns_needed else f" to gate at {turns} turns")
        lines.append(f"{v.name:<{width}}  {_ms(v.baseline):>13}  {_ms(v.work):>17}  {interval:>28}  "
                     f"{per_turn:>{9 * turns}}  {v.status.upper() if v.slower else v.status}{needed}")
    for status, what in (("slower", f"slower than {against} by more than {describe(check)}"),
                         ("too noisy", "too noisy to gate: not gated")):
        names = [v.name for v in verdicts if v.status == status]
        if names:
            lines.append(f"benchmark gate: {len(names)} of {len(verdicts)} points {what}: {', '.join(names)}")
    return lines


def _change(change: float | None, check: RegressionCheck) -> str:
    if change is None:
        return ""
    if not math.isfinite(change):
        return "?"
    return f"{change:+.1f}%" if isinstance(check, PercentageRegressionCheck) else f"{change * 1e3:+.3g}"


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.4g}"


def turn_args(args: list[str]) -> list[str]:
    """The session's arguments without the options that only the session itself acts on."""
    kept, skip_value = [], False
    for arg in args:
        name = arg.split("=", 1)[0]
        if skip_value:
            skip_value = False
        elif name in _OPTIONS_WITH_VALUE:
            skip_value = "=" not in arg
        elif name not in _FLAGS:
            kept.append(arg)
    return kept


def _git(cwd: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise pytest.UsageError(f"--benchmark-gate-against: git {' '.join(args)} failed: "
                                f"{(proc.stderr or proc.stdout).strip()}")
    return proc.stdout.strip()


@contextmanager
def _worktree(root: Path, commit: str, path: Path) -> Iterator[Path]:
    _git(root, "worktree", "add", "--detach", str(path), commit)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(path)], capture_output=True)


class RevisionGate:
    """The pytest plugin of --benchmark-gate-against: the other turns before the session, verdicts after it."""

    def __init__(self, config, rev: str, turns: int, check: RegressionCheck):
        if turns < 1:
            raise pytest.UsageError(f"--benchmark-gate-turns {turns}: needs at least 1")
        if config.getoption("benchmark_compare") or config.getoption("benchmark_compare_fail"):
            raise pytest.UsageError("--benchmark-gate-against makes its own comparison: drop --benchmark-compare "
                                    "and --benchmark-compare-fail")
        self.cwd = Path(config.invocation_params.dir).resolve()
        self.root = Path(_git(self.cwd, "rev-parse", "--show-toplevel")).resolve()
        self.commit = _git(self.root, "rev-parse", "--verify", f"{rev}^{{commit}}")
        self.against = f"{rev} ({self.commit[:10]})"
        self.args = turn_args(list(config.invocation_params.args))
        self.turns = turns
        self.check = check
        self.timings: dict[str, list[dict[str, float]]] = {BASELINE: [], WORK: []}  # per turn
        self.verdicts: list[Verdict] = []

    def pytest_sessionstart(self) -> None:
        with tempfile.TemporaryDirectory(prefix="benchmark-gate-") as scratch:
            with _worktree(self.root, self.commit, Path(scratch) / "baseline") as baseline:
                for turn, order in enumerate(turn_orders(self.turns)):
                    for side in order:
                        if (turn, side) == (self.turns - 1, WORK):
                            continue  # the session's own run
                        tree = baseline if side == BASELINE else self.root
                        what = f"turn {turn + 1} of {self.turns}, {side}"
                        self.timings[side].append(self._run(tree, Path(scratch) / f"{turn}-{side}.json", what))
        print(f"benchmark gate: turn {self.turns} of {self.turns}, {WORK}: this session")

    def _run(self, tree: Path, out: Path, what: str) -> dict[str, float]:
        """One run of the selected benchmarks in `tree`: {node id: the check's statistic, seconds}."""
        root = str(self.root) + os.sep
        args = [str(tree) + os.sep + arg.removeprefix(root) if arg.startswith(root) else arg for arg in self.args]
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])),
               "PYTEST_ADDOPTS": shlex.join(turn_args(shlex.split(os.environ.get("PYTEST_ADDOPTS", ""))))}
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", *args, f"--benchmark-json={out}"],
                              cwd=tree / self.cwd.relative_to(self.root), env=env, capture_output=True, text=True)
        print(f"benchmark gate: {what}: exit {proc.returncode} after {time.perf_counter() - start:.1f} s")
        if proc.returncode not in _RUN_OK:
            pytest.exit(f"benchmark gate: the run of {what} exited with {proc.returncode}:\n"
                        f"{(proc.stdout + proc.stderr)[-4000:]}", returncode=pytest.ExitCode.INTERNAL_ERROR)
        if not out.exists():  # no benchmark ran
            return {}
        return {bench["fullname"]: bench["stats"][self.check.field]
                for bench in json.loads(out.read_text())["benchmarks"]}

    def pytest_sessionfinish(self, session) -> None:
        # A plain hook: it runs after pytest-benchmark's wrapper has finished the session's benchmarks.
        benchmarks = session.config._benchmarksession.benchmarks
        self.timings[WORK].append({bench.fullname: bench[self.check.field] for bench in benchmarks if bench})
        self.verdicts = decide(self.timings[BASELINE], self.timings[WORK], self.check)
        if any(verdict.slower for verdict in self.verdicts) and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.verdicts:
            return
        terminalreporter.section("benchmark gate")
        for line in report_lines(self.verdicts, self.against, self.turns, self.check):
            terminalreporter.write_line(line, red="SLOWER" in line or "points slower" in line,
                                        yellow="too noisy" in line)
