"""Sharing one host between pytest-xdist workers: each worker's GPUs and cores, and GPU leases.

Under `pytest -n N`, `share_host_with_other_workers` gives each worker its share of the cores for torch's threads
and Inductor's compile workers (`thread_share`) and puts its home GPU first (`worker_gpus`). An item that runs on
GPUs holds them alone while it runs (`lease_size` says how many; `GpuLocks` takes one lock file per GPU, in
ascending order, so no two leases wait on each other), and an item of the timing tier holds the host alone
(`host_lease`). docs/design-notes.md has the rules in full.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

VISIBLE = "CUDA_VISIBLE_DEVICES"
# What a process's share of the cores sizes: torch's OpenMP and MKL threads, and Inductor's compile workers.
THREAD_BUDGETS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")


def available_cores() -> int:
    """This process's share of the host: its OMP_NUM_THREADS where a parent set one, else its CPU affinity."""
    inherited = os.environ.get("OMP_NUM_THREADS", "")
    return int(inherited) if inherited.isdigit() and int(inherited) > 0 else len(os.sched_getaffinity(0))


def thread_share(cores: int, workers: int) -> int:
    return max(1, cores // workers)


def worker_gpus(worker: int, workers: int, gpus: list[str]) -> list[str]:
    """The GPUs that xdist worker `worker` of `workers` sees, as CUDA_VISIBLE_DEVICES lists them: all of them,
    starting at its home. Homes are len(gpus) // workers apart (at least one; more workers than GPUs share
    them round robin), so single-GPU items of different workers land on different GPUs, and a multi-GPU item
    takes the GPUs after its worker's home."""
    if not gpus:
        return []
    start = worker * max(1, len(gpus) // workers) % len(gpus)
    return gpus[start:] + gpus[:start]


def visible_gpus() -> list[str]:
    """The GPUs this run may use, without initializing CUDA: CUDA_VISIBLE_DEVICES, else nvidia-smi's."""
    visible = os.environ.get(VISIBLE)
    if visible is not None:
        return [gpu.strip() for gpu in visible.split(",") if gpu.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return out.split()


def share_host_with_other_workers() -> None:
    """In an xdist worker, before torch is imported: its threads and its GPU order."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
    if worker is None:
        return
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    threads = str(thread_share(available_cores(), workers))
    for name in THREAD_BUDGETS:
        os.environ[name] = threads
    gpus = worker_gpus(int(worker.removeprefix("gw")), workers, visible_gpus())
    if gpus:
        os.environ[VISIBLE] = ",".join(gpus)


def on_gpus(point, gpus: int):
    """`point` as a parameter that holds `gpus` GPUs while it runs (marked multigpu: several GPUs, or one
    spawned rank's, which the `device` fixture does not stand for)."""
    return pytest.param(point, id=str(point), marks=[pytest.mark.multigpu(gpus)] if gpus else [])


def lease_size(item, gpus: int) -> int:
    """How many GPUs an item holds while it runs on a host of `gpus` (0 for none)."""
    if gpus == 0:
        return 0
    marker = item.get_closest_marker("multigpu")
    if marker is not None:
        return marker.args[0]
    fixtures = getattr(item, "fixturenames", ())
    if item.get_closest_marker("gpu") is not None or "device" in fixtures:
        return 1
    return gpus if "benchmark" in fixtures else 0


@contextlib.contextmanager
def host_lease(folder: Path, alone: bool) -> Iterator[None]:
    """Hold the host that the workers sharing `folder` run on: shared, or alone (waiting for every other item to
    end, and keeping new ones from starting)."""
    with open(folder / "host.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)  # released when the file closes
        yield


class GpuLocks:
    """One lock file per GPU in `folder`, which every worker of a run shares (and only they: an inner pytest run
    has its own, over the GPUs its outer item leased)."""

    def __init__(self, folder: Path, gpus: list[str]):
        self.folder, self.gpus = folder, gpus
        folder.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def lease(self, n: int) -> Iterator[list[str]]:
        """Hold this worker's first `n` GPUs (its home and the ones after it), waiting for them as needed; within
        the lease, processes this one starts see only those."""
        leased = self.gpus[:n]
        with contextlib.ExitStack() as held:
            for gpu in sorted(leased, key=lambda gpu: (len(gpu), gpu)):  # one order for every worker: 0, 1, ..., 10
                lock = held.enter_context(open(self.folder / f"gpu-{gpu}.lock", "w"))
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
            previous = os.environ[VISIBLE]  # set for every worker of a host with GPUs
            os.environ[VISIBLE] = ",".join(leased)
            try:
                yield leased
            finally:
                os.environ[VISIBLE] = previous
