"""A training benchmark's point holds the TrainSpec its run trains: each training bench hands its point's spec (nested
checkpointing resolved where the run starts) to the ranks with the grid's Schedule and saves the point whole, every
field of the spec survives the point's record, and the id names each lever the point's kind varies."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import json
import pathlib
from types import SimpleNamespace

import pytest
import torch

from systems.bench.options import OPTIONS, Grid, _list
from systems.bench.schema import (MEASURED, POINT, DDPPoint, FSDPPoint, FullStepPoint, LayoutPoint, OptimizerPoint,
                                  read_point)
from systems.levers.checkpointing import Checkpointing
from systems.levers.layout import Layout
from systems.levers.sharding import Gather
from systems.levers.spelling import as_option_type
from systems.levers.variant import Optimizer, Variant
from systems.model import Attention, Fused
from systems.parallel.spec import Schedule, TrainSpec
from systems.parallel.train import train

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Between them every field off its default, else a field dropped on a record's way would pass.
SPECS = (TrainSpec(preset="small", edition="2026", variant="torch", bucket_size_mb=7.0, optimizer="sharded",
                   precision="bf16", batch_size=3, context=48, lr=0.5, seed=3, checkpoint="every2-keep1",
                   loss_chunk=16, attention="flash", fused="all", compile=True, fsdp_prefetch=3,
                   fsdp_gather="layer"),
         TrainSpec(variant="hsdp", layout="2x2"))


def test_the_specs_here_set_every_lever():
    for field in dataclasses.fields(TrainSpec):
        assert any(getattr(spec, field.name) != field.default for spec in SPECS), field.name


@pytest.mark.parametrize("point", [DDPPoint(SPECS[0], 2), OptimizerPoint(SPECS[0], 2), FSDPPoint(SPECS[0], 2),
                                   FullStepPoint(SPECS[0], 2), FullStepPoint(SPECS[1], 4),
                                   LayoutPoint(SPECS[1], Layout(2, 2))], ids=lambda point: point.kind)
def test_every_field_of_a_points_spec_survives_its_record(point):
    back = read_point(json.loads(json.dumps(point.to_record())))
    assert back == point
    for field in dataclasses.fields(TrainSpec):
        assert type(getattr(back.spec, field.name)) is type(getattr(point.spec, field.name)), field.name


def test_a_layout_point_is_laid_out_as_its_spec_says():
    with pytest.raises(ValueError, match="hsdp over 4 ranks is laid out as 2x2, not 4x1"):
        LayoutPoint(SPECS[1], Layout(replicate=4))
    with pytest.raises(ValueError, match="bucketed over 4 ranks is laid out as 4x1, not 1x4"):
        LayoutPoint(TrainSpec(variant="bucketed"), Layout(shard=4))


# Per lever a kind may vary, a value other than the points' below.
OTHER = {"variant": Variant.FSDP2, "bucket_size_mb": 7.0, "optimizer": Optimizer.SHARDED, "attention": Attention.FLASH,
         "checkpoint": Checkpointing((1,)), "loss_chunk": 16, "fsdp_gather": Gather.LAYER, "fsdp_prefetch": 3,
         "fused": Fused.ALL, "compile": True}


@pytest.mark.parametrize("point", [DDPPoint(TrainSpec(variant="bucketed"), 2), OptimizerPoint(TrainSpec(), 2),
                                   FSDPPoint(TrainSpec(variant="fsdp"), 2),
                                   FullStepPoint(TrainSpec(variant="fsdp"), 2)], ids=lambda point: point.kind)
def test_a_points_id_names_every_lever_its_kind_varies(point):
    """The id is the point's key in every history: two points of a kind apart in a lever it varies are two keys."""
    assert point.varies
    for lever in point.varies:
        other = dataclasses.replace(point, spec=dataclasses.replace(point.spec, **{lever: OTHER[lever]}))
        assert point.shows(lever) and str(other) != str(point), lever
    assert not FSDPPoint(TrainSpec(variant="fsdp2"), 2).shows("fsdp_gather")  # ours alone uses it


def bench(name: str):
    """A module of benches/, imported as pytest imports it."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benches" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Ranks:
    """rank_pools: keeps what each job runs, and answers as ranks that timed every phase of one step."""

    def __init__(self):
        self.jobs = []

    def run(self, world_size: int, backend: str, fn, *args) -> list[dict]:
        self.jobs.append((fn, args))
        seconds = {phase: [0.01] for phase in ("forward", "backward", "comm_wait", "optimizer", "step")}
        return [{"seconds": seconds, "state_bytes": 8} for _ in range(world_size)]


def default_grid() -> Grid:
    return Grid(**{option.dest: None if option.default is None else
                   (_list(option.parse, option.empty) if option.many else as_option_type(option.parse))(option.default)
                   for option in OPTIONS.values()})


@pytest.mark.parametrize("module, test, points", [
    ("bench_ddp", "test_ddp_step", "step_grid"), ("bench_ddp", "test_optimizer_memory", "optimizer_grid"),
    ("bench_fsdp", "test_fsdp_step", "fsdp_grid"), ("bench_fullstep", "test_fullstep", "fullstep_grid"),
    ("bench_layouts", "test_layout_step", "layout_grid")])
def test_a_training_bench_trains_its_points_spec_for_the_grids_schedule(module, test, points):
    """Every point of the bench's default grid (bench_fullstep's has nested checkpointing): the ranks train its
    spec, resolved where the run starts, for --warmup-steps and --rounds, and the history keeps the point whole."""
    # A schedule off Schedule's defaults, else a bench ignoring the grid's would pass.
    grid, device = dataclasses.replace(default_grid(), warmup_steps=1, rounds=7), torch.device("cpu")
    bench_module = bench(module)
    assert Schedule(warmup=grid.warmup_steps, steps=grid.rounds) != Schedule()
    run = getattr(bench_module, test)
    for point in getattr(bench_module, points)(grid):
        benchmark, ranks = SimpleNamespace(disabled=True, extra_info={}, group=None), Ranks()
        fixtures = dict(benchmark=benchmark, rank_pools=ranks, grid=grid, device=device,
                        skip_on_oom=contextlib.nullcontext())
        run(**{name: fixtures.get(name, point) for name in inspect.signature(run).parameters})
        ((fn, (spec, schedule, *_)),) = ranks.jobs
        assert fn is train and spec == point.spec.resolved(device.type), point
        assert spec is point.spec or point.spec.checkpoint.levels is None
        assert schedule == Schedule(warmup=grid.warmup_steps, steps=grid.rounds)
        assert read_point(json.loads(json.dumps(benchmark.extra_info[POINT]))) == point
        assert MEASURED in benchmark.extra_info
