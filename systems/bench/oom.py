"""Out-of-memory grid points are results: the point is skipped with the reason and listed, whole, in the saved
history's `out_of_memory`."""

from __future__ import annotations

import gc

import pytest
import torch

from systems.bench.schema import POINT

OUT_OF_MEMORY = pytest.StashKey[list]()  # the run's out-of-memory records, a worker's or the whole run's


class OutOfMemoryGuard:
    """`with skip_on_oom:` turns a CUDA out-of-memory error (a spawned rank's too) into a recorded skip."""

    def __init__(self, request):
        self.request = request

    def __enter__(self) -> OutOfMemoryGuard:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None or not issubclass(exc_type, torch.OutOfMemoryError):
            return False
        message = str(exc).splitlines()[0]
        del exc, tb  # the traceback pins the tensors; drop it before freeing the cache
        gc.collect()
        torch.cuda.empty_cache()
        node = self.request.node
        record = {"name": node.name, "fullname": node.nodeid, "error": message}
        benchmark = node.funcargs.get("benchmark")
        if benchmark is not None and POINT in benchmark.extra_info:  # the point, as its result would hold it
            record[POINT] = benchmark.extra_info[POINT]
        self.request.config.stash.setdefault(OUT_OF_MEMORY, []).append(record)
        pytest.skip(f"out of memory: {message}")
