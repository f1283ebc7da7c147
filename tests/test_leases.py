"""Sharing a host between xdist workers: each worker's GPUs and threads, how many GPUs an item holds, and the GPU
locks that make a lease exclusive without deadlocks (checked with processes contending for made-up GPUs)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from systems.bench import leases
from systems.bench.leases import GpuLocks, lease_size, thread_share, worker_gpus

ROOT = Path(__file__).resolve().parents[1]
EIGHT = [str(gpu) for gpu in range(8)]


@pytest.mark.parametrize(("worker", "workers", "visible", "expected"), [
    (0, 2, "3,5", "3,5"),
    (1, 2, "3,5", "5,3"),
    (2, 3, "3,5", "3,5"),  # more workers than GPUs: they share, round robin
    (0, 1, "0,1", "0,1"),
    (1, 2, "GPU-aaaa,GPU-bbbb", "GPU-bbbb,GPU-aaaa"),
    (1, 2, "", ""),
])
def test_an_xdist_worker_sees_every_gpu_its_home_first(worker, workers, visible, expected):
    gpus = [gpu for gpu in visible.split(",") if gpu]
    assert worker_gpus(worker, workers, gpus) == [gpu for gpu in expected.split(",") if gpu]


# On 8 GPUs: each worker's home (its first GPU) and the GPUs a multigpu(2), (4) and (8) item of it would hold.
HOMES = {2: [0, 4], 4: [0, 2, 4, 6], 8: list(range(8)), 16: [w % 8 for w in range(16)]}


@pytest.mark.parametrize("workers", HOMES)
@pytest.mark.parametrize("visible", [None, "0,1,2,3,4,5,6,7", "7,6,5,4,3,2,1,0"],
                         ids=["unset", "set", "set-reversed"])
def test_on_eight_gpus_the_workers_homes_spread_and_leases_take_the_gpus_after_them(monkeypatch, workers, visible):
    """`pytest -n N` on an 8-GPU host, CUDA_VISIBLE_DEVICES unset (nvidia-smi's list) or set in any order."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        monkeypatch.setattr(leases.subprocess, "run", lambda *a, **k: SimpleNamespace(stdout="\n".join(EIGHT)))
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    order = leases.visible_gpus()
    assert sorted(order, key=int) == EIGHT
    seen = [worker_gpus(worker, workers, order) for worker in range(workers)]
    assert all(sorted(gpus, key=int) == EIGHT for gpus in seen)  # every worker sees every GPU
    assert [order.index(gpus[0]) for gpus in seen] == HOMES[workers]
    for gpus in seen:
        for n in (2, 4, 8):  # a multigpu(n) item holds its home and the n - 1 GPUs after it
            home = order.index(gpus[0])
            assert gpus[:n] == [order[(home + i) % 8] for i in range(n)]


def test_a_worker_gets_its_share_of_threads_and_gpus_before_torch_starts(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.setenv("OMP_NUM_THREADS", "64")  # a parent's budget: this worker's share of it
    for name in ("MKL_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS"):
        monkeypatch.delenv(name, raising=False)  # restored after: they are set below
    leases.share_host_with_other_workers()
    assert [os.environ[name] for name in leases.THREAD_BUDGETS] == ["16", "16", "16"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3,4,5,6,7,0,1"


def test_outside_xdist_nothing_is_shared_out(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    leases.share_host_with_other_workers()
    assert (os.environ["CUDA_VISIBLE_DEVICES"], os.environ["OMP_NUM_THREADS"]) == ("0,1", "8")


@pytest.mark.parametrize("cores, workers, share", [(64, 4, 16), (64, 8, 8), (2, 2, 1), (2, 4, 1), (3, 2, 1)])
def test_threads_are_the_cores_over_the_workers_at_least_one(cores, workers, share):
    assert thread_share(cores, workers) == share


def item(markers=(), fixtures=()):
    marks = {marker.name: marker for marker in markers}
    return SimpleNamespace(get_closest_marker=marks.get, fixturenames=list(fixtures))


@pytest.mark.parametrize("markers, fixtures, gpus, size", [
    ([pytest.mark.multigpu(2).mark], ["device"], 4, 2),
    ([pytest.mark.gpu.mark], [], 4, 1),
    ([], ["device"], 4, 1),
    ([], ["benchmark"], 4, 4),  # a CPU benchmark holds the whole host: its timing must not share it
    ([], ["benchmark", "device"], 4, 1),
    ([], ["tmp_path"], 4, 0),
    ([pytest.mark.gpu.mark], ["device", "benchmark"], 0, 0),  # no GPUs: nothing to hold
], ids=["multigpu", "gpu-marker", "device", "cpu-benchmark", "gpu-benchmark", "cpu-test", "no-gpus"])
def test_an_item_holds_the_gpus_it_runs_on(markers, fixtures, gpus, size):
    assert lease_size(item(markers, fixtures), gpus) == size


CONTENDER = """
import json, os, random, sys, time
from pathlib import Path
from systems.bench.leases import GpuLocks, worker_gpus

folder, worker, workers, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
gpus = worker_gpus(worker, workers, [str(g) for g in range(4)])
os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
locks = GpuLocks(folder, gpus)
random.seed(worker)
log = []
for _ in range(rounds):
    n = random.choice([1, 1, 2, 4])
    with locks.lease(n) as held:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ",".join(held) == ",".join(gpus[:n])
        start = time.monotonic()
        time.sleep(random.uniform(0, 0.01))
        log.append((held, start, time.monotonic()))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ",".join(gpus)
print(json.dumps(log))
"""


def test_leases_of_contending_workers_never_share_a_gpu_and_never_deadlock(tmp_path):
    """Six workers on four made-up GPUs, each leasing one, two or all four GPUs at random (two workers per home,
    so single leases contend too): no GPU is ever held twice at once, and every worker finishes."""
    workers = 6
    procs = [subprocess.Popen([sys.executable, "-c", CONTENDER, str(tmp_path), str(w), str(workers), "40"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}) for w in range(workers)]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * workers, [err for _, err in outputs]
    held = {}  # gpu -> [(start, end)]
    for out, _ in outputs:
        for gpus, start, end in json.loads(out):
            for gpu in gpus:
                held.setdefault(gpu, []).append((start, end))
    assert sorted(held) == ["0", "1", "2", "3"]
    for intervals in held.values():
        intervals.sort()
        assert all(end <= next_start for (_, end), (next_start, _) in zip(intervals, intervals[1:]))


def test_a_lease_is_released_when_its_holder_dies(tmp_path):
    """A worker killed mid-item frees its GPUs: the lock is the open file, closed by the kernel."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom pathlib import Path\nfrom systems.bench.leases import GpuLocks\n"
        "import os; os.environ['CUDA_VISIBLE_DEVICES'] = '0,1'\n"
        "with GpuLocks(Path(sys.argv[1]), ['0', '1']).lease(2):\n    print('held', flush=True)\n    time.sleep(60)\n"),
        str(tmp_path)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    start = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
        with GpuLocks(tmp_path, ["1", "0"]).lease(2):
            pass
    assert time.monotonic() - start < 5


def test_the_root_conftest_shares_the_host_before_torch_looks_at_the_gpus():
    """A checkout that is not installed loads the plugin from conftest.py, which asks torch whether there is a
    GPU: by then the worker's GPU order must be set, or CUDA fixes every worker's cuda:0 on the same GPU."""
    code = ("import os, torch\n"
            "seen = []\n"
            "torch.cuda.is_available = lambda: seen.append(os.environ['CUDA_VISIBLE_DEVICES']) or False\n"
            "import conftest\n"
            "print(seen)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2",
           "CUDA_VISIBLE_DEVICES": "0,1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['1,0']"]
