"""The harness shared by tests/ and benches/: devices, grids, markers, Hypothesis profiles, history metadata."""

from __future__ import annotations

import argparse
import gc
import math
import os
import pathlib
import subprocess
import zlib
from collections import defaultdict


def worker_gpus(worker: int, workers: int, gpus: list[str]) -> list[str]:
    """The GPUs that pytest-xdist worker `worker` of `workers` sees, as CUDA_VISIBLE_DEVICES lists them.

    Each worker owns a share of len(gpus) // workers GPUs (at least one; more workers than GPUs share them
    round robin) and sees it first, so single-GPU tests, which run on cuda:0, of different workers land
    on different GPUs. It sees the other GPUs after its share: a multi-GPU test spawns one rank per GPU
    from the worker's list, starting with its share, and the machine's real GPU count decides its skip.
    """
    if not gpus:
        return []
    share = max(1, len(gpus) // workers)
    start = worker * share % len(gpus)
    return gpus[start:] + gpus[:start]


def _visible_gpus() -> list[str]:
    """The GPUs this run may use, without initializing CUDA: CUDA_VISIBLE_DEVICES, else nvidia-smi's."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [gpu.strip() for gpu in visible.split(",") if gpu.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return out.split()


def _pin_xdist_worker_to_gpus() -> None:
    """Order the GPUs of a pytest-xdist worker as worker_gpus says. Must run before torch initializes CUDA."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
    if worker is None:
        return
    gpus = worker_gpus(int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]), _visible_gpus())
    if gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)


_pin_xdist_worker_to_gpus()

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402
from pytest_benchmark.utils import get_tag, parse_compare_fail  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through its interpreter. Triton reads this when it defines a kernel, which
    # systems.attention does on first use: set here, it precedes every test.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from systems.accounting import SCHEMES  # noqa: E402
from systems.attention import BENCHED_BACKENDS  # noqa: E402
from systems.bench.timing import device_info  # noqa: E402
from systems.parallel.fsdp import Gather  # noqa: E402
from systems.parallel.ranks import BACKENDS  # noqa: E402
from systems.bench.gate import RevisionGate  # noqa: E402
from systems.bench.history import Histories  # noqa: E402
from systems.bench.schema import POINT  # noqa: E402
from systems.model import ATTENTION_BACKENDS, PRESETS  # noqa: E402
from systems.parallel.train import VARIANTS  # noqa: E402
from systems.precision import DTYPES, PRECISIONS  # noqa: E402

pytest_plugins = ["pytester"]

