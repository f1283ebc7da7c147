"""Activation checkpointing: a training step's time and peak memory for each scheme, and the longest context at
which a preset trains.

The grid comes from the command line (systems.bench.options): --presets, --edition, --contexts, --precisions,
--batch-size, --attention, --checkpoint (none, everyK, KxK, nested, attn, ops; -keepN), --fused, --compile-blocks,
--max-context, --warmup-steps, --rounds.
Each step point measures (systems.bench.schema.CheckpointMeasured) its segment sizes, the measured peak beside
the accounting's prediction, and activation memory (the peak less what the step holds before it starts:
weights, buffers and AdamW state), measured and predicted. A point that runs out of memory is recorded as such.
"""

from __future__ import annotations

import gc

import pytest
import torch

from systems.accounting import checkpointed, flops, largest_context, model_state, peak_memory, recomputed_flops
from systems.bench.options import grid_of
from systems.bench.schema import CheckpointMeasured, CheckpointPoint, ContextSearchMeasured, ContextSearchPoint
from systems.bench.schema.records import to_record
from systems.bench.timing import Timing, record_measured, record_point, throughput, time_on_device
from systems.device import synchronize
from systems.model import TransformerConfig, get_config
from systems.optim import AdamW
from systems.precision import Precision
from systems.step import make_model, random_batch, train_step

MiB = 2**20


def pytest_generate_tests(metafunc):
    grid = grid_of(metafunc.config)
    common = [(preset, precision) for preset in grid.presets for precision in grid.precisions]
    if "point" in metafunc.fixturenames:
        metafunc.parametrize("point", [
            CheckpointPoint(preset, grid.edition, grid.batch_size, context, precision, grid.attention, scheme, fused,
                            compile)
            for preset, precision in common for context in grid.contexts for scheme in grid.checkpoint
            for fused in grid.fused for compile in grid.compile_blocks], ids=str)
    if "search" in metafunc.fixturenames:
        limit = grid.max_context or 2 * grid.contexts[0]
        if limit < grid.contexts[0]:
            raise pytest.UsageError(f"--max-context {limit} is below the first of --contexts "
                                    f"({grid.contexts[0]}): the context search would run nothing")
        metafunc.parametrize("search", [
            ContextSearchPoint(preset, grid.edition, grid.batch_size, precision, grid.attention, scheme,
                               grid.contexts[0], limit)
            for preset, precision in common for scheme in grid.checkpoint], ids=str)


@pytest.fixture(autouse=True)
def _free_memory():
    """Each point builds its own model: free the last one's memory first, so peaks start from the same place."""
    gc.collect()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.empty_cache()


def point_config(point: CheckpointPoint | ContextSearchPoint, context: int, device: torch.device) -> TransformerConfig:
    levers = dict(fused=point.fused, compile=point.compile) if isinstance(point, CheckpointPoint) else {}
    config = get_config(point.preset, point.edition, attention=point.attention, context_length=context, **levers)
    return checkpointed(point.scheme, config, point.batch, context, point.precision, device=device.type)


def measure_steps(benchmark, config: TransformerConfig, batch: int, precision: Precision, device,
                  grid) -> CheckpointMeasured:
    """AdamW training steps timed (the first warm-up step allocates the optimizer state): throughput (model FLOPs
    for MFU, the recomputed forward apart) and memory, measured (on a GPU) and predicted, in MiB."""
    model = make_model(config, device, precision)
    optimizer = AdamW(model.parameters(), lr=1e-4)
    tokens, targets = random_batch(config, batch, config.context_length, device)
    timing = time_on_device(benchmark, lambda: train_step(model, optimizer, tokens, targets, precision),
                            device=device, warmup=max(1, grid.warmup_steps), rounds=grid.rounds)
    return memory_measured(config, batch, precision, device, timing, model.num_parameters())


def memory_measured(config: TransformerConfig, batch: int, precision: Precision, device, timing: Timing,
                    parameters: int) -> CheckpointMeasured:
    state = model_state(config, precision).training / MiB
    predicted = peak_memory(config, batch, config.context_length, precision, device=device.type).train_step / MiB
    seconds, peak = timing.seconds, timing.peak_memory_mb
    step_flops = flops(config, batch, config.context_length).step
    return CheckpointMeasured(
        levels=config.checkpoint, parameters=parameters, state_mb=state, predicted_peak_mb=predicted,
        predicted_activation_mb=predicted - state, peak_memory_mb=peak,
        activation_mb=None if peak is None else peak - state,
        recomputed_tflop=recomputed_flops(config, batch, config.context_length, device=device.type).forward / 1e12,
        tokens_per_s=None if seconds is None else batch * config.context_length / seconds,
        throughput=None if seconds is None else throughput(seconds=seconds, flops=step_flops, device=device,
                                                           precision=precision),
        config=to_record(config))


def test_checkpoint(benchmark, point, device, grid, skip_on_oom):
    benchmark.group = f"checkpoint-{str(point).rsplit('-', 1)[0]}"  # the point but its scheme
    record_point(benchmark, point)
    config = point_config(point, point.context, device)
    with skip_on_oom:
        record_measured(benchmark, measure_steps(benchmark, config, point.batch, point.precision, device, grid))


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


def test_largest_context(benchmark, search, device, grid, skip_on_oom):
    """Double the context from `start` until a step runs out of memory (the first that does is recorded) or
    reaches `limit`; then time steps at the longest that trained. The accounting's longest is beside it."""
    benchmark.group = f"largest-context-{search.preset}-b{search.batch}-{search.precision.name}-{search.attention}"
    record_point(benchmark, search)
    longest, context = None, search.start
    while context <= search.limit and trains(search, context, device):
        longest, context = context, 2 * context
    config = point_config(search, longest or search.start, device)
    with skip_on_oom:  # even the first context ran out of memory: timing it records that
        at_longest = measure_steps(benchmark, config, search.batch, search.precision, device, grid)
    record_measured(benchmark, ContextSearchMeasured(
        largest_context=longest, first_oom_context=context if context <= search.limit else None,
        predicted_largest_context=largest_context(config, search.batch, search.precision, device=device.type),
        at_longest=at_longest))
