"""The shared harness: GPU pinning of xdist workers and the history metadata."""

import json
import os
import pathlib

import pytest
import torch

import conftest
from systems.benchmarking import device_info

pytest_plugins = ["pytester"]

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("worker", "visible", "expected"), [
    ("gw0", "3,5", "3"),
    ("gw1", "3,5", "5"),
    ("gw2", "3,5", "3"),  # more workers than GPUs: they share, round robin
    ("gw1", "GPU-aaaa,GPU-bbbb", "GPU-bbbb"),
])
def test_xdist_workers_get_their_own_gpu_from_the_visible_list(monkeypatch, worker, visible, expected):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    conftest._pin_xdist_worker_to_gpu()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == expected


def test_outside_xdist_nothing_is_pinned(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    conftest._pin_xdist_worker_to_gpu()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_device_info_names_versions():
    info = device_info()
    assert info["torch"] == torch.__version__
    assert info["gpu_count"] == torch.cuda.device_count()


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(4))
def test_worker_sees_one_gpu_when_distributed(case):
    """Run with `pytest -n 2 -rP -k worker_sees`: the workers report different GPU UUIDs."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        pytest.skip("only meaningful under pytest-xdist")
    uuid = torch.cuda.get_device_properties(0).uuid
    print(f"{worker}: CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} uuid={uuid}")
    assert torch.cuda.device_count() == 1


RANK_TIMED_BENCH = """
from systems.benchmarking import record_timings

def test_rank_timed(benchmark):
    record_timings(benchmark, [[0.010, 0.030, 0.020], [0.015, 0.010, 0.040]])  # two ranks, three rounds
"""


def test_rank_timings_reach_the_history_as_their_slowest_rank(pytester, monkeypatch):
    """Rounds timed inside spawned ranks: each lasts as long as its slowest rank, in the table and the history."""
    (pytester.path / "bench_ranks.py").write_text(RANK_TIMED_BENCH)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    ran = pytester.runpytest_subprocess("bench_ranks.py", "-p", "no:cacheprovider", "-o", "python_files=bench_*.py",
                                        "--benchmark-json=out.json")
    ran.assert_outcomes(passed=1)
    stats = json.loads((pytester.path / "out.json").read_text())["benchmarks"][0]["stats"]
    assert stats["rounds"] == 3
    assert (stats["min"], stats["median"], stats["max"]) == pytest.approx((0.015, 0.030, 0.040))
