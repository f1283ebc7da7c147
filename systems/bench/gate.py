"""The regression gate. `--benchmark-gate EXPR` decides each point from every timed round
(systems.bench.verdicts): against the newest saved run of this GPU kind that holds it, whose rounds are the
baseline's samples, or with `--benchmark-gate-against REV` against a revision timed in the same job, in turns.

Saved histories drift from day to day (clocks, temperature, drivers), so a gate against them needs a wide margin.
The same-job gate checks REV out in a temporary git worktree and runs the session's selection of benchmarks in
both trees `turns` times, both runs of a turn at once, passing a baton so that their rounds alternate
(systems.bench.baton); the working tree's last run is the session itself, which prints and saves its results as
any run does. A point fails where it is slower, and also where the samples cannot decide, unless
--benchmark-gate-accept-undecided; the saved run keeps the evidence.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from pytest_benchmark.utils import PercentageRegressionCheck, RegressionCheck, get_tag, parse_compare_fail

from systems.bench import baton
from systems.bench.history import Histories, HistoryError, LockedFileStorage, latest_per_point
from systems.bench.options import GRID, grid_of
from systems.bench.verdicts import (CONFIDENCE, LOCATIONS, MAX_SAMPLES, NEW, UNDECIDED, Verdict, can_decide,
                                    decide)

BASELINE, WORK = "baseline", "working tree"
GATE_RECORD = "systems_lab_gate"  # the gate's samples and verdicts, in the history of the run it gated
# Options of the session that its turns must not repeat: the gate's own, and saving (only the session saves).
_OPTIONS_WITH_VALUE = ("--benchmark-gate", "--benchmark-gate-against", "--benchmark-gate-turns",
                       "--benchmark-gate-rounds", "--benchmark-save", "--benchmark-json")
# Rounds a gated run takes at least: with 3, rounds of a few ms on a busy laptop CPU swing by several times and a
# 2x slowdown was undecided in most gates; with 30 the rounds of unchanged code passed 20 of 20 gates at 5%
# (docs/gate-error-rates.md).
GATE_ROUNDS = 30
_FLAGS = ("--benchmark-autosave", "--benchmark-gate-accept-undecided")
_RUN_OK = (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED)
Rounds = dict[str, list[float]]  # {node id: seconds of each timed round}, one run's


def add_options(parser) -> None:
    group = parser.getgroup("benchmark gate", "fail a run on regressions, against saved runs or a revision")
    group.addoption("--benchmark-gate", metavar="EXPR", type=parse_compare_fail, default=None,
                    help="fail on regressions (e.g. median:5%%): each point's rounds against the newest complete saved "
                         "run of this machine and GPU kind that holds it (a first run just saves itself), or with "
                         "--benchmark-gate-against against a revision timed in the same job")
    group.addoption("--benchmark-gate-against", metavar="REV", default=None,
                    help="time git revision REV (checked out in a temporary worktree) and the working tree in "
                         "turns, and gate the working tree against REV")
    group.addoption("--benchmark-gate-turns", metavar="K", type=int, default=3,
                    help="turns of --benchmark-gate-against, each running the benchmarks once in either tree; "
                         "default 3")
    group.addoption("--benchmark-gate-rounds", metavar="R", type=int, default=GATE_ROUNDS,
                    help=f"a gated run times each point at least R rounds (more where --rounds asks more); default "
                         f"{GATE_ROUNDS}, what a 5%% gate needed on a busy 2-core laptop; lower it for points of "
                         "seconds a round")
    group.addoption("--benchmark-gate-accept-undecided", action="store_true",
                    help="pass points whose samples cannot decide (they are still listed); by default they fail")


def configure(config) -> None:
    """Register the plugins that save histories safely (partial runs marked) and, with --benchmark-gate, gate.
    Runs before pytest-benchmark reads its options (its pytest_configure is trylast)."""
    from systems.bench.timing import device_info

    check, against = config.getoption("benchmark_gate"), config.getoption("benchmark_gate_against")
    if against is not None and check is None:
        raise pytest.UsageError("--benchmark-gate-against needs --benchmark-gate EXPR, e.g. median:5%")
    config.option.benchmark_save_data = True  # every history keeps its rounds: a later gate's baseline samples
    if check is not None:
        if check.field not in LOCATIONS:
            raise pytest.UsageError(f"--benchmark-gate {describe(check)}: the gate decides how far a point's rounds "
                                    f"moved, so it reads {', '.join(LOCATIONS)}; {check.field} is a spread")
        config.option.benchmark_autosave = get_tag()
        turns = config.getoption("benchmark_gate_turns") if against is not None else 1
        rounds = gated_rounds(config)
        check_decidable(turns, rounds, against is not None)
        # One Python/OS folder holds the runs of every GPU kind (H100 and H200 alike): compare like with like.
        gate = (RevisionGate(config, against, turns, check) if against is not None
                else SavedRunGate(config, check, device_info()["gpu"]))
        config.pluginmanager.register(gate, "systems-lab-gate")
    config.pluginmanager.register(Histories(config), "systems-lab-histories")


def gated_rounds(config) -> int:
    """The rounds each point of a gated run takes: --rounds, raised to --benchmark-gate-rounds (the grid every
    bench reads says so from here on)."""
    minimum, grid = config.getoption("benchmark_gate_rounds"), grid_of(config)
    if minimum < 1:
        raise pytest.UsageError(f"--benchmark-gate-rounds {minimum}: needs at least 1")
    if grid.rounds < minimum:
        print(f"benchmark gate: {minimum} rounds a point (--benchmark-gate-rounds; --rounds asked {grid.rounds})")
        config.stash[GRID] = dataclasses.replace(grid, rounds=minimum)
    return grid_of(config).rounds


def check_decidable(turns: int, rounds: int, revision: bool) -> None:
    """Refuse, at start-up, a gate whose samples could never show a change."""
    if turns < 1:
        raise pytest.UsageError(f"--benchmark-gate-turns {turns}: needs at least 1")
    if can_decide(turns, rounds):
        return
    more_turns = next(k for k in range(turns + 1, MAX_SAMPLES) if can_decide(k, rounds))
    more_rounds = next(r for r in range(rounds + 1, MAX_SAMPLES) if can_decide(turns, r))
    samples = f"{turns} turn{'s' * (turns > 1)} of {rounds} rounds" if revision else f"one saved run of {rounds} rounds"
    fix = f"at least {more_turns} turns or {more_rounds} rounds" if revision else f"--rounds {more_rounds} or more"
    raise pytest.UsageError(
        f"benchmark gate: {samples} can never decide a point: every working-tree round above every baseline round "
        f"would still happen by chance more often than {1 - CONFIDENCE:.0%} of the time; use {fix}")


def turn_orders(turns: int) -> list[tuple[str, str]]:
    """Which tree holds the baton first in each turn. Alternating (ABBA...) so that whatever the first or second
    round of a pair gains (caches, clocks) favours neither tree."""
    return [(BASELINE, WORK) if (turns - 1 - turn) % 2 == 0 else (WORK, BASELINE) for turn in range(turns)]


def describe(check: RegressionCheck) -> str:
    """The check as --benchmark-gate spells it: median:5% or mean:0.001."""
    unit = "%" if isinstance(check, PercentageRegressionCheck) else ""
    return f"{check.field}:{check.threshold}{unit}"


class Gate:
    """What both gates share: each point's verdict before the run is saved (its history keeps the samples and
    verdicts), the exit status, and the summary."""

    scale_by = "turns"

    def __init__(self, config, check: RegressionCheck, against: str):
        self.check, self.against = check, against
        self.accept_undecided = config.getoption("benchmark_gate_accept_undecided")
        self.baseline: list[Rounds] = []  # per turn
        self.work: list[Rounds] = []
        self.verdicts: list[Verdict] = []

    def failing(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.fails or (v.undecided and not self.accept_undecided)]

    def session_rounds(self, session) -> Rounds:
        benchmarks = session.config._benchmarksession.benchmarks
        return {bench.fullname: list(bench.stats.data) for bench in benchmarks if bench}

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_sessionfinish(self, session):
        # Before pytest-benchmark's wrapper saves the run: its history records the verdicts.
        self.verdicts = self.decide(session)
        result = yield
        if self.failing() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        return result

    def decide(self, session) -> list[Verdict]:
        self.work.append(self.session_rounds(session))
        return decide(self.baseline, self.work, self.check, self.scale_by)

    def pytest_benchmark_update_json(self, output_json: dict) -> None:
        output_json[GATE_RECORD] = {
            "against": self.against, "check": describe(self.check), "turns": len(self.work),
            "accept_undecided": self.accept_undecided,
            "points": {v.name: {"status": v.status, "change": v.change, "low": v.low, "high": v.high,
                                "changes": v.changes, "needed": v.needed, "reason": v.reason,
                                "baseline": [turn.get(v.name) for turn in self.baseline],
                                "work": [turn.get(v.name) for turn in self.work]} for v in self.verdicts}}

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.verdicts:
            return
        terminalreporter.section("benchmark gate")
        for line in report_lines(self.verdicts, self.header(), self.against, self.check, self.scale_by,
                                 self.accept_undecided):
            terminalreporter.write_line(line, red="SLOWER" in line or "UNDECIDED" in line, yellow="accepted" in line)

    def header(self) -> str:
        raise NotImplementedError


def report_lines(verdicts: list[Verdict], header: str, against: str, check: RegressionCheck, scale_by: str,
                 accept_undecided: bool) -> list[str]:
    width = max([len(v.name) for v in verdicts] + [5])
    turns = max(len(v.changes) for v in verdicts)
    unit = "%" if isinstance(check, PercentageRegressionCheck) else " ms"
    lines = [header + f"; fails where the change is above {describe(check)} and its {CONFIDENCE:.0%} interval above "
             "no change, and where the interval cannot tell" + (" (accepted here)" if accept_undecided else "")
             + f" (times: the {check.field} of each run's rounds, median over turns; changes: shifts of the rounds)",
             f"{'point':<{width}}  {'baseline (ms)':>13}  {'working tree (ms)':>17}  {'change [interval]' + unit:>28}  "
             f"{'per turn':>{9 * turns}}"]
    for v in verdicts:
        interval = "" if v.change is None else (
            f"{_change(v.change, check)} [{_change(v.low, check)}, {_change(v.high, check)}]")
        per_turn = " ".join(_change(c, check) for c in v.changes)
        lines.append(f"{v.name:<{width}}  {_ms(v.baseline):>13}  {_ms(v.work):>17}  {interval:>28}  "
                     f"{per_turn:>{9 * turns}}  {_status(v, scale_by, accept_undecided)}")
    for failing, what in ((lambda v: v.fails, f"slower than {against} by more than {describe(check)}"),
                          (lambda v: v.undecided, "undecided" + (", accepted" if accept_undecided else ""))):
        names = [v.name for v in verdicts if failing(v)]
        if names:
            lines.append(f"benchmark gate: {len(names)} of {len(verdicts)} points {what}: {', '.join(names)}")
    return lines


def _status(v: Verdict, scale_by: str, accept_undecided: bool) -> str:
    if v.status != UNDECIDED:
        return v.status.upper() if v.fails else v.status
    needs = f"; needs {v.needed} {scale_by}" if v.needed else ""
    return f"{'undecided (accepted)' if accept_undecided else 'UNDECIDED'}: {v.reason}{needs}"


def _change(change: float | None, check: RegressionCheck) -> str:
    if change is None:
        return ""
    if not math.isfinite(change):
        return "?"
    return f"{change:+.1f}%" if isinstance(check, PercentageRegressionCheck) else f"{change * 1e3:+.3g}"


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.4g}"


class SavedRunGate(Gate):
    """`--benchmark-gate EXPR` alone: each point's rounds against those of the newest complete saved run of this
    GPU kind that holds it; a first run only saves itself."""

    scale_by = "rounds"

    def __init__(self, config, check: RegressionCheck, gpu: str | None):
        super().__init__(config, check, f"the newest saved run of each point on {gpu or 'the CPU'}")
        self.gpu = gpu
        self.saved: dict[str, tuple[Path, dict]] = {}  # node id: the history and its benchmark

    @pytest.hookimpl(trylast=True)  # after Histories has made the storage strict
    def pytest_sessionstart(self, session) -> None:
        benchmarks = session.config._benchmarksession
        if not isinstance(benchmarks.storage, LockedFileStorage):
            pytest.exit("--benchmark-gate reads saved runs from file storage only",
                        returncode=pytest.ExitCode.USAGE_ERROR)
        try:
            baseline = latest_per_point(benchmarks.storage.load(), self.gpu)
        except HistoryError as exc:
            pytest.exit(f"benchmark history: {exc}", returncode=pytest.ExitCode.USAGE_ERROR)
        if not baseline:
            print(f"benchmark gate: no complete baseline for {benchmarks.machine_id} on {self.gpu or 'CPU'} yet; "
                  "this run becomes it")
            return
        benchmarks.compared_mapping = baseline  # pytest-benchmark's table shows each point beside its baseline
        self.saved = {name: (path, bench) for path, benches in baseline.items() for name, bench in benches.items()}

    def decide(self, session) -> list[Verdict]:
        if not self.saved:
            return []
        work = self.session_rounds(session)
        self.baseline = [{name: self.saved[name][1]["stats"].get("data") or [] for name in work if name in self.saved}]
        self.work = [work]
        verdicts = decide(self.baseline, self.work, self.check, self.scale_by)
        return [self._without_rounds(v) if v.status == NEW and v.name in self.saved else v for v in verdicts]

    def _without_rounds(self, verdict: Verdict) -> Verdict:
        path, bench = self.saved[verdict.name]
        return Verdict(verdict.name, bench["stats"][self.check.field], verdict.work, (), None, None, None, UNDECIDED,
                       reason=f"its baseline ({path.name}) was saved without its rounds; save a new one")

    def header(self) -> str:
        files = sorted({path.name for path, _ in self.saved.values()})
        return f"benchmark gate: this run against {self.against} ({', '.join(files)})"


class RevisionGate(Gate):
    """`--benchmark-gate-against REV`: each turn runs both trees at once, passing a baton round by round
    (systems.bench.baton); the last turn's working tree is the session itself, verdicts after it."""

    def __init__(self, config, rev: str, turns: int, check: RegressionCheck):
        if config.getoption("benchmark_compare") or config.getoption("benchmark_compare_fail"):
            raise pytest.UsageError("--benchmark-gate-against makes its own comparison: drop --benchmark-compare "
                                    "and --benchmark-compare-fail")
        self.cwd = Path(config.invocation_params.dir).resolve()
        self.root = Path(_git(self.cwd, "rev-parse", "--show-toplevel")).resolve()
        self.commit = _git(self.root, "rev-parse", "--verify", f"{rev}^{{commit}}")
        super().__init__(config, check, f"{rev} ({self.commit[:10]})")
        self.args = turn_args(list(config.invocation_params.args)) + [f"--rounds={grid_of(config).rounds}"]
        self.turns = turns
        self.held = ExitStack()  # the scratch folder and the baseline's worktree, until the last turn ends
        self.last: tuple[Run, baton.Baton] | None = None  # the last turn's baseline run, and the session's baton
        self.runs: list[Run] = []

    def pytest_sessionstart(self) -> None:
        scratch = Path(self.held.enter_context(tempfile.TemporaryDirectory(prefix="benchmark-gate-")))
        trees = {BASELINE: self.held.enter_context(_worktree(self.root, self.commit, scratch / "baseline")),
                 WORK: self.root}
        for turn, order in enumerate(turn_orders(self.turns)):
            ends = dict(zip(order, baton.pair()))
            runs = {side: self._start(trees[side], scratch, f"turn {turn + 1} of {self.turns}, {side}", ends[side],
                                      first=side == order[0])
                    for side in order if (turn, side) != (self.turns - 1, WORK)}
            if turn < self.turns - 1:
                for side, run in runs.items():
                    (self.baseline if side == BASELINE else self.work).append(run.finish())
            else:
                self.last = runs[BASELINE], baton.Baton(*ends[WORK], first=order[0] == WORK)
        print(f"benchmark gate: turn {self.turns} of {self.turns}, {WORK}: this session, with the {BASELINE} "
              "passing a baton")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self) -> None:
        baton.begin(self.last[1])

    def decide(self, session) -> list[Verdict]:
        if self.last is None:  # the earlier turns stopped the session
            return []
        baton.end()
        self.baseline.append(self.last[0].finish())
        self.held.close()
        return super().decide(session)

    def pytest_unconfigure(self) -> None:
        for run in self.runs:  # where the session stopped before its end, or another run failed
            run.proc.kill()
            run.proc.wait()
        self.held.close()

    def _start(self, tree: Path, scratch: Path, what: str, ends: tuple[int, int], first: bool) -> Run:
        """A run of the selected benchmarks in `tree`, passing the baton through `ends`."""
        root = str(self.root) + os.sep
        args = [str(tree) + os.sep + arg.removeprefix(root) if arg.startswith(root) else arg for arg in self.args]
        name = what.replace(" ", "-").replace(",", "")
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])),
               "PYTEST_ADDOPTS": shlex.join(turn_args(shlex.split(os.environ.get("PYTEST_ADDOPTS", "")))),
               baton.ENV: baton.env_value(ends, first)}
        out, log = scratch / f"{name}.json", scratch / f"{name}.log"
        with log.open("w") as output:
            proc = subprocess.Popen([sys.executable, "-m", "pytest", *args, f"--benchmark-json={out}"],
                                    cwd=tree / self.cwd.relative_to(self.root), env=env, stdout=output,
                                    stderr=subprocess.STDOUT, pass_fds=ends)
        for fd in ends:  # the run's now: the other run sees its end when it exits
            os.close(fd)
        self.runs.append(Run(proc, out, log, what, time.perf_counter()))
        return self.runs[-1]

    def header(self) -> str:
        return f"benchmark gate: the working tree against {self.against}, turns: {self.turns}, rounds passing a baton"


class Run:
    """A turn's run of one tree in a process of its own."""

    def __init__(self, proc: subprocess.Popen, out: Path, log: Path, what: str, start: float):
        self.proc, self.out, self.log, self.what, self.start = proc, out, log, what, start

    def finish(self) -> Rounds:
        """Each point's rounds, once the run has ended."""
        code = self.proc.wait()
        print(f"benchmark gate: {self.what}: exit {code} after {time.perf_counter() - self.start:.1f} s")
        if code not in _RUN_OK:
            pytest.exit(f"benchmark gate: the run of {self.what} exited with {code}:\n"
                        f"{self.log.read_text()[-4000:]}", returncode=pytest.ExitCode.INTERNAL_ERROR)
        if not self.out.exists():  # no benchmark ran
            return {}
        return {bench["fullname"]: bench["stats"]["data"] for bench in json.loads(self.out.read_text())["benchmarks"]}


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
