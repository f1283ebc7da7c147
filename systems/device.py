"""Device helpers with no model behind them: host-to-device tables, synchronization, NVTX ranges."""

from __future__ import annotations

import contextlib

import torch


def host_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small table built on the host, on `device`. Through pinned memory the copy is queued on the
    stream instead of waiting for the work already queued there (the backward pass, say)."""
    table = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)
    return table


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def nvtx_range(name: str):
    """A named range of the step on a GPU: an NVTX range for nsys, and while torch.profiler runs one of its
    ranges too, for systems.bench.breakdown (a profiler range costs several times an NVTX one, and FSDP opens
    one per collective). Nothing off-GPU, nor under torch.compile's tracing (Dynamo cannot trace an NVTX range,
    and a graph break there would split the compiled region)."""
    if not torch.cuda.is_available() or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    if not torch._C._autograd._profiler_enabled():
        return torch.cuda.nvtx.range(name)
    return _profiled_range(name)


@contextlib.contextmanager
def _profiled_range(name: str):
    with torch.cuda.nvtx.range(name), torch.profiler.record_function(name):
        yield
