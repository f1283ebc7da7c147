"""What tests/ and benches/ share: the systems-lab plugin (benchmark grids, GPU markers and leases, histories),
Triton's interpreter where there is no GPU, Hypothesis profiles, and fixtures."""

from __future__ import annotations

# The plugin first, also where the package is not installed (its pytest11 entry point loads it where it is):
# under xdist it gives each worker its GPUs and threads, which must precede torch's first look at the GPUs below.
import systems.bench.plugin  # noqa: F401, I001

import os
import zlib

import pytest
import torch
from hypothesis import settings

from systems.parallel.ranks import RankPools

pytest_plugins = ["systems.bench.plugin", "pytester"]
RANK_POOL_TIMEOUT = 900.0  # seconds a collective may wait in a shared rank; each job has its own deadline

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through its interpreter. Triton reads this when it defines a kernel, which
    # systems.attention does on first use: set here, it precedes every test.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# No deadlines: every property test here runs kernels or models, whose time is compute (a first call's
# compilation, the Triton interpreter, the load of `pytest -n`), not a property of the drawn example.
settings.register_profile("dev", max_examples=20, deadline=None)
settings.register_profile("ci", max_examples=25, derandomize=True, deadline=None, print_blob=True)
# More examples where they are cheap: HYPOTHESIS_MAX_EXAMPLES=1000 HYPOTHESIS_PROFILE=gpu for a long search.
settings.register_profile("gpu", max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", 100)), deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random inputs per test, reproducible from the test's id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def rank_pools():
    """Spawned gloo ranks shared by the run's distributed tests (tests/spawned_ranks.py), closed at its end."""
    with RankPools(timeout=RANK_POOL_TIMEOUT) as pools:
        yield pools


@pytest.fixture
def exact_fp32_matmuls():
    """fp32 matmuls without TF32 for one test, so fp32 results can be compared tightly."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


try:
    # Loaded before any test: pytester drops what a test imported when it ends, and matplotlib imported again in
    # part holds two copies of its classes (a later figure refuses the other copy's GridSpec). The report, which
    # imports it on first use, runs in-process inside tests that use pytester.
    import matplotlib.pyplot  # noqa: F401
except ImportError:  # the report's extra is not installed: its tests skip
    pass


@pytest.fixture(scope="session")
def triton_loaded():
    """An inner run records triton's version, so load triton before `pytester` snapshots sys.modules.

    pytester drops what a test imported when the test ends; triton's bindings cannot be loaded twice in one
    process (nanobind aborts), nor unloaded quietly (nanobind reports them leaked at exit).
    """
    import triton  # noqa: F401


@pytest.fixture
def inner_pytest(triton_loaded, pytester, monkeypatch):
    """`pytester` for running pytest inside pytest as a user would, also from an xdist worker, with the plugin.

    The inner run inherits the worker's environment, and pytest-benchmark switches itself off wherever it
    sees PYTEST_XDIST_WORKER: clear xdist's variables so that the inner run benchmarks and saves.
    """
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)
    root = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    # The plugin as a project of a user's would load it; not Hypothesis's, which no inner project uses and whose
    # import costs every inner process (each xdist worker too) about a second.
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p systems.bench.plugin -p no:hypothesispytest")
    return pytester
