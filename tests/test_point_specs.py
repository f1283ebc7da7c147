"""A training benchmark's point gives the TrainSpec its run trains: every lever of the point reaches the spec."""

from __future__ import annotations

import dataclasses

import pytest

from systems.bench.schema import DDPPoint, FSDPPoint, FullStepPoint, LayoutPoint, LeaderboardPoint, OptimizerPoint
from systems.bench.schema.distributed import FSDP_DDP_BUCKET_MB
from systems.levers.checkpointing import Checkpointing
from systems.levers.layout import Layout
from systems.levers.sharding import Gather
from systems.levers.variant import Optimizer, Variant
from systems.model import Attention, Fused
from systems.precision import PRECISIONS

SHAPE = dict(preset="small", edition="2026", precision=PRECISIONS["bf16"], batch=3, context=48, world_size=2)
SPEC_SHAPE = dict(preset="small", edition="2026", precision=PRECISIONS["bf16"], batch_size=3, context=48)


def differs_from_defaults(spec, **expected) -> None:
    """`spec` has the shape and `expected`, and each expected value but bucketed DDP (the variant some kinds fix)
    is not the field's default, else a lever dropped on the way would pass."""
    defaults = {field.name: field.default for field in dataclasses.fields(spec)}
    for name, value in (SPEC_SHAPE | expected).items():
        assert getattr(spec, name) == value, name
        assert value == Variant.BUCKETED or value != defaults[name], f"{name}: pick a value other than the default"


@pytest.mark.parametrize("point, expected", [
    (DDPPoint(**SHAPE, variant=Variant.TORCH, bucket_size_mb=7.0), dict(variant=Variant.TORCH, bucket_size_mb=7.0)),
    (OptimizerPoint(**SHAPE, optimizer=Optimizer.SHARDED),
     dict(variant=Variant.BUCKETED, optimizer=Optimizer.SHARDED)),
    (FSDPPoint(**SHAPE, variant=Variant.FSDP, gather=Gather.LAYER, prefetch=3),
     dict(variant=Variant.FSDP, fsdp_gather=Gather.LAYER, fsdp_prefetch=3)),
    (FSDPPoint(**SHAPE, variant=Variant.BUCKETED, gather=None, prefetch=None),
     dict(variant=Variant.BUCKETED, bucket_size_mb=FSDP_DDP_BUCKET_MB)),
    (FullStepPoint(**SHAPE, variant=Variant.FSDP, attention=Attention.FLASH, checkpoint=Checkpointing((2,), 1),
                   loss_chunk=16, gather=Gather.LAYER, prefetch=2, fused=Fused.ALL, compile=True),
     dict(variant=Variant.FSDP, attention=Attention.FLASH, checkpoint=Checkpointing((2,), 1), loss_chunk=16,
          fsdp_gather=Gather.LAYER, fsdp_prefetch=2, fused=Fused.ALL, compile=True)),
], ids=["ddp", "optimizer", "fsdp", "fsdp-bucketed", "fullstep"])
def test_a_training_point_gives_its_levers_to_its_spec(point, expected):
    spec = point.spec(warmup=1, steps=7)
    assert (spec.warmup, spec.steps) == (1, 7)
    differs_from_defaults(spec, **expected)


def test_a_layout_point_gives_its_layout_to_meshed_variants_only():
    shape = {key: SHAPE[key] for key in ("preset", "edition", "precision", "batch", "context")}
    hsdp = LayoutPoint(variant=Variant.HSDP, layout=Layout(replicate=2, shard=2), **shape).spec()
    fsdp = LayoutPoint(variant=Variant.FSDP, layout=Layout(shard=4), **shape).spec()
    assert hsdp.layout == Layout(replicate=2, shard=2) and fsdp.layout is None
    differs_from_defaults(hsdp, variant=Variant.HSDP, layout=Layout(replicate=2, shard=2))


def test_the_leaderboard_point_trains_one_ranks_share_of_the_batch():
    point = LeaderboardPoint(model="ours", preset="small", edition="2026", precision=PRECISIONS["bf16"], batch=6,
                             context=48, world_size=2, attention=Attention.FLASH, checkpoint=Checkpointing((2,)),
                             loss_chunk=16, rep_ms=1.0, warmup_ms=1.0, fused=Fused.ALL, compile=True)
    differs_from_defaults(point.spec(), variant=Variant.FSDP, attention=Attention.FLASH, checkpoint=Checkpointing((2,)),
                          loss_chunk=16, fused=Fused.ALL, compile=True)
    with pytest.raises(ValueError, match="not ours"):
        dataclasses.replace(point, model="cs336_basics").spec()
