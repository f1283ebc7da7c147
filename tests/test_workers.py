"""`pytest -n N`: each worker's and spawned rank's share of the cores, GPU tests that could not run named in the
summary, benchmarks refused without GPUs, and on a GPU host items holding their GPUs alone and every worker's
benchmarks saved as one history. The GPU runs are inner pytest runs over the GPUs this test holds.

The other inner runs run in this process, an inner `-n`'s controller too: its workers are processes of their own
either way, and each process spared is a start of torch. The GPU runs keep a process of their own, as torch here
has seen every GPU of the host, not only the ones this test holds (a lease narrows them for child processes)."""

import json
import os
from pathlib import Path

import pytest
import torch
from pytest_benchmark.stats import Metadata

from systems.bench.leases import visible_gpus, worker_gpus
from systems.bench.workers import _metadata
from systems.parallel.ranks import launch

HARDWARE = """
import pytest

@pytest.mark.gpu
def test_needs_a_gpu(): pass

@pytest.mark.multigpu(64)
def test_needs_many(): pass

def test_cpu(): pass
"""


def test_the_summary_names_the_gpu_tests_that_could_not_run_and_why(inner_pytest):
    inner_pytest.makepyfile(test_hardware=HARDWARE)
    ran = inner_pytest.runpytest_inprocess("-p", "no:cacheprovider")
    gpus = torch.cuda.device_count()
    ran.assert_outcomes(passed=1 + (gpus > 0), skipped=2 - (gpus > 0))
    ran.stdout.re_match_lines([r"=+ GPU tests =+", rf"{int(gpus > 0)} ran, {2 - (gpus > 0)} could not run",
                               rf"  1 needs 64 GPUs, this machine has {gpus}: test_hardware.py"])


THREADS = """
import json, os, torch

def test_threads():
    budgets = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")
    with open(os.environ["PYTEST_XDIST_WORKER"] + ".json", "w") as file:
        json.dump([torch.get_num_threads(), *map(os.environ.get, budgets)], file)
"""
WORKER_BUDGETS = {"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4", "TORCHINDUCTOR_COMPILE_THREADS": "4"}


def rank_threads() -> list:
    from torch._inductor import config  # the size of Inductor's pool of compile workers

    return [torch.get_num_threads(), os.environ["OMP_NUM_THREADS"], config.compile_threads]


def test_workers_and_their_ranks_use_their_share_of_the_cores(inner_pytest, monkeypatch):
    """Two workers each get half the cores, and a two-rank group a worker spawns half of that: as torch's threads,
    as the budgets a worker hands down (OpenMP's, MKL's, Inductor's; Inductor reads its own where it is first used)
    and as a rank's pool of Inductor's compile workers. A budget of 8 cores, as a parent would hand down, so that
    every share differs whatever this host has."""
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    inner_pytest.makepyfile(test_threads=THREADS)
    ran = inner_pytest.runpytest_inprocess("-n", "2", "--dist", "each", "-p", "no:cacheprovider")
    ran.assert_outcomes(passed=2)
    for worker in ("gw0", "gw1"):
        assert json.loads((inner_pytest.path / f"{worker}.json").read_text()) == [4, *WORKER_BUDGETS.values()]
    # A worker's ranks, spawned from this process as a worker is: ranks fork from a server that this process has
    # mostly started already, for an earlier test's ranks, where a worker would start its own.
    for name, budget in WORKER_BUDGETS.items():
        monkeypatch.setenv(name, budget)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        assert launch(rank_threads, 2) == [[2, "2", 2]] * 2
    finally:
        torch.set_num_threads(threads)


