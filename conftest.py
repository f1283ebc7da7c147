"""The harness shared by tests/ and benches/: devices, grids, markers, Hypothesis profiles, history metadata."""

from __future__ import annotations

import gc
import json
import os
import pathlib
import subprocess
import zlib


def _pin_xdist_worker_to_gpu() -> None:
    """Give each pytest-xdist worker its own GPU. Must run before torch initializes CUDA."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
    if worker is None:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [g for g in visible.split(",") if g.strip()]
    else:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return
        gpus = out.split()
    if gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[int(worker.removeprefix("gw")) % len(gpus)]


_pin_xdist_worker_to_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; read when kernels are first defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from systems.benchmarking import device_info  # noqa: E402
from systems.model import PRESETS  # noqa: E402

settings.register_profile("dev", max_examples=20)
settings.register_profile("ci", max_examples=25, derandomize=True, deadline=None, print_blob=True)
settings.register_profile("gpu", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def _csv(kind):
    def parse(text: str) -> list:
        return [kind(item) for item in text.split(",") if item.strip()]
    return parse


def pytest_addoption(parser):
    grid = parser.getgroup("systems-lab grids", "what the benchmarks sweep; defaults fit a laptop CPU")
    grid.addoption("--presets", type=_csv(str), default=["tiny"],
                   help=f"model presets, comma-separated, or 'all' ({', '.join(PRESETS)}); default tiny")
    grid.addoption("--contexts", type=_csv(int), default=[128], help="context lengths for the eager model grid")
    grid.addoption("--compile-contexts", type=_csv(int), default=[],
                   help="context lengths at which the model grid also runs under torch.compile")
    grid.addoption("--compile-mode", choices=["regional", "cudagraphs"], default="regional",
                   help="torch.compile block by block (compile time independent of depth), or the whole "
                        "model with CUDA graphs (no launch overhead; compile time grows with depth)")
    grid.addoption("--precisions", type=_csv(str), default=["fp32", "bf16"],
                   help="fp32, bf16 (autocast), bf16-weights (bf16 weights, fp32 master copies in AdamW)")
    grid.addoption("--batch-size", type=int, default=4)
    grid.addoption("--attention", default="sdpa", help="attention backend of the model benchmarks")
    grid.addoption("--warmup-steps", type=int, default=2, help="untimed steps before each timed benchmark")
    grid.addoption("--rounds", type=int, default=5, help="timed rounds per benchmark")
    grid.addoption("--memory-snapshot-dir", default=None,
                   help="write CUDA memory snapshots of a forward pass and a training step here")
    grid.addoption("--benchmark-gate", metavar="EXPR", default=None,
                   help="fail on regressions (e.g. mean:25%%) against the latest saved run of this machine and GPU "
                        "kind, if there is one; otherwise just save this run as the first baseline")

    attn = parser.getgroup("attention benchmarks", "benches/bench_attention.py; defaults fit a laptop CPU")
    attn.addoption("--attn-grid", choices=["tiny", "full"], default="tiny",
                   help="tiny: seq 128,256 x d 16,32 in fp32; full: the issue's grids (handout sweep d 16-128 x "
                        "seq 256-16384; FlashAttention sweep d 16-128 x seq 128-65536 in bf16 and fp32)")
    attn.addoption("--attn-seqs", type=_csv(int), default=None, help="sequence lengths, overriding --attn-grid's")
    attn.addoption("--attn-dims", type=_csv(int), default=None, help="head dims, overriding --attn-grid's")
    attn.addoption("--attn-precisions", type=_csv(str), default=None,
                   help="fp32/bf16/fp16 for the FlashAttention sweep, overriding --attn-grid's")
    attn.addoption("--attn-impls", type=_csv(str), default=None,
                   help="implementations to time, from naive, compiled (torch.compile'd naive), pytorch "
                        "(FlashAttentionPytorch), triton, sdpa; default naive,compiled,triton,sdpa on CUDA "
                        "and naive,pytorch,sdpa on CPU")

    dist_grid = parser.getgroup("distributed benchmarks", "benches/bench_allreduce.py and benches/bench_ddp.py; "
                                "defaults fit a laptop CPU (gloo, 2 ranks)")
    dist_grid.addoption("--world-sizes", type=_csv(int), default=[2], help="numbers of ranks, e.g. 2,4,6")
    dist_grid.addoption("--allreduce-backends", type=_csv(str), default=["gloo"],
                        help="gloo (CPU tensors) and/or nccl (one GPU per rank)")
    dist_grid.addoption("--allreduce-sizes-mb", type=_csv(float), default=[1.0, 10.0],
                        help="float32 tensor sizes in MiB, e.g. 1,10,100,1024")
    dist_grid.addoption("--ddp-preset", default="tiny", help="model preset of the DDP and sharded-optimizer benchmarks "
                        "(with --batch-size per rank, --contexts, --precisions, --warmup-steps, --rounds)")
    dist_grid.addoption("--bucket-sizes-mb", type=_csv(float), default=[1.0, 10.0],
                        help="DDPBucketed bucket sizes in MiB, e.g. 1,10,100,1000")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "multigpu(n): needs at least n CUDA GPUs")
    config.addinivalue_line("markers", "slow: takes minutes; deselect with -m 'not slow'")
    if config.getoption("presets") == ["all"]:
        config.option.presets = list(PRESETS)
    unknown = set(config.getoption("presets")) - set(PRESETS)
    if unknown:
        raise pytest.UsageError(f"unknown presets {sorted(unknown)}; choose from {list(PRESETS)}")
    _configure_gate(config)


def _configure_gate(config) -> None:
    """Turn --benchmark-gate into pytest-benchmark's compare flags only where a baseline exists.

    Runs before pytest-benchmark reads its options (its pytest_configure is trylast).
    """
    expr = config.getoption("benchmark_gate")
    if expr is None:
        return
    from pytest_benchmark.utils import get_machine_id, get_tag, parse_compare_fail

    storage = config.getoption("benchmark_storage").removeprefix("file://")
    # One Python/OS folder holds the runs of every GPU kind (H100 and H200 alike): compare like with like.
    gpu = device_info()["gpu"]
    baselines = [path for path in sorted((config.rootpath / storage / get_machine_id()).glob("*.json"))
                 if _saved_gpu(path) == gpu]
    config.option.benchmark_autosave = get_tag()
    if baselines:
        config.option.benchmark_compare = baselines[-1].name.split("_")[0]
        config.option.benchmark_compare_fail = [parse_compare_fail(expr)]
    else:
        print(f"benchmark gate: no baseline for {get_machine_id()} on {gpu or 'CPU'} yet; this run becomes it")


def _saved_gpu(history: pathlib.Path) -> str | None:
    """The GPU a saved run was timed on (None for a CPU run)."""
    return json.loads(history.read_text())["machine_info"].get("systems_lab", {}).get("gpu")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count()
    for item in items:
        if item.get_closest_marker("gpu") and gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        marker = item.get_closest_marker("multigpu")
        if marker and gpus < marker.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"needs {marker.args[0]} GPUs, found {gpus}"))


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def rank_pools():
    """Spawned process groups kept for a whole module, one per (world size, backend): the distributed
    benchmarks pay for spawning and rendezvous once, not per point."""
    from systems.distributed import RankPools

    with RankPools(timeout=600) as pools:
        yield pools


@pytest.fixture
def exact_fp32_matmuls():
    """fp32 matmuls without TF32 for one test, so fp32 results can be compared tightly."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random inputs per test, reproducible from the test's id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


# Out-of-memory grid points are results: skipped with the reason and listed in the saved history.
_OOM_KEY = pytest.StashKey[list]()


@pytest.fixture
def skip_on_oom(request):
    """`with skip_on_oom:` turns a CUDA out-of-memory error into a recorded skip."""
    return _OutOfMemoryGuard(request)


class _OutOfMemoryGuard:
    def __init__(self, request):
        self.request = request

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None or not issubclass(exc_type, torch.OutOfMemoryError):
            return False
        message = str(exc).splitlines()[0]
        del exc, tb  # the traceback pins the tensors; drop it before freeing the cache
        gc.collect()
        torch.cuda.empty_cache()
        self.request.config.stash.setdefault(_OOM_KEY, []).append(
            {"name": self.request.node.name, "fullname": self.request.node.nodeid, "error": message})
        pytest.skip(f"out of memory: {message}")


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["systems_lab"] = device_info()


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json["out_of_memory"] = config.stash.get(_OOM_KEY, [])
