"""The shared harness: the GPUs of xdist workers, multi-GPU tests under `pytest -n`, grid options and the
history metadata."""

import json
import os
import pathlib

import pytest
import torch
from hypothesis import settings

import conftest
from systems.attention import BENCHED_BACKENDS
from systems.bench.timing import device_info
from systems.parallel.ranks import BACKENDS
from systems.model import ATTENTION_BACKENDS, PRESETS
from systems.precision import DTYPES, PRECISIONS

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("worker", "workers", "visible", "expected"), [
    (0, 2, "3,5", "3,5"),
    (1, 2, "3,5", "5,3"),
    (2, 3, "3,5", "3,5"),  # more workers than GPUs: they share, round robin
    (1, 4, "0,1,2,3,4,5,6,7", "2,3,4,5,6,7,0,1"),  # 2 GPUs per worker, its own first
    (2, 3, "0,1,2,3,4,5,6,7", "4,5,6,7,0,1,2,3"),
    (0, 1, "0,1", "0,1"),
    (1, 2, "GPU-aaaa,GPU-bbbb", "GPU-bbbb,GPU-aaaa"),
    (1, 2, "", ""),
])
def test_an_xdist_worker_sees_every_gpu_its_share_first(worker, workers, visible, expected):
    gpus = [gpu for gpu in visible.split(",") if gpu]
    assert conftest.worker_gpus(worker, workers, gpus) == [gpu for gpu in expected.split(",") if gpu]