CPU_BENCH = """
def test_sum(benchmark):
    benchmark(sum, range(100))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host benchmarks run under -n")
def test_benchmarks_under_xdist_without_gpus_are_refused_before_anything_runs(inner_pytest):
    inner_pytest.makepyfile(test_bench=CPU_BENCH)
    # One worker: what is refused is any worker's timing, and each worker is a start of torch.
    refused = inner_pytest.runpytest_inprocess("-n", "1", "-p", "no:cacheprovider")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stdout.fnmatch_lines(["*benchmarks under -n need GPUs, each point timed on its own*"])
    assert "passed" not in refused.stdout.str()
    untimed = inner_pytest.runpytest_inprocess("-n", "1", "--benchmark-disable", "-p", "no:cacheprovider")
    untimed.assert_outcomes(passed=1)


def test_a_workers_benchmark_reaches_the_controller_as_it_was_timed(inner_pytest):
    """What a worker sends (pytest-benchmark's own record, its rounds included) becomes the controller's record of
    the same benchmark: the history written from it is the one a serial run writes."""
    inner_pytest.makepyfile(test_bench=CPU_BENCH + "    benchmark.extra_info['x'] = 1\n")
    # Timed briefly: thousands of rounds still, each of several iterations, and what counts is their record.
    inner_pytest.runpytest_inprocess("-p", "no:cacheprovider", "--benchmark-max-time=0.05",
                                     "--benchmark-json=serial.json").assert_outcomes(passed=1)
    [saved] = json.loads((inner_pytest.path / "serial.json").read_text())["benchmarks"]
    metadata = _metadata(saved)
    assert isinstance(metadata, Metadata) and metadata.fullname == saved["fullname"]
    assert metadata.as_dict(include_data=True) == saved


GPU_POINTS = """
import json, os, time, pytest, torch

@pytest.mark.parametrize("n", range(6))
def test_point(benchmark, device, n):
    start = time.time()
    x = torch.randn(2048, 2048, device=device)
    benchmark.pedantic(lambda: (x @ x, torch.cuda.synchronize()), rounds=20)
    benchmark.extra_info.update(gpu=str(torch.cuda.get_device_properties(device).uuid), start=start, end=time.time())

@pytest.mark.multigpu(2)
def test_pair(benchmark):
    start = time.time()
    benchmark.pedantic(time.sleep, args=(0.01,), rounds=5)
    benchmark.extra_info.update(gpus=os.environ["CUDA_VISIBLE_DEVICES"], start=start, end=time.time())
"""


@pytest.mark.multigpu(2)
def test_benchmarks_under_xdist_hold_their_gpus_and_save_one_history(inner_pytest):
    """`pytest -n 2` over two GPUs: single-GPU points of the two workers run on distinct GPUs, never two on one
    GPU at once nor beside the pair, and the controller saves every worker's points as one history."""
    inner_pytest.makepyfile(test_gpu_points=GPU_POINTS)
    ran = inner_pytest.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", "--benchmark-autosave")
    ran.assert_outcomes(passed=7)
    [history] = (inner_pytest.path / ".benchmarks").glob("*/*.json")
    saved = json.loads(history.read_text())
    assert saved["systems_lab_complete"] is True
    points = {bench["name"]: bench["extra_info"] for bench in saved["benchmarks"]}
    assert sorted(points) == sorted([f"test_point[{n}]" for n in range(6)] + ["test_pair"])
    by_gpu = {}
    for name, info in points.items():
        for gpu in [info["gpu"]] if "gpu" in info else ["all"]:
            by_gpu.setdefault(gpu, []).append((info["start"], info["end"]))
    assert len(by_gpu) == 3  # two GPUs, and the pair holding both
    spans = sorted(span for spans in by_gpu.values() for span in spans if spans is not by_gpu["all"])
    pair = by_gpu["all"][0]
    assert all(end <= pair[0] or start >= pair[1] for start, end in spans)
    for gpu, gpu_spans in by_gpu.items():
        gpu_spans.sort()
        assert all(end <= next_start for (_, end), (next_start, _) in zip(gpu_spans, gpu_spans[1:])), gpu


WORKER_GPUS = """
import json, os, pytest, torch
from systems.parallel.ranks import launch

@pytest.mark.parametrize("n", range(8))
def test_record_gpus(device, n):
    record = dict(visible=os.environ["CUDA_VISIBLE_DEVICES"], count=torch.cuda.device_count(),
                  uuid=str(torch.cuda.get_device_properties(device).uuid))
    with open(os.path.join({folder!r}, os.environ["PYTEST_XDIST_WORKER"] + ".json"), "w") as file:
        json.dump(record, file)

def all_reduce_ones():
    import torch.distributed as dist
    ones = torch.ones(1, device="cuda")
    dist.all_reduce(ones)
    return ones.item()

@pytest.mark.multigpu(2)
def test_nccl_pair():
    assert launch(all_reduce_ones, 2, backend="nccl", timeout=120) == [2.0, 2.0]
"""


@pytest.mark.multigpu(2)
def test_xdist_workers_see_every_gpu_their_own_first_and_run_multi_gpu_tests(inner_pytest):
    """`pytest -n 2` over two GPUs: each worker's cuda:0 is its own GPU, each sees both, and a two-rank NCCL test
    runs on the pair it holds. Print the GPUs with -rP."""
    visible = visible_gpus()  # what the inner run sees: the GPUs this test holds under -n, else the host's
    inner_pytest.makepyfile(test_gpus=WORKER_GPUS.format(folder=str(inner_pytest.path)))
    ran = inner_pytest.runpytest_subprocess("test_gpus.py", "-n", "2", "-p", "no:cacheprovider")
    ran.assert_outcomes(passed=9)
    records = {path.stem: json.loads(path.read_text()) for path in Path(inner_pytest.path).glob("gw*.json")}
    assert records.keys() == {"gw0", "gw1"}
    for worker, record in records.items():
        print(f"{worker}: {record}")
        home = worker_gpus(int(worker.removeprefix("gw")), 2, visible)[0]
        assert record["visible"].split(",")[0] == home and record["count"] == len(visible)
    assert records["gw0"]["uuid"] != records["gw1"]["uuid"]
