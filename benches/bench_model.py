"""End-to-end model benchmarks: forward, backward, forward+backward and a full AdamW training step.

The grid comes from the command line (systems.bench.options): --presets, --edition, --contexts, --precisions,
--compile-contexts, --compile-mode, --batch-size, --attention, --warmup-steps, --rounds. Each point measures
(systems.bench.schema.ModelMeasured) the parameter count, tokens/s, TFLOP/s, MFU (on a GPU with a known peak) and
peak memory; a point that runs out of GPU memory is recorded as such and the run goes on.
"""

from __future__ import annotations

import dataclasses
import gc
import pathlib

import pytest
import torch

from systems.accounting import flops
from systems.bench.options import grid_of
from systems.bench.schema import MODEL_PHASES, ModelMeasured, ModelPoint, WarmupMeasured, WarmupPoint, to_record
from systems.bench.timing import record_measured, record_point, throughput, time_on_device
from systems.model import TransformerLM, get_config
from systems.optim import AdamW
from systems.step import backward, forward_loss, make_model, random_batch, train_step

WARMUP_STUDY = (0, 1, 2, 5)
SNAPSHOT_PHASES = ("forward", "step")


def model_grid(grid, phases: tuple[str, ...]) -> list[ModelPoint]:
    """Presets outermost so each model is built once per weight dtype; compiled points after the eager ones."""
    points = []
    for preset in grid.presets:
        for compile, contexts in (("eager", grid.contexts), (grid.compile_mode, grid.compile_contexts)):
            for precision in grid.precisions:
                points += [ModelPoint(preset, grid.edition, grid.batch_size, context, precision, grid.attention,
                                      compile, phase) for context in contexts for phase in phases]
    return points


def warmup_points(grid) -> list[WarmupPoint]:
    """The first preset, context and precision of the grid, after each number of warm-up steps."""
    return [WarmupPoint(grid.presets[0], grid.edition, grid.batch_size, grid.contexts[0], grid.precisions[0],
                        grid.attention, warmup) for warmup in WARMUP_STUDY]


def pytest_generate_tests(metafunc):
    grid = grid_of(metafunc.config)
    for name, phases in (("point", MODEL_PHASES), ("snapshot_point", SNAPSHOT_PHASES)):
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, [on_model_worker(point) for point in model_grid(grid, phases)])
    if "warmup_point" in metafunc.fixturenames:
        metafunc.parametrize("warmup_point", warmup_points(grid), ids=str)


def model_key(point: ModelPoint) -> tuple:
    """What makes a point's model: the points that share it share one build (ModelCache)."""
    return point.preset, point.edition, point.attention, point.compile, point.precision.weights


def unit_key(point: ModelPoint) -> tuple:
    """The points that run together under `pytest -n`: one model at one context. A whole model would be too coarse:
    the largest one's points alone outlast a quarter of the grid, so four workers would wait for it; a worker
    builds the model again for each of its units, a fraction of a second beside a unit's seconds."""
    return *model_key(point), point.context


def on_model_worker(point: ModelPoint):
    """The point as a parameter whose unit's points run on one worker under `pytest -n`, the model built once for
    them (serially, once for all its contexts)."""
    group = "model:" + "-".join(str(part).removeprefix("torch.") for part in unit_key(point))
    return pytest.param(point, id=str(point), marks=pytest.mark.xdist_group(group))


class ModelCache:
    """Holds one model at a time: the largest presets only fit on the GPU alone."""

    def __init__(self, device: torch.device, context_length: int):
        self.device, self.context_length = device, context_length
        self.key, self.model = None, None

    def get(self, point: ModelPoint) -> TransformerLM:
        key = model_key(point)
        if key != self.key:
            self.key, self.model = None, None
            gc.collect()
            torch.cuda.empty_cache()
            torch._dynamo.reset()
            self.model = build_model(point, self.device, self.context_length, point.compile)
            self.key = key
        return self.model


def build_model(point: ModelPoint | WarmupPoint, device, context_length, compile: str = "eager") -> TransformerLM:
    """The point's model, its context long enough for every point of the grid (the RoPE tables' length)."""
    config = get_config(point.preset, point.edition, attention=point.attention, context_length=context_length)
    model = make_model(config, device, point.precision)
    if compile == "regional":
        # Block by block: identical blocks share one compiled graph, so compile time does not grow
        # with depth. Large models lose nothing by it.
        for block in model.blocks:
            block.compile(dynamic=False)
    elif compile == "cudagraphs":
        # The whole model, replayed as CUDA graphs: small models are bound by kernel launches, and
        # only graph replay takes the CPU out of the step. Compile time grows with depth.
        model.compile(mode="reduce-overhead", dynamic=False)
    return model