def test_xdist_workers_are_pinned_from_their_environment(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    conftest._pin_xdist_worker_to_gpus()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,3"


def test_outside_xdist_nothing_is_pinned(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    conftest._pin_xdist_worker_to_gpus()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_property_tests_have_no_deadline():
    """Their time is compute, stretched by the load of `pytest -n`: a deadline would fail them at random."""
    assert settings().deadline is None


def test_device_info_names_versions():
    info = device_info()
    assert info["torch"] == torch.__version__
    assert info["gpu_count"] == torch.cuda.device_count()


def choices(names) -> str:
    return "choose from " + ", ".join(names)


@pytest.mark.parametrize("option, message", [
    ("--attn-impls=naive,tritno", f"--attn-impls: unknown 'tritno'; {choices(BENCHED_BACKENDS)}"),
    ("--attn-precisions=fp8", f"--attn-precisions: unknown 'fp8'; {choices(DTYPES)}"),
    ("--precisions=fp32,fp8", f"--precisions: unknown 'fp8'; {choices(PRECISIONS)}"),
    ("--presets=huge", f"--presets: unknown 'huge'; {choices(PRESETS)}"),
    ("--ddp-preset=nope", f"--ddp-preset: unknown 'nope'; {choices(PRESETS)}"),
    ("--attention=flsh", f"--attention: unknown 'flsh'; {choices(ATTENTION_BACKENDS)}"),
    ("--allreduce-backends=mpi", f"--allreduce-backends: unknown 'mpi'; {choices(BACKENDS)}"),
    ("--world-sizes=0", "--world-sizes: 0 is not positive"),
    ("--world-sizes=2,-2", "--world-sizes: -2 is not positive"),
    ("--contexts=-5", "--contexts: -5 is not positive"),
    ("--compile-contexts=0", "--compile-contexts: 0 is not positive"),
    ("--attn-seqs=0", "--attn-seqs: 0 is not positive"),
    ("--attn-dims=0", "--attn-dims: 0 is not positive"),
    ("--batch-size=0", "--batch-size: 0 is not positive"),
    ("--rounds=0", "--rounds: 0 is not positive"),
    ("--warmup-steps=-1", "--warmup-steps: -1 is not zero or more"),
    ("--allreduce-sizes-mb=0", "--allreduce-sizes-mb: 0.0 is not positive"),
    ("--bucket-sizes-mb=1,nan", "--bucket-sizes-mb: nan is not positive"),
    ("--bucket-sizes-mb=-1", "--bucket-sizes-mb: -1.0 is not positive"),
    ("--contexts=,", "--contexts: no values given"),
    ("--contexts=128,12x", "--contexts: '128,12x' is not a comma-separated list of ints"),
])
def test_a_bad_grid_option_is_a_usage_error_at_start_up(inner_pytest, option, message):
    inner_pytest.makepyfile(test_nothing="def test_nothing(): pass")
    ran = inner_pytest.runpytest(option, "--collect-only", "-p", "no:cacheprovider", plugins=[conftest])
    assert ran.ret == pytest.ExitCode.USAGE_ERROR
    assert message in ran.stderr.str()


def test_good_grid_options_collect(inner_pytest):
    """Guards the test above against a check that refuses everything."""
    inner_pytest.makepyfile(test_nothing="def test_nothing(): pass")
    ran = inner_pytest.runpytest("--presets=all", "--compile-contexts=", "--attn-impls=" + ",".join(BENCHED_BACKENDS),
                                 "--warmup-steps=0", "--bucket-sizes-mb=0.5,100", "--collect-only",
                                 "-p", "no:cacheprovider", plugins=[conftest])
    assert ran.ret == pytest.ExitCode.OK, ran.stderr.str()


# Run with xdist's --dist each, so that both workers run every multi-GPU test: the turns are always tested.
MULTI_GPU_TESTS = """
import os, time
import pytest

KINDS = {{"single": (), "fits": pytest.mark.multigpu({gpus}), "too_many": pytest.mark.multigpu({gpus} + 1)}}

@pytest.mark.parametrize("kind", [pytest.param(kind, marks=marks, id=f"{{kind}}{{i}}")
                                  for i in range(4) for kind, marks in KINDS.items()])
def test_point(kind):
    if kind == "fits":
        running = os.open({running!r}, os.O_CREAT | os.O_EXCL)  # fails while another multi-GPU test runs
        time.sleep(0.5)
        os.close(running)
        os.remove({running!r})
"""


def test_multi_gpu_tests_take_turns_under_xdist_and_the_summary_names_those_that_could_not_run(inner_pytest):
    """`pytest -n 2` with the repository's conftest.py."""
    gpus = torch.cuda.device_count()  # what the inner run's workers see too (worker_gpus)
    inner_pytest.makeconftest((ROOT / "conftest.py").read_text())
    inner_pytest.makepyfile(test_points=MULTI_GPU_TESTS.format(gpus=gpus, running=str(inner_pytest.path / "running")))
    ran = inner_pytest.runpytest_subprocess("test_points.py", "-n", "2", "--dist", "each", "-v",
                                            "-p", "no:cacheprovider")
    ran.assert_outcomes(passed=16, skipped=8)  # each worker: 4 single-GPU, 4 that fit, 4 that need too many
    ran.stdout.re_match_lines([r"=+ multi-GPU tests =+", r"8 ran, 8 could not run",
                               rf"  8 needs {gpus + 1} GPUs, this machine has {gpus}: test_points.py"])


WORKER_GPUS = """
import json, os, pytest, torch
from systems.parallel.ranks import launch

@pytest.mark.parametrize("n", range(8))
def test_record_gpus(n):
    record = dict(visible=os.environ["CUDA_VISIBLE_DEVICES"], count=torch.cuda.device_count(),
                  uuid=str(torch.cuda.get_device_properties(0).uuid))
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


@pytest.mark.gpu
def test_xdist_workers_see_every_gpu_their_own_first_and_run_multi_gpu_tests(inner_pytest):
    """`pytest -n 2` here: each worker's cuda:0 is its own GPU (distinct where there are two), each sees
    every GPU, and a two-rank NCCL test runs wherever there are two GPUs. Print the GPUs with -rP."""
    visible = conftest._visible_gpus()  # what the inner run inherits
    gpus = len(visible)
    inner_pytest.makeconftest((ROOT / "conftest.py").read_text())
    inner_pytest.makepyfile(test_gpus=WORKER_GPUS.format(folder=str(inner_pytest.path)))
    ran = inner_pytest.runpytest_subprocess("test_gpus.py", "-n", "2", "-p", "no:cacheprovider")
    multi_gpu_ran = gpus >= 2
    ran.assert_outcomes(passed=8 + multi_gpu_ran, skipped=1 - multi_gpu_ran)
    ran.stdout.fnmatch_lines([f"{int(multi_gpu_ran)} ran, {1 - int(multi_gpu_ran)} could not run"])
    records = {path.stem: json.loads(path.read_text()) for path in inner_pytest.path.glob("gw*.json")}
    assert records.keys() == {"gw0", "gw1"}
    for worker, record in records.items():
        print(f"{worker}: {record}")
        expected = conftest.worker_gpus(int(worker.removeprefix("gw")), 2, visible)
        assert record["visible"] == ",".join(expected) and record["count"] == gpus
        assert record["uuid"] == str(torch.cuda.get_device_properties(visible.index(expected[0])).uuid)
    if multi_gpu_ran:
        assert records["gw0"]["uuid"] != records["gw1"]["uuid"]


RANK_TIMED_BENCH = """
from systems.bench.timing import record_timings

def test_rank_timed(benchmark):
    record_timings(benchmark, [[0.010, 0.030, 0.020], [0.015, 0.010, 0.040]])  # two ranks, three rounds
"""


def test_rank_timings_reach_the_history_as_their_slowest_rank(inner_pytest):
    """Rounds timed inside spawned ranks: each lasts as long as its slowest rank, in the table and the history."""
    (inner_pytest.path / "bench_ranks.py").write_text(RANK_TIMED_BENCH)
    ran = inner_pytest.runpytest_subprocess("bench_ranks.py", "-p", "no:cacheprovider", "-o",
                                            "python_files=bench_*.py", "--benchmark-json=out.json")
    ran.assert_outcomes(passed=1)
    stats = json.loads((inner_pytest.path / "out.json").read_text())["benchmarks"][0]["stats"]
    assert stats["rounds"] == 3
    assert (stats["min"], stats["median"], stats["max"]) == pytest.approx((0.015, 0.030, 0.040))