# No deadlines: every property test here runs kernels or models, whose time is compute (a first call's
# compilation, the Triton interpreter, the load of `pytest -n`), not a property of the drawn example.
settings.register_profile("dev", max_examples=20, deadline=None)
settings.register_profile("ci", max_examples=25, derandomize=True, deadline=None, print_blob=True)
# More examples where they are cheap: HYPOTHESIS_MAX_EXAMPLES=1000 HYPOTHESIS_PROFILE=gpu for a long search.
settings.register_profile("gpu", max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", 100)), deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def _csv(kind):
    def parse(text: str) -> list:
        try:
            return [kind(item) for item in text.split(",") if item.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__}s") from None
    return parse


LOSSES = ("full", "chunked")  # cross-entropy from the whole logits, or --loss-chunk tokens at a time
# What each grid option may hold, checked once at start-up: names from where they are defined, or numbers in range.
GRID_CHOICES = {"presets": PRESETS, "precisions": PRECISIONS, "attention": ATTENTION_BACKENDS,
                "attn_precisions": DTYPES, "attn_impls": BENCHED_BACKENDS, "allreduce_backends": BACKENDS,
                "ddp_preset": PRESETS, "fsdp_preset": PRESETS, "checkpoint": [s for s in SCHEMES if s != "blocks"],
                "fullstep_preset": PRESETS, "fullstep_variant": VARIANTS, "loss": LOSSES, "fsdp_gather": list(Gather)}
_POSITIVE = ("positive", lambda x: x > 0 and math.isfinite(x))
GRID_NUMBERS = {"contexts": _POSITIVE, "compile_contexts": _POSITIVE, "batch_size": _POSITIVE, "rounds": _POSITIVE,
                "warmup_steps": ("zero or more", lambda x: x >= 0), "attn_seqs": _POSITIVE, "attn_dims": _POSITIVE,
                "world_sizes": _POSITIVE, "allreduce_sizes_mb": _POSITIVE, "bucket_sizes_mb": _POSITIVE,
                "checkpoint_blocks": _POSITIVE, "max_context": _POSITIVE, "loss_chunk": _POSITIVE,
                "fsdp_prefetch": _POSITIVE}
# Elsewhere an empty list would leave a grid with no points.
EMPTY_MEANS_NONE = {"compile_contexts", "checkpoint_blocks"}


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
    grid.addoption("--benchmark-gate", metavar="EXPR", type=parse_compare_fail, default=None,
                   help="fail on regressions (e.g. median:5%%): each point against the newest complete saved run of "
                        "this machine and GPU kind that holds it (a first run just saves itself), or with "
                        "--benchmark-gate-against against a revision timed in the same job")
    grid.addoption("--benchmark-gate-against", metavar="REV", default=None,
                   help="time git revision REV (checked out in a temporary worktree) and the working tree in turns, "
                        "and gate the working tree against REV")
    grid.addoption("--benchmark-gate-turns", metavar="K", type=int, default=3,
                   help="turns of --benchmark-gate-against, each running the benchmarks once in either tree; "
                        "default 3")

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
    dist_grid.addoption("--fsdp-preset", default="tiny", help="model preset of benches/bench_fsdp.py (with "
                        "--batch-size per rank, --contexts, --precisions, --world-sizes); the issue's point: xl")
    dist_grid.addoption("--fsdp-prefetch", type=_csv(int), default=[1],
                        help="all-gathers our FSDP keeps in flight ahead of the computing layer, e.g. 1,2,5")
    dist_grid.addoption("--fsdp-gather", type=_csv(str), default=["block"],
                        help="what one of our FSDP's collectives covers: layer (each weight, the handout's) "
                             "and/or block (a Transformer block's weights, FSDP2's)")
    dist_grid.addoption("--bucket-sizes-mb", type=_csv(float), default=[1.0, 10.0],
                        help="DDPBucketed bucket sizes in MiB, e.g. 1,10,100,1000")


    ckpt = parser.getgroup("checkpointing benchmarks", "benches/bench_checkpoint.py (with --presets, --contexts, "
                           "--precisions, --batch-size, --attention, --warmup-steps, --rounds); defaults fit a CPU")
    ckpt.addoption("--checkpoint-blocks", type=_csv(int), default=[1],
                   help="segment sizes of one-level checkpointing to sweep, e.g. 1,2,4,8 (empty: none)")
    ckpt.addoption("--checkpoint", type=_csv(str), default=["none", "nested"],
                   help="none (every activation kept) and/or nested (the two-level scheme of least peak memory)")
    ckpt.addoption("--max-context", type=int, default=256,
                   help="the context search doubles from the first of --contexts up to this, or out of memory")

    full = parser.getgroup("full-step benchmarks", "benches/bench_fullstep.py (with --contexts, --precisions, "
                           "--batch-size per rank, --world-sizes, --attention, --checkpoint-blocks, --warmup-steps, "
                           "--rounds); the default is the leaderboard's shape made tiny, on 2 gloo ranks")
    full.addoption("--fullstep-preset", default="leaderboard-2026-tiny",
                   help="model preset; the issue's: leaderboard-2026 (with --contexts 32768 --batch-size 1 "
                        "--precisions bf16 --loss-chunk 4096)")
    full.addoption("--fullstep-variant", default="fsdp", help=f"how ranks share the step: {', '.join(VARIANTS)}")
    full.addoption("--loss", default="chunked", help="cross-entropy from the whole logits (full) or --loss-chunk "
                   "tokens at a time (chunked)")
    full.addoption("--loss-chunk", type=int, default=48, help="tokens per chunk of the chunked cross-entropy")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "multigpu(n): needs at least n CUDA GPUs")
    config.addinivalue_line("markers", "slow: takes minutes; deselect with -m 'not slow'")
    if config.getoption("presets") == ["all"]:
        config.option.presets = list(PRESETS)
    _check_grid_options(config)
    _configure_gate(config)


def _check_grid_options(config) -> None:
    """A bad grid option is a usage error at start-up, not a grid that runs nothing or fails every point."""
    for name in [*GRID_CHOICES, *GRID_NUMBERS]:
        flag, value = "--" + name.replace("_", "-"), config.getoption(name)
        if value is None:  # an --attn-* option left to --attn-grid
            continue
        if value == [] and name not in EMPTY_MEANS_NONE:
            raise pytest.UsageError(f"{flag}: no values given")
        for item in value if isinstance(value, list) else [value]:
            if name in GRID_CHOICES and item not in GRID_CHOICES[name]:
                raise pytest.UsageError(f"{flag}: unknown {item!r}; choose from {', '.join(GRID_CHOICES[name])}")
            if name in GRID_NUMBERS and not GRID_NUMBERS[name][1](item):
                raise pytest.UsageError(f"{flag}: {item!r} is not {GRID_NUMBERS[name][0]}")