@pytest.fixture(scope="module")
def models(grid, device):
    cache = ModelCache(device, max(grid.contexts + grid.compile_contexts))
    yield cache
    cache.model = None
    gc.collect()
    torch.cuda.empty_cache()


def run_phase(benchmark, model, point: ModelPoint, device, grid) -> ModelMeasured:
    """Time one phase of a training step; its measurements."""
    tokens, targets = random_batch(model.config, point.batch, point.context, device)
    optimizer = AdamW(model.parameters(), lr=1e-4) if point.phase == "step" else None

    def zero_grad():
        model.zero_grad(set_to_none=True)
        return ()

    # Timed calls return nothing, so no round keeps the previous round's autograd graph alive.
    # Each starts a new CUDA-graph step, which frees the graphs' outputs of the round before.
    def forward():
        torch.compiler.cudagraph_mark_step_begin()
        forward_loss(model, tokens, targets, point.precision)

    def fresh_loss():
        zero_grad()
        torch.compiler.cudagraph_mark_step_begin()
        return (forward_loss(model, tokens, targets, point.precision),)

    def forward_backward():
        torch.compiler.cudagraph_mark_step_begin()
        backward(forward_loss(model, tokens, targets, point.precision))

    def step():
        torch.compiler.cudagraph_mark_step_begin()
        train_step(model, optimizer, tokens, targets, point.precision)

    fn, setup = {"forward": (forward, None), "backward": (backward, fresh_loss),
                 "forward_backward": (forward_backward, zero_grad), "step": (step, None)}[point.phase]
    timing = time_on_device(benchmark, fn, setup=setup, device=device, warmup=grid.warmup_steps, rounds=grid.rounds)
    model.zero_grad(set_to_none=True)
    measured = ModelMeasured(parameters=model.num_parameters(), tokens_per_s=None, throughput=None,
                             peak_memory_mb=timing.peak_memory_mb, config=to_record(model.config))
    if timing.seconds is None:  # --benchmark-disable: the phase ran once, untimed
        return measured
    counts = flops(model.config, point.batch, point.context)
    phase_flops = {"forward": counts.forward, "backward": counts.backward}.get(point.phase, counts.step)
    rate = throughput(seconds=timing.seconds, flops=phase_flops, device=device, precision=point.precision)
    return dataclasses.replace(measured, tokens_per_s=point.batch * point.context / timing.seconds, throughput=rate)


def test_warmup_study(benchmark, warmup_point, device, grid, skip_on_oom):
    """The same forward+backward timed after 0, 1, 2 and 5 warm-up steps, each on a fresh model.

    Serially this runs first in the module, so warm-up 0 also pays for the process's first CUDA calls; under
    `pytest -n` its points, the shortest, come last, after their worker's first calls.
    """
    point = warmup_point
    benchmark.group = "warmup-study"
    record_point(benchmark, point)
    with skip_on_oom:
        model = build_model(point, device, point.context)
        tokens, targets = random_batch(model.config, point.batch, point.context, device)
        timing = time_on_device(benchmark, lambda: backward(forward_loss(model, tokens, targets, point.precision)),
                                device=device, warmup=point.warmup_steps, rounds=grid.rounds)
    record_measured(benchmark, WarmupMeasured(timing.peak_memory_mb, to_record(model.config)))


def test_model(benchmark, point, models, device, grid, skip_on_oom):
    benchmark.group = f"model-{point.phase}"
    record_point(benchmark, point)
    with skip_on_oom:
        model = models.get(point)
        record_measured(benchmark, run_phase(benchmark, model, point, device, grid))


@pytest.mark.gpu
def test_memory_snapshot(snapshot_point, models, device, grid, skip_on_oom):
    """With --memory-snapshot-dir, write a CUDA memory snapshot of one forward pass and of one step."""
    out_dir = grid.memory_snapshot_dir
    if out_dir is None:
        pytest.skip("pass --memory-snapshot-dir DIR to write memory snapshots")
    point = snapshot_point
    path = pathlib.Path(out_dir) / f"{point}.pickle"
    path.parent.mkdir(parents=True, exist_ok=True)
    with skip_on_oom:
        model = models.get(point)
        tokens, targets = random_batch(model.config, point.batch, point.context, device)
        optimizer = AdamW(model.parameters(), lr=1e-4)
        train_step(model, optimizer, tokens, targets, point.precision)  # warm: optimizer state exists
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        try:
            if point.phase == "forward":
                forward_loss(model, tokens, targets, point.precision)
            else:
                train_step(model, optimizer, tokens, targets, point.precision)
            torch.cuda.synchronize()
            torch.cuda.memory._dump_snapshot(str(path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
            model.zero_grad(set_to_none=True)
    assert path.stat().st_size > 0
