"""Benchmark histories and the regression gate, through real pytest runs of a sleep benchmark.

The gate trips on a 2x slowdown and passes when the same code is compared with itself; it compares each point's
rounds with those of the newest complete run of the same GPU kind that holds it; a point it cannot decide fails
unless accepted; samples that could never decide are refused at start-up; a run that stopped early is saved as
partial and skipped by the gate and the report; runs saving at once get distinct numbers; and
--benchmark-gate-against times a revision and the working tree in turns, their rounds alternating, its evidence
saved with the run.
"""

import functools
import json
import multiprocessing
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from sleep_bench import BENCH, GATE, GATE_ROUNDS, bench, gate_rows, histories  # noqa: F401 (bench is a fixture)
from systems import report
from systems.bench.gate import GATE_RECORD
from systems.bench.history import LockedFileStorage

ROOT = Path(__file__).resolve().parents[1]


def test_gate_saves_a_first_baseline_passes_on_same_code_and_trips_on_2x_slowdown(bench, inner_pytest):
    first = bench(GATE)
    first.assert_outcomes(passed=3)
    assert "no complete baseline" in first.stdout.str()
    assert len(histories(inner_pytest)) == 1
    same = bench(GATE)
    assert same.ret == 0, same.stdout.str()
    slow = bench(GATE, SLOWDOWN=2)
    assert slow.ret != 0
    assert gate_rows(slow) == {"test_first": "SLOWER", "test_last": "SLOWER"}


def test_gate_ignores_runs_from_another_gpu_kind(bench, inner_pytest):
    bench(GATE).assert_outcomes(passed=3)
    (history,) = histories(inner_pytest)
    saved = json.loads(history.read_text())
    saved["machine_info"]["systems_lab"]["gpu"] = "Another GPU"
    history.write_text(json.dumps(saved))
    slow = bench(GATE, SLOWDOWN=2)  # would trip against the run above, were it comparable
    assert slow.ret == 0, slow.stdout.str()
    assert "no complete baseline" in slow.stdout.str()
    slower = bench(GATE, SLOWDOWN=4)  # 2x the run just saved, which became this kind's baseline
    assert slower.ret != 0


def test_gate_compares_each_point_with_the_newest_run_that_holds_it(bench):
    bench(GATE).assert_outcomes(passed=3)
    bench(GATE, "-k", "first").assert_outcomes(passed=1)  # the newest run, without test_last
    slow = bench(GATE, SLOWDOWN_last=2)
    assert slow.ret != 0
    assert gate_rows(slow) == {"test_first": "ok", "test_last": "SLOWER"}  # test_last against the first run


@pytest.mark.parametrize("stop, args, complete", [
    ("interrupt", [], False),
    ("fail", ["-x"], False),
    ("fail", [], True),  # a failed test is a result: the run still went through all its tests
], ids=["ctrl-c", "exitfirst", "failed-test"])
@pytest.mark.parametrize("sigint", [signal.default_int_handler, signal.SIG_IGN], ids=["foreground", "background"])
def test_run_that_stops_early_is_saved_as_partial(bench, inner_pytest, stop, args, complete, sigint):
    """Also where SIGINT is ignored, as a background shell, nohup or a CI runner hands it down."""
    previous = signal.signal(signal.SIGINT, sigint)
    try:
        bench("--benchmark-autosave", *args, STOP=stop)
    finally:
        signal.signal(signal.SIGINT, previous)
    (history,) = histories(inner_pytest)
    saved = json.loads(history.read_text())
    assert saved["systems_lab_complete"] is complete
    assert history.stem.endswith("_partial") is not complete
    assert [b["name"] for b in saved["benchmarks"]] == ["test_first", "test_last"][:2 if complete else 1]


