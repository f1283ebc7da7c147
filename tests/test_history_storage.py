"""Saved runs as the gate and --benchmark-compare read them: a history that cannot be read stops the run before
anything is timed, naming the file and why, and nothing is saved over it; plain --benchmark-compare takes the
newest complete run; a run interrupted inside a point's warm-up keeps the points it finished, as partial."""

import json

import pytest
from pytest_benchmark.utils import get_machine_id

from sleep_bench import BENCH, GATE, bench, histories, run_inprocess  # noqa: F401 (bench is a fixture)
from systems.bench.schema import SCHEMA

CORRUPTIONS = {
    "truncated": lambda text: text[: len(text) // 2],
    "empty": lambda text: "",
    "another-shape": lambda text: json.dumps([1, 2, 3]),
    "no-fullname": lambda text: json.dumps({**json.loads(text), "benchmarks": [
        {k: v for k, v in b.items() if k != "fullname"} for b in json.loads(text)["benchmarks"]]}),
    "stats-moved": lambda text: json.dumps({**json.loads(text), "benchmarks": [
        {**{k: v for k, v in b.items() if k != "stats"}, "statistics": b["stats"]}
        for b in json.loads(text)["benchmarks"]]}),
    "newer-schema": lambda text: json.dumps({**json.loads(text), "systems_lab_schema": 99}),
}
MESSAGES = {"truncated": "cannot be read (JSONDecodeError", "empty": "cannot be read (JSONDecodeError",
            "another-shape": "not a pytest-benchmark history", "no-fullname": "benchmark 0 has no fullname",
            "stats-moved": "its stats lack",
            "newer-schema": f"saved with schema 99 (this code reads {SCHEMA}): a newer schema"}


def saved_history(inner_pytest, how: str) -> str:
    """BENCH's two benchmarks as a run of this machine saved them, corrupted `how`; its text."""
    stats = {"min": 0.01, "max": 0.01, "mean": 0.01, "stddev": 0.0, "rounds": 5, "median": 0.01, "iqr": 0.0,
             "q1": 0.01, "q3": 0.01, "iqr_outliers": 0, "stddev_outliers": 0, "outliers": "0;0", "ld15iqr": 0.01,
             "hd15iqr": 0.01, "ops": 100.0, "total": 0.05, "iterations": 1}
    benchmarks = [{"group": None, "name": name, "fullname": f"test_sleep.py::{name}", "params": None, "param": None,
                   "extra_info": {}, "options": {}, "stats": stats} for name in ("test_first", "test_last")]
    history = {"machine_info": {"systems_lab": {"gpu": None}}, "commit_info": {}, "benchmarks": benchmarks,
               "datetime": "2026-01-01T12:00:00", "version": "5.2.3", "systems_lab_schema": SCHEMA,
               "systems_lab_complete": True, "out_of_memory": []}
    path = inner_pytest.path / ".benchmarks" / get_machine_id() / "0001_abc_20260101_120000.json"
    path.parent.mkdir(parents=True)
    path.write_text(CORRUPTIONS[how](json.dumps(history)))
    return path.read_text()


@pytest.mark.parametrize("how", CORRUPTIONS)
@pytest.mark.parametrize("args", [[GATE], ["--benchmark-compare", "--benchmark-compare-fail=mean:50%"],
                                  ["--benchmark-compare=0001", "--benchmark-autosave"]],
                         ids=["gate", "compare-latest", "compare-named"])
def test_a_history_that_cannot_be_read_stops_the_run_naming_it_and_is_not_saved_over(inner_pytest, how, args):
    inner_pytest.makepyfile(test_sleep=BENCH.format(first=0.01, last=0.01))
    text = saved_history(inner_pytest, how)
    ran = inner_pytest.runpytest_inprocess("-p", "no:cacheprovider", *args)
    assert ran.ret == pytest.ExitCode.USAGE_ERROR
    output = ran.stdout.str() + ran.stderr.str()
    line = next(line for line in output.splitlines() if "benchmark history: " in line)
    assert MESSAGES[how] in line and "0001_" in line
    assert "passed" not in output and "Traceback" not in output
    [history] = histories(inner_pytest)  # nothing saved beside it, nor over it
    assert history.read_text() == text


def test_plain_compare_takes_the_newest_complete_run_not_a_partial_one(bench, inner_pytest):
    bench("--benchmark-autosave").assert_outcomes(passed=3)
    bench("--benchmark-autosave", STOP="interrupt")
    first, partial = histories(inner_pytest)
    assert partial.stem.endswith("_partial")
    compared = bench("--benchmark-compare", "--benchmark-compare-fail=mean:1000%")
    assert compared.ret == 0, compared.stdout.str()
    [line] = [line for line in compared.stdout.lines if line.startswith("benchmark compare: against ")]
    assert line.endswith(first.name)


WARMUP = """
import os
import signal
import time


def test_done(benchmark):
    benchmark.pedantic(time.sleep, args=(0.001,), rounds=3)


def test_interrupted_in_warmup(benchmark):
    def interrupt():
        signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever the shell handed down
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)  # cut short by the KeyboardInterrupt

    benchmark.pedantic(interrupt, rounds=3, warmup_rounds=2)


def test_never_reached(benchmark):
    benchmark(sum, [1])
"""


def test_an_interrupt_in_a_points_warmup_keeps_the_finished_points_as_a_partial_run(inner_pytest):
    inner_pytest.makepyfile(test_warm=WARMUP)
    ran = run_inprocess(inner_pytest, "-p", "no:cacheprovider", "--benchmark-autosave")
    assert ran.ret == pytest.ExitCode.INTERRUPTED
    assert "min() arg is an empty sequence" not in ran.stdout.str() + ran.stderr.str()
    [history] = histories(inner_pytest)
    saved = json.loads(history.read_text())
    assert history.stem.endswith("_partial") and saved["systems_lab_complete"] is False
    assert [b["name"] for b in saved["benchmarks"]] == ["test_done"]
