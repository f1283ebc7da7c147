"""The shared harness: GPU pinning of xdist workers and the history metadata."""

import os

import pytest
import torch

import conftest
from systems.benchmarking import device_info


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
