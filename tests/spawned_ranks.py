"""A module-scoped fixture that runs a job once on every rank of each process group a distributed test
file checks: gloo on the CPU at some world sizes, and NCCL at some (2 GPUs unless told: a multi-GPU test)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from systems.parallel.ranks import launch


def results_by_rank(name: str, job: Callable[[], object], gloo_world_sizes: tuple[int, ...], timeout: float,
                    nccl_world_sizes: tuple[int, ...] = (2,), slow_gloo_world_sizes: tuple[int, ...] = ()):
    """A fixture `name`: `job()`'s result on each rank, in rank order, once per process group; the gloo groups of
    `slow_gloo_world_sizes` in the slow tier."""

    params = process_groups(gloo_world_sizes, nccl_world_sizes, slow_gloo_world_sizes)

    @pytest.fixture(scope="module", params=params, name=name)
    def results(request) -> list:
        backend, world_size = request.param
        return launch(job, world_size, backend=backend, timeout=timeout)

    return results


def process_groups(gloo_world_sizes: tuple[int, ...], nccl_world_sizes: tuple[int, ...],
                   slow_gloo_world_sizes: tuple[int, ...] = ()) -> list:
    """The fixture's parameters: (backend, world size), NCCL's marked as needing that many GPUs."""
    groups = [pytest.param(("gloo", n), id=f"gloo-{n}", marks=[pytest.mark.slow] if n in slow_gloo_world_sizes else [])
              for n in sorted({*gloo_world_sizes, *slow_gloo_world_sizes})]
    return groups + [pytest.param(("nccl", n), id=f"nccl-{n}", marks=pytest.mark.multigpu(n))
                     for n in nccl_world_sizes]