def test_gate_and_report_skip_partial_runs(bench, inner_pytest, tmp_path):
    bench(GATE).assert_outcomes(passed=3)
    (complete,) = histories(inner_pytest)
    # A partial run 4x slower: a 2x slowdown would pass against it.
    saved = json.loads(complete.read_text())
    saved["systems_lab_complete"] = False
    for point in saved["benchmarks"]:
        point["stats"] = {k: v * 4 if k in ("min", "max", "mean", "median") else v for k, v in point["stats"].items()}
        point["stats"]["data"] = [seconds * 4 for seconds in point["stats"]["data"]]
    partial = complete.with_name(complete.name.replace("0001_", "0002_").replace(".json", "_partial.json"))
    partial.write_text(json.dumps(saved))

    storage = inner_pytest.path / ".benchmarks"
    for out, run in ("latest", []), ("named", ["--run", "2"]):
        assert report.main(["--storage", str(storage), "--out", str(tmp_path / out), *run]) == 0
    assert (tmp_path / "latest" / "report.md").read_text().startswith("# Benchmark report: run 0001\n")
    assert (tmp_path / "named" / "report.md").read_text().startswith("# Benchmark report: run 0002\n")

    slow = bench(GATE, SLOWDOWN=2)
    assert slow.ret != 0
    assert gate_rows(slow) == {"test_first": "SLOWER", "test_last": "SLOWER"}


# Rounds of 2 and 20 ms in both trees: one distribution, but the shift's interval spans a factor of ten.
NOISY = """
import time


def test_noisy(benchmark):
    delays = iter([0.002, 0.02] * 10)
    benchmark.pedantic(lambda: time.sleep(next(delays)), rounds=5)
"""


def test_a_point_the_gate_cannot_decide_fails_unless_accepted_and_is_listed(inner_pytest):
    inner_pytest.makepyfile(test_noisy=NOISY)
    run = functools.partial(inner_pytest.runpytest_inprocess, "-p", "no:cacheprovider", GATE)
    run().assert_outcomes(passed=1)  # the baseline
    undecided = run()
    assert undecided.ret == pytest.ExitCode.TESTS_FAILED
    [row] = gate_rows(undecided).values()
    assert row.startswith("UNDECIDED: the change is at most the threshold, its interval too wide to tell; needs ")
    assert "1 of 1 points undecided: test_noisy.py::test_noisy" in undecided.stdout.str()
    accepted = run("--benchmark-gate-accept-undecided")
    assert accepted.ret == 0
    assert list(gate_rows(accepted).values())[0].startswith("undecided (accepted): ")
    assert "1 of 1 points undecided, accepted: test_noisy.py::test_noisy" in accepted.stdout.str()


def test_a_baseline_saved_without_its_rounds_is_undecided_not_passed(bench, inner_pytest):
    bench(GATE).assert_outcomes(passed=3)
    (history,) = histories(inner_pytest)
    saved = json.loads(history.read_text())
    for point in saved["benchmarks"]:
        del point["stats"]["data"]  # as pytest-benchmark saves without --benchmark-save-data
    history.write_text(json.dumps(saved))
    same = bench(GATE)
    assert same.ret == pytest.ExitCode.TESTS_FAILED
    assert set(gate_rows(same).values()) == {f"UNDECIDED: its baseline ({history.name}) was saved without its rounds; "
                                             "save a new one"}


