"""A module-scoped fixture that runs a job once on every rank of each process group a distributed test
file checks: gloo on the CPU at some world sizes, and NCCL at some (2 GPUs unless told: a multi-GPU test).
Under `pytest -n` the tests of one process group run on one worker (an xdist group). Gloo ranks live for the
whole run (conftest's `rank_pools`: a pool per world size, started again after a failure), so a module pays
for its job, not for starting torch in every rank; NCCL ranks are launched afresh for each module, so that no
idle rank holds memory on a GPU that another worker leases next."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

from systems.parallel.ranks import launch


def results_by_rank(name: str, job: Callable[..., object], gloo_world_sizes: tuple[int, ...], timeout: float,
                    nccl_world_sizes: tuple[int, ...] = (2,), slow_gloo_world_sizes: tuple[int, ...] = (),
                    selects: str | None = None):
    """A fixture `name`: `job()`'s result on each rank, in rank order, once per process group; the gloo groups of
    `slow_gloo_world_sizes` in the slow tier. With `selects`, a parameter of the tests: the job is called with the
    set of its values that the selected tests take, so that `-k` and the tiers cut what the ranks run."""

    params = process_groups(gloo_world_sizes, nccl_world_sizes, slow_gloo_world_sizes, worker_group(job, name))

    @pytest.fixture(scope="module", params=params, name=name)
    def results(request) -> list:
        backend, world_size = request.param
        task = job if selects is None else functools.partial(job, selected_values(request, name, selects))
        if backend == "gloo":
            return request.getfixturevalue("rank_pools").run(world_size, backend, task, timeout=timeout)
        return launch(task, world_size, backend=backend, timeout=timeout)

    return results


def selected_values(request, fixture: str, parameter: str) -> frozenset:
    """The values of `parameter` over the selected tests of the requesting module that use `fixture`."""
    return frozenset(item.callspec.params[parameter] for item in request.session.items
                     if item.module is request.module and fixture in item.fixturenames
                     and hasattr(item, "callspec") and parameter in item.callspec.params)


def worker_group(job: Callable[[], object], name: str) -> str:
    """The xdist group of a results fixture's tests: its module and name (a process group's size is added)."""
    return f"{job.__module__}.{name}"


def process_groups(gloo_world_sizes: tuple[int, ...], nccl_world_sizes: tuple[int, ...],
                   slow_gloo_world_sizes: tuple[int, ...] = (), worker_group: str | None = None) -> list:
    """The fixture's parameters: (backend, world size), NCCL's marked as needing that many GPUs; with
    `worker_group`, each marked as an xdist group of its own."""

    def marks(backend: str, n: int) -> list:
        tier = [pytest.mark.slow] if backend == "gloo" and n in slow_gloo_world_sizes else []
        gpus = [pytest.mark.multigpu(n)] if backend == "nccl" else []
        worker = [pytest.mark.xdist_group(f"{worker_group}:{backend}-{n}")] if worker_group else []
        return tier + gpus + worker

    return ([pytest.param(("gloo", n), id=f"gloo-{n}", marks=marks("gloo", n))
             for n in sorted({*gloo_world_sizes, *slow_gloo_world_sizes})]
            + [pytest.param(("nccl", n), id=f"nccl-{n}", marks=marks("nccl", n)) for n in nccl_world_sizes])
