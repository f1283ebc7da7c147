"""What the accounting predicts for a training point, from its TrainSpec alone: the benches store it beside what
they measure, and the report computes it again with today's accounting, by the same function."""

from __future__ import annotations

from systems.accounting import fsdp_memory, peak_memory
from systems.levers.variant import Variant
from systems.parallel.spec import TrainSpec


def predicted_peak_mb(spec: TrainSpec, world_size: int, device: str) -> float | None:
    """The largest rank's predicted peak, MiB, on `device` ("cuda" or "cpu"): systems.accounting.fsdp_memory for
    our FSDP, peak_memory otherwise; None for torch's FSDP2, whose per-block gathers and sharded state the
    accounting does not model, and for tensor parallelism, whose slices it does not model either. A nested scheme is
    resolved as the run resolves it."""
    if spec.variant == Variant.FSDP2 or spec.variant.tensor_parallel:
        return None
    config = spec.resolved(device).config()
    if spec.variant == Variant.FSDP:
        peak = fsdp_memory(config, spec.batch_size, spec.context, spec.precision, world_size, device=device,
                           prefetch=spec.fsdp_prefetch, gather=spec.fsdp_gather).peak
    else:
        peak = peak_memory(config, spec.batch_size, spec.context, spec.precision, device=device).train_step
    return peak / 2**20