def _configure_gate(config) -> None:
    """Register the plugins that save histories safely (partial runs marked) and, with --benchmark-gate, gate.

    Runs before pytest-benchmark reads its options (its pytest_configure is trylast).
    """
    check, against = config.getoption("benchmark_gate"), config.getoption("benchmark_gate_against")
    if against is not None and check is None:
        raise pytest.UsageError("--benchmark-gate-against needs --benchmark-gate EXPR, e.g. median:5%")
    if check is not None:
        if config.getoption("dist", "no") != "no":
            raise pytest.UsageError("--benchmark-gate needs a run without -n: pytest-benchmark times nothing "
                                    "under xdist")
        config.option.benchmark_autosave = get_tag()
    if against is not None:
        config.pluginmanager.register(RevisionGate(config, against, config.getoption("benchmark_gate_turns"), check),
                                      "systems-lab-revision-gate")
    # One Python/OS folder holds the runs of every GPU kind (H100 and H200 alike): compare like with like.
    history_gate = check if against is None else None
    gpu = device_info()["gpu"] if history_gate else None
    config.pluginmanager.register(Histories(history_gate, gpu), "systems-lab-histories")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count()  # the machine's: an xdist worker sees every GPU (worker_gpus)
    for item in items:
        if item.get_closest_marker("gpu") and gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        marker = item.get_closest_marker("multigpu")
        if marker and gpus < marker.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"needs {marker.args[0]} GPUs, this machine has {gpus}"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item):
    """Under `pytest -n`, multi-GPU tests take turns across the workers, their fixtures' set-up included:
    each spawns a process group over GPUs that another one's would share. (xdist's loadgroup would send
    them to one worker, but does not group under pytest 9.2: pytest-xdist issue 1386.)"""
    if item.get_closest_marker("multigpu") is None or "PYTEST_XDIST_WORKER" not in os.environ:
        return (yield)
    import fcntl

    # The workers' temporary folders, popen-gw0, popen-gw1, ..., share the run's folder.
    with open(pathlib.Path(item.config.option.basetemp).parent / "multigpu.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the worker dies
        return (yield)


def pytest_terminal_summary(terminalreporter):
    """How many multi-GPU tests ran, and why the others could not: a skip here is not a pass."""
    reports = [report for reports in terminalreporter.stats.values() for report in reports
               if isinstance(report, pytest.TestReport) and "multigpu" in report.keywords]
    ran = sum(report.when == "call" and not report.skipped for report in reports)
    not_run = defaultdict(list)  # reason: node ids
    for report in reports:
        if report.skipped:
            not_run[report.longrepr[2].removeprefix("Skipped: ")].append(report.nodeid)
    if ran or not_run:
        terminalreporter.section("multi-GPU tests")
        terminalreporter.line(f"{ran} ran, {sum(map(len, not_run.values()))} could not run")
        for reason, nodeids in not_run.items():
            files = sorted({nodeid.split("::")[0] for nodeid in nodeids})
            terminalreporter.line(f"  {len(nodeids)} {reason}: {', '.join(files)}")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def rank_pools():
    """Spawned process groups kept for a whole module, one per (world size, backend): the distributed
    benchmarks pay for spawning and rendezvous once, not per point."""
    from systems.parallel.ranks import RankPools

    with RankPools(timeout=600) as pools:
        yield pools


@pytest.fixture
def exact_fp32_matmuls():
    """fp32 matmuls without TF32 for one test, so fp32 results can be compared tightly."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.fixture
def inner_pytest(pytester, monkeypatch):
    """`pytester` for running pytest inside pytest as a user would, also from an xdist worker.

    The inner run inherits the worker's environment, and pytest-benchmark switches itself off wherever it
    sees PYTEST_XDIST_WORKER: clear xdist's variables so that the inner run benchmarks and saves.
    """
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)
    root = pathlib.Path(__file__).resolve().parent
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    return pytester


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
        record = {"name": self.request.node.name, "fullname": self.request.node.nodeid, "error": message}
        benchmark = self.request.node.funcargs.get("benchmark")
        if benchmark is not None and POINT in benchmark.extra_info:  # the point, as its result would hold it
            record[POINT] = benchmark.extra_info[POINT]
        self.request.config.stash.setdefault(_OOM_KEY, []).append(record)
        pytest.skip(f"out of memory: {message}")


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["systems_lab"] = device_info()


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json["out_of_memory"] = config.stash.get(_OOM_KEY, [])
