"""The regression gate trips on a 2x slowdown, passes when the same code is compared with itself, and compares
only runs timed on the same GPU kind."""

import json
import os
import pathlib

import pytest

pytest_plugins = ["pytester"]

ROOT = pathlib.Path(__file__).resolve().parents[1]

BENCH = """
import os, time

def test_sleep(benchmark):
    delay = 0.01 * float(os.environ.get("SLOWDOWN", "1"))
    benchmark.pedantic(time.sleep, args=(delay,), rounds=5, warmup_rounds=1)
"""


@pytest.fixture
def gate(pytester, monkeypatch):
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    pytester.makepyfile(test_sleep=BENCH)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))

    def run(slowdown: float):
        monkeypatch.setenv("SLOWDOWN", str(slowdown))
        return pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark-gate=mean:50%")

    return run


def test_first_run_saves_a_baseline_without_comparing(gate, pytester):
    result = gate(1)
    result.assert_outcomes(passed=1)
    assert "no baseline" in result.stdout.str()
    assert len(list(pytester.path.glob(".benchmarks/*/*.json"))) == 1


def test_gate_passes_on_same_code_and_trips_on_2x_slowdown(gate):
    gate(1).assert_outcomes(passed=1)
    same = gate(1)
    assert same.ret == 0, same.stdout.str()
    slow = gate(2)
    assert slow.ret != 0
    assert "failed PercentageRegressionCheck" in slow.stdout.str() + slow.stderr.str()


def test_gate_ignores_runs_from_another_gpu_kind(gate, pytester):
    gate(1).assert_outcomes(passed=1)
    (history,) = pytester.path.glob(".benchmarks/*/*.json")
    saved = json.loads(history.read_text())
    saved["machine_info"]["systems_lab"]["gpu"] = "Another GPU"
    history.write_text(json.dumps(saved))
    slow = gate(2)  # would trip against the run above, were it comparable
    assert slow.ret == 0, slow.stdout.str()
    assert "no baseline" in slow.stdout.str()
    slower = gate(4)  # 2x the run just saved, which became this kind's baseline
    assert slower.ret != 0
