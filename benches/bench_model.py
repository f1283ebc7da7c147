"""End-to-end model benchmarks: forward, backward, forward+backward and a full AdamW training step.

The grid comes from the command line (conftest.py): --presets, --contexts, --precisions,
--compile-contexts, --compile-mode, --batch-size, --attention, --warmup-steps, --rounds. Each point's
extra_info holds the parameter count, tokens/s, TFLOP/s, MFU (on a GPU with a known peak) and
peak memory; a point that runs out of GPU memory is recorded as such and the run goes on.
"""

from __future__ import annotations

import gc
import pathlib

import pytest
import torch

from systems.accounting import flops
from systems.bench.schema import MODEL_PHASES, POINT, ModelPoint
from systems.bench.timing import record_throughput, time_on_device
from systems.model import TransformerLM, get_config
from systems.optim import AdamW
from systems.precision import get_precision
from systems.step import backward, forward_loss, make_model, random_batch, train_step

WARMUP_STUDY = (0, 1, 2, 5)
SNAPSHOT_PHASES = ("forward", "step")


def model_grid(config, phases: tuple[str, ...]) -> list[ModelPoint]:
    """Presets outermost so each model is built once per weight dtype; compiled points after the eager ones."""
    opt = config.getoption
    points = []
    for preset in opt("presets"):
        for compile, contexts in (("eager", opt("contexts")), (opt("compile_mode"), opt("compile_contexts"))):
            for precision in map(get_precision, opt("precisions")):
                points += [ModelPoint(preset, context, precision, compile, phase)
                           for context in contexts for phase in phases]
    return points


def pytest_generate_tests(metafunc):
    for name, phases in (("point", MODEL_PHASES), ("snapshot_point", SNAPSHOT_PHASES)):
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, model_grid(metafunc.config, phases), ids=str)


class ModelCache:
    """Holds one model at a time: the largest presets only fit on the GPU alone."""

    def __init__(self, device: torch.device, attention: str, context_length: int):
        self.device, self.attention, self.context_length = device, attention, context_length
        self.key, self.model = None, None

    def get(self, point: ModelPoint) -> TransformerLM:
        key = (point.preset, point.compile, point.precision.weights)
        if key != self.key:
            self.key, self.model = None, None
            gc.collect()
            torch.cuda.empty_cache()
            torch._dynamo.reset()
            self.model = build_model(point, self.device, self.attention, self.context_length)
            self.key = key
        return self.model


def build_model(point: ModelPoint, device, attention, context_length) -> TransformerLM:
    config = get_config(point.preset, attention=attention, context_length=context_length)
    model = make_model(config, device, point.precision)
    if point.compile == "regional":
        # Block by block: identical blocks share one compiled graph, so compile time does not grow
        # with depth. Large models lose nothing by it.
        for block in model.blocks:
            block.compile(dynamic=False)
    elif point.compile == "cudagraphs":
        # The whole model, replayed as CUDA graphs: small models are bound by kernel launches, and
        # only graph replay takes the CPU out of the step. Compile time grows with depth.
        model.compile(mode="reduce-overhead", dynamic=False)
    return model


@pytest.fixture(scope="module")
def models(request, device):
    opt = request.config.getoption
    longest = max(opt("contexts") + opt("compile_contexts"))
    cache = ModelCache(device, opt("attention"), longest)
    yield cache
    cache.model = None
    gc.collect()
    torch.cuda.empty_cache()


def run_phase(benchmark, model, point, device, request) -> None:
    """Time one phase of a training step and record its derived figures."""
    batch_size = request.config.getoption("batch_size")
    tokens, targets = random_batch(model.config, batch_size, point.context, device)
    timing = dict(device=device, warmup=request.config.getoption("warmup_steps"),
                  rounds=request.config.getoption("rounds"))
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
    seconds = time_on_device(benchmark, fn, setup=setup, **timing)
    model.zero_grad(set_to_none=True)
    benchmark.extra_info.update(batch_size=batch_size, attention=model.config.attention,
                                parameters=model.num_parameters())
    if seconds is not None:
        benchmark.extra_info["tokens_per_s"] = batch_size * point.context / seconds
        counts = flops(model.config, batch_size, point.context)
        phase_flops = {"forward": counts.forward, "backward": counts.backward}.get(point.phase, counts.step)
        record_throughput(benchmark, seconds=seconds, flops=phase_flops, device=device,
                          precision=point.precision)


def test_warmup_study(benchmark, warmup, device, request, skip_on_oom):
    """The same forward+backward timed after 0, 1, 2 and 5 warm-up steps, each on a fresh model.

    This runs first in the module, so warm-up 0 also pays for the process's first CUDA calls.
    """
    opt = request.config.getoption
    point = ModelPoint(opt("presets")[0], opt("contexts")[0], get_precision(opt("precisions")[0]), "eager",
                       "forward_backward")
    benchmark.group = "warmup-study"
    benchmark.extra_info[POINT] = point.to_dict()
    with skip_on_oom:
        model = build_model(point, device, opt("attention"), point.context)
        tokens, targets = random_batch(model.config, opt("batch_size"), point.context, device)
        time_on_device(benchmark, lambda: backward(forward_loss(model, tokens, targets, point.precision)),
                       device=device, warmup=warmup, rounds=opt("rounds"))
    benchmark.extra_info["warmup_steps"] = warmup


@pytest.fixture(params=WARMUP_STUDY, ids=lambda w: f"warmup{w}")
def warmup(request):
    return request.param


def test_model(benchmark, point, models, device, request, skip_on_oom):
    benchmark.group = f"model-{point.phase}"
    benchmark.extra_info[POINT] = point.to_dict()
    with skip_on_oom:
        model = models.get(point)
        run_phase(benchmark, model, point, device, request)


@pytest.mark.gpu
def test_memory_snapshot(snapshot_point, models, device, request, skip_on_oom):
    """With --memory-snapshot-dir, write a CUDA memory snapshot of one forward pass and of one step."""
    out_dir = request.config.getoption("memory_snapshot_dir")
    if out_dir is None:
        pytest.skip("pass --memory-snapshot-dir DIR to write memory snapshots")
    point = snapshot_point
    path = pathlib.Path(out_dir) / f"{point}.pickle"
    path.parent.mkdir(parents=True, exist_ok=True)
    with skip_on_oom:
        model = models.get(point)
        tokens, targets = random_batch(model.config, request.config.getoption("batch_size"), point.context, device)
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
