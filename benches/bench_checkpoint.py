"""Activation checkpointing: a training step's time and peak memory for each scheme, and the longest context at
which a preset trains.

The grid comes from the command line (conftest.py): --presets, --contexts, --precisions, --batch-size,
--attention, --checkpoint-blocks (one-level segment sizes), --checkpoint (none, nested), --max-context,
--warmup-steps, --rounds. Each step point's extra_info holds its segment sizes, the measured peak beside the
accounting's prediction, and activation memory (the peak less what the step holds before it starts: weights,
buffers and AdamW state), measured and predicted. A point that runs out of memory is recorded as such.
"""

from __future__ import annotations

import gc

import pytest
import torch

from systems.accounting import checkpoint_levels, flops, largest_context, model_state, peak_memory, recomputed_flops
from systems.bench.schema import POINT, CheckpointPoint, ContextSearchPoint
from systems.bench.timing import record_throughput, time_on_device
from systems.device import synchronize
from systems.model import TransformerConfig, get_config
from systems.optim import AdamW
from systems.precision import Precision, get_precision
from systems.step import make_model, random_batch, train_step

MiB = 2**20


def schemes(config) -> list[tuple[str, int | None]]:
    """No checkpointing first (the others compare with it), then one level of each segment size, then nested."""
    chosen = config.getoption("checkpoint")
    return ([("none", None)] * ("none" in chosen) + [("blocks", k) for k in config.getoption("checkpoint_blocks")]
            + [("nested", None)] * ("nested" in chosen))


def pytest_generate_tests(metafunc):
    opt = metafunc.config.getoption
    common = [(preset, precision) for preset in opt("presets") for precision in map(get_precision, opt("precisions"))]
    if "point" in metafunc.fixturenames:
        metafunc.parametrize("point", [
            CheckpointPoint(preset, opt("batch_size"), context, precision, opt("attention"), scheme, blocks)
            for preset, precision in common for context in opt("contexts")
            for scheme, blocks in schemes(metafunc.config)], ids=str)
    if "search" in metafunc.fixturenames:
        metafunc.parametrize("search", [
            ContextSearchPoint(preset, opt("batch_size"), precision, opt("attention"), scheme, blocks,
                               opt("contexts")[0], opt("max_context"))
            for preset, precision in common for scheme, blocks in schemes(metafunc.config)], ids=str)


@pytest.fixture(autouse=True)
def _free_memory():
    """Each point builds its own model: free the last one's memory first, so peaks start from the same place."""
    gc.collect()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.empty_cache()


def point_config(point: CheckpointPoint | ContextSearchPoint, context: int, device: torch.device) -> TransformerConfig:
    config = get_config(point.preset, attention=point.attention, context_length=context)
    levels = checkpoint_levels(point.scheme, config, point.batch, context, point.precision, blocks=point.blocks,
                               attention=point.attention, device=device.type)
    return get_config(point.preset, attention=point.attention, context_length=context, checkpoint=levels)


def record_memory(benchmark, config: TransformerConfig, batch: int, precision: Precision, device) -> None:
    """Measured (on a GPU) and predicted peak and activation memory, in MiB."""
    state = model_state(config, precision).training
    predicted = peak_memory(config, batch, config.context_length, precision, device=device.type).train_step
    info = benchmark.extra_info
    info.update(checkpoint=list(config.checkpoint), state_mb=state / MiB, predicted_peak_mb=predicted / MiB,
                predicted_activation_mb=(predicted - state) / MiB)
    if info.get("peak_memory_mb") is not None:
        info["activation_mb"] = info["peak_memory_mb"] - state / MiB


def time_steps(benchmark, config: TransformerConfig, batch: int, precision: Precision, device, request) -> None:
    """Time AdamW training steps (the first warm-up step allocates the optimizer state) and record throughput:
    model FLOPs for MFU, the recomputed forward apart."""
    model = make_model(config, device, precision)
    optimizer = AdamW(model.parameters(), lr=1e-4)
    tokens, targets = random_batch(config, batch, config.context_length, device)
    opt = request.config.getoption
    seconds = time_on_device(benchmark, lambda: train_step(model, optimizer, tokens, targets, precision),
                             device=device, warmup=max(1, opt("warmup_steps")), rounds=opt("rounds"))
    benchmark.extra_info.update(parameters=model.num_parameters(),
                                recomputed_tflop=recomputed_flops(config, batch, config.context_length).forward / 1e12)
    if seconds is not None:
        benchmark.extra_info["tokens_per_s"] = batch * config.context_length / seconds
        record_throughput(benchmark, seconds=seconds, flops=flops(config, batch, config.context_length).step,
                          device=device, precision=precision)


def test_checkpoint(benchmark, point, device, request, skip_on_oom):
    benchmark.group = f"checkpoint-{str(point).rsplit('-', 1)[0]}"  # the point but its scheme
    benchmark.extra_info[POINT] = point.to_dict()
    config = point_config(point, point.context, device)
    with skip_on_oom:
        time_steps(benchmark, config, point.batch, point.precision, device, request)
    record_memory(benchmark, config, point.batch, point.precision, device)


def trains(point: ContextSearchPoint, context: int, device: torch.device) -> bool:
    """Whether two training steps at `context` run without running out of memory."""
    try:
        two_steps(point_config(point, context, device), point.batch, point.precision, device)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def two_steps(config: TransformerConfig, batch: int, precision: Precision, device: torch.device) -> None:
    model = make_model(config, device, precision)
    optimizer = AdamW(model.parameters(), lr=1e-4)
    tokens, targets = random_batch(config, batch, config.context_length, device)
    for _ in range(2):  # the second step runs with the optimizer state in memory
        train_step(model, optimizer, tokens, targets, precision)
    synchronize(device)


def test_largest_context(benchmark, search, device, request, skip_on_oom):
    """Double the context from `start` until a step runs out of memory (the first that does is recorded) or
    reaches `limit`; then time steps at the longest that trained. The accounting's longest is beside it."""
    benchmark.group = f"largest-context-{search.preset}-b{search.batch}-{search.precision.name}-{search.attention}"
    benchmark.extra_info[POINT] = search.to_dict()
    longest, context = None, search.start
    while context <= search.limit and trains(search, context, device):
        longest, context = context, 2 * context
    first_oom = context if context <= search.limit else None
    benchmark.extra_info.update(largest_context=longest, first_oom_context=first_oom)
    config = point_config(search, longest or search.start, device)
    benchmark.extra_info["predicted_largest_context"] = largest_context(
        config, search.batch, search.precision, device=device.type)
    with skip_on_oom:  # even the first context ran out of memory: timing it records that
        time_steps(benchmark, config, search.batch, search.precision, device, request)
    record_memory(benchmark, config, search.batch, search.precision, device)