def test_report_without_a_complete_run_is_a_one_line_error(tmp_path, capsys):
    partial = tmp_path / "storage" / "machine" / "0001_abc_20260101_120000_partial.json"
    partial.parent.mkdir(parents=True)
    partial.write_text(json.dumps({"benchmarks": [], "systems_lab_complete": False}))
    assert report.main(["--storage", str(tmp_path / "storage"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no complete run" in err and "name one with --run" in err and err.count("\n") == 1


def save_at_once(storage_path: Path, writer: int, saves: int, ready, go) -> None:
    """A writer of its own process: ready, then, once every writer is, `saves` saves as fast as it can."""
    storage = LockedFileStorage(str(storage_path), SimpleNamespace(info=lambda message: None), "machine")
    ready.release()
    go.wait()
    for i in range(saves):
        storage.save({"writer": str(writer), "save": i, "benchmarks": []}, "tag")


def test_runs_saving_at_once_get_distinct_numbers(tmp_path):
    """Processes forked from this one (the file lock is a process's; threads would share it), started at once."""
    writers, saves = 4, 25
    fork = multiprocessing.get_context("fork")
    ready, go = fork.Semaphore(0), fork.Event()
    procs = [fork.Process(target=save_at_once, args=(tmp_path / "storage", w, saves, ready, go))
             for w in range(writers)]
    for proc in procs:
        proc.start()
    assert all(ready.acquire(timeout=120) for _ in procs)
    go.set()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0] * writers
    saved = sorted((tmp_path / "storage" / "machine").glob("*.json"))
    assert [int(path.name[:4]) for path in saved] == list(range(1, writers * saves + 1))
    contents = sorted((d["writer"], d["save"]) for d in (json.loads(path.read_text()) for path in saved))
    assert contents == sorted((str(w), i) for w in range(writers) for i in range(saves))  # none overwritten


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=gate", "-c", "user.email=gate@example.com", *args],
                          cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(inner_pytest):
    """The project as a git repository: a benchmark file, committed."""
    def commit(bench_file: str, text: str):
        (inner_pytest.path / bench_file).write_text(text)
        git(inner_pytest.path, "init", "-q")
        git(inner_pytest.path, "add", bench_file)
        git(inner_pytest.path, "commit", "-qm", "baseline")

    return commit


def test_gate_against_a_revision_trips_on_the_slowed_point_only(repo, inner_pytest, monkeypatch):
    """On a machine whose speed swings 2.5x every 2 s: two runs one after the other can differ by more than the
    2x slowdown; rounds that alternate see the same machine. Two turns, each tree first in one of them: every
    turn beyond is another two starts of torch, in the same code."""
    repo("test_sleep.py", BENCH.format(first=0.01, last=0.01))
    (inner_pytest.path / "test_sleep.py").write_text(BENCH.format(first=0.01, last=0.02))  # not committed
    monkeypatch.setenv("DRIFT", "1.5")
    result = inner_pytest.runpytest_inprocess("-p", "no:cacheprovider", "test_sleep.py", GATE, "--benchmark-autosave",
                                              "--benchmark-gate-against=HEAD", "--benchmark-gate-turns", "2",
                                              "--rounds=2", "--benchmark-gate-rounds=6")
    assert result.ret == 1, result.stdout.str()
    assert gate_rows(result) == {"test_first": "ok", "test_last": "SLOWER"}
    assert "1 of 2 points slower than HEAD" in result.stdout.str()
    (history,) = histories(inner_pytest)  # the session's own run, saved as usual, with the gate's evidence
    saved = json.loads(history.read_text())
    assert saved["systems_lab_complete"]
    evidence = saved[GATE_RECORD]["points"]["test_sleep.py::test_last"]
    assert evidence["status"] == "slower" and len(evidence["changes"]) == 2
    assert [len(rounds) for rounds in evidence["baseline"] + evidence["work"]] == [6] * 4  # raised in every run
    assert git(inner_pytest.path, "worktree", "list").count("\n") == 1  # the baseline's worktree is gone


def test_gate_against_options_are_checked_at_start_up(repo, inner_pytest):
    repo("test_sleep.py", BENCH.format(first=0.01, last=0.01))
    for args, message in [(["--benchmark-gate-against=HEAD"], "needs --benchmark-gate EXPR"),
                          ([GATE, "--benchmark-gate-against=no-such-rev"], "no-such-rev"),
                          ([GATE, "--benchmark-gate-against=HEAD", "--benchmark-gate-turns=0"], "at least 1"),
                          ([GATE, "--benchmark-gate-against=HEAD", "--benchmark-gate-turns=1", "--rounds=3",
                            "--benchmark-gate-rounds=3"], "1 turn of 3 rounds can never decide a point"),
                          ([GATE, "--rounds=2", "--benchmark-gate-rounds=3"],
                           "one saved run of 3 rounds can never decide a point"),
                          ([GATE, "--benchmark-gate-rounds=0"], "--benchmark-gate-rounds 0: needs at least 1"),
                          (["--benchmark-gate=stddev:5%"], "stddev is a spread"),
                          (["--benchmark-gate=mean:fast"], "Could not parse value")]:
        result = inner_pytest.runpytest_inprocess("-p", "no:cacheprovider", *args)
        assert result.ret == pytest.ExitCode.USAGE_ERROR, args
        assert message in result.stderr.str(), (args, result.stderr.str())


def test_a_gated_run_takes_the_gates_rounds_unless_more_are_asked(inner_pytest):
    """With 3 rounds a run, rounds of a few ms on a busy laptop hid a 2x slowdown; a gate takes 30 at least."""
    inner_pytest.makepyfile(test_rounds="""
from systems.bench.options import grid_of

def test_rounds(request):
    print("rounds:", grid_of(request.config).rounds)
""")
    for args, rounds in ([GATE, "--rounds=3"], 30), ([GATE, "--rounds=40"], 40), ([GATE, GATE_ROUNDS], 10), ([], 5):
        result = inner_pytest.runpytest_inprocess("-p", "no:cacheprovider", "-s", "test_rounds.py", *args)
        assert result.ret == 0 and f"rounds: {rounds}\n" in result.stdout.str(), (args, result.stdout.str())


GPU_BENCH = """
import torch

from systems.bench.options import grid_of
from systems.bench.timing import time_on_device

ITERATIONS = {iterations}  # the slowed working tree runs 11 instead of 10: a 10% slowdown
DEVICE = torch.device("cuda")
# Made at import, in the untimed start-up: both runs of a turn start CUDA and cuBLAS at once, before the baton.
A, B, C = (torch.randn(6144, 6144, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
torch.matmul(A, B, out=C)


def test_matmuls(benchmark, request):
    def run():
        for _ in range(ITERATIONS):
            torch.matmul(A, B, out=C)

    time_on_device(benchmark, run, device=DEVICE, warmup=5, rounds=grid_of(request.config).rounds)
"""


@pytest.mark.gpu
@pytest.mark.timing
def test_gate_against_trips_on_a_10_percent_gpu_slowdown_and_holds_on_unchanged_code(repo, inner_pytest):
    """Green on unchanged code, twice, and red on a 10% slowdown, at the default turns; each verdict with its
    interval (the gate's error rates over many runs: docs/gate-error-rates.md). A round is ten bf16 matmuls of
    6144^3, about 7 ms on an H100 or H200 and GPU-bound: the host's part (ten launches, a synchronize) is under 1%,
    and a GPU-bound point's shifts spread 1.3% from turn to turn where 10% is asked. Each gate's session runs in
    this process (its turns start their own), so that a gate starts torch five times, not six."""
    repo("test_matmuls.py", GPU_BENCH.format(iterations=10))
    args = ("-p", "no:cacheprovider", "test_matmuls.py", "--benchmark-gate=median:5%",
            "--benchmark-gate-against=HEAD")
    results = [inner_pytest.runpytest_inprocess(*args) for _ in range(2)]
    (inner_pytest.path / "test_matmuls.py").write_text(GPU_BENCH.format(iterations=11))
    results.append(inner_pytest.runpytest_inprocess(*args))
    for name, result in zip(["unchanged"] * 2 + ["slowed 10%"], results):  # each turn's seconds, then the verdict
        print(name, *[line for line in result.outlines if "test_matmuls.py::" in line or " exit " in line], sep="\n")
    assert [list(gate_rows(result).values()) for result in results] == [["ok"], ["ok"], ["SLOWER"]]
