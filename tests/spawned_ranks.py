"""A module-scoped fixture that runs a job once on every rank of each process group a distributed test
file checks: gloo on the CPU at some world sizes, and NCCL on 2 GPUs (a multi-GPU test)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from systems.parallel.ranks import launch


def results_by_rank(name: str, job: Callable[[], object], gloo_world_sizes: tuple[int, ...], timeout: float):
    """A fixture `name`: `job()`'s result on each rank, in rank order, once per process group."""
    groups = [pytest.param(("gloo", n), id=f"gloo-{n}") for n in gloo_world_sizes]
    groups.append(pytest.param(("nccl", 2), id="nccl-2", marks=pytest.mark.multigpu(2)))

    @pytest.fixture(scope="module", params=groups, name=name)
    def results(request) -> list:
        backend, world_size = request.param
        return launch(job, world_size, backend=backend, timeout=timeout)

    return results
