"""The training loop over layouts (TrainSpec.layout): `train(spec)` with our FSDP over the world, our HSDP
(FSDP over a Mesh) at 2 x 2 and at its DDP-like end 4 x 1, and torch's HSDP (TorchFSDP2 over a 2D mesh) at 2 x 2
trains exactly like one process (tests/layout_reference.py): the same losses and gathered parameters, compared with ==
and torch.equal in fp32 (over the world and at 4 x 1 in the slow tier: test_hsdp checks our FSDP exactly on those
meshes, and test_fullstep over the world through `train`). In the same ranks, bench_layouts' axis timer
(systems.bench.axes) replays a step's collectives on each axis's own groups.

Why exact: under gloo our collectives sum in rank order (systems.parallel.collectives), which the reference
reproduces, including the mean of the losses `train` reports; torch's FSDP2 at 2 x 2 sums two terms per group and
divides by 2 before and after, exact in binary (tests/test_hsdp.py). A reduction over the wrong group (the world
instead of the shard group), a replicate all-reduce left out, or a rank taking another's rows changes the result
far beyond any rounding. Under NCCL only the 2 x 2 runs are exact (every group sums two terms) where the GPU's
kernels are deterministic; this file runs on gloo. A layout that does not fit the process group fails before
anything is built, on every rank, naming both.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from layout_reference import assert_trained_alike, train_one_process
from systems.parallel import spec as spec_module
from systems.accounting.traffic import fsdp_collectives
from systems.bench import axes
from systems.bench.axes import axis_timer
from spawned_ranks import results_by_rank
from systems.levers.layout import Layout
from systems.levers.variant import Variant
from systems.parallel.parallelize import full_parameters
from systems.parallel.spec import Schedule, TrainSpec
from systems.parallel.train import train
from systems.precision import PRECISIONS
from systems.step import make_model

BASE = TrainSpec(preset="tiny", variant="fsdp", precision="fp32", batch_size=2, context=12, lr=1e-2,
                 fsdp_gather="layer")
SCHEDULE = Schedule(warmup=0, steps=3)
SPECS = {"fsdp-1x4": BASE,
         "hsdp-2x2": dataclasses.replace(BASE, variant="hsdp", layout="2x2", fsdp_gather="block"),
         "hsdp-4x1": dataclasses.replace(BASE, variant="hsdp", layout="4x1"),
         "torch-hsdp-2x2": dataclasses.replace(BASE, variant="torch-hsdp", layout="2x2")}
WORLD_SIZE = 4
SLOW = ("fsdp-1x4", "hsdp-4x1")
GUARDED = "hsdp-2x2"  # trained whatever is selected: test_training_moves_every_parameter and the replay read it


def trained_parameters(model, step) -> dict:
    """`train`'s `then`: the parameters, whole."""
    return {"params": full_parameters(model)}


# The step's collectives of HSDP 2 x 2 replayed axis by axis (systems.bench.axes, bench_layouts' timer), in the
# same ranks after its training: each on its axis's group, of the step's sizes.
AXIS_SPEC, AXIS_ROUNDS = SPECS[GUARDED], 2


def replayed_axes(model, step) -> dict:
    """The axis timer of bench_layouts, its collectives recorded: (kind, the group's ranks, each rank's numel)."""
    calls = []

    def recorded(kind: str, collective, numel_of):
        def record(*args):
            group = args[-1]
            calls.append((kind, tuple(dist.get_process_group_ranks(group)), numel_of(*args)))
            return collective(*args)
        return record

    layout = AXIS_SPEC.layout_for(WORLD_SIZE)
    collectives = fsdp_collectives(AXIS_SPEC.config(), AXIS_SPEC.precision, layout, AXIS_SPEC.fsdp_gather)
    timer = axis_timer(layout, collectives, plain_all_reduce=False, rounds=AXIS_ROUNDS)
    with (mock.patch.object(axes, "all_gather", recorded("all_gather", axes.all_gather,
                                                         lambda outputs, shards, name, group: shards[0].numel())),
          mock.patch.object(axes, "reduce_scatter_mean",
                            recorded("reduce_scatter", axes.reduce_scatter_mean,
                                     lambda outputs, fulls, name, group: outputs[0].numel())),
          mock.patch.object(axes, "all_reduce_mean", recorded("all_reduce", axes.all_reduce_mean,
                                                              lambda tensor, name, group: tensor.numel()))):
        return timer(model, step) | {"calls": calls, "schedule": collectives}


def trained_and_replayed(model, step) -> dict:
    """AXIS_SPEC's `then`: its parameters, whole, and the axis timer's replay."""
    return trained_parameters(model, step) | {"axes": replayed_axes(model, step)}


def train_every_spec(selected: frozenset[str]) -> dict:
    specs = {name: spec for name, spec in SPECS.items() if name in selected or name == GUARDED}
    results = {name: train(spec, SCHEDULE, trained_and_replayed if name == GUARDED else trained_parameters)
               for name, spec in specs.items()}
    try:
        train(dataclasses.replace(BASE, variant="hsdp", layout="2x3"), SCHEDULE)
    except ValueError as error:  # raised on every rank before any collective: the group stays usable
        results["mismatch"] = str(error)
    if dist.get_rank() == 0:
        for name, spec in specs.items():
            layout = spec.layout_for(WORLD_SIZE)
            results[name]["reference"] = train_one_process(spec, SCHEDULE, layout, torch.device("cpu"))
    return results


trained = results_by_rank("trained", train_every_spec, gloo_world_sizes=(WORLD_SIZE,), timeout=600,
                          nccl_world_sizes=(), selects="name")


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else [])
                                  for name in SPECS])
def test_every_layout_trains_exactly_like_one_process(trained, name):
    for rank, result in enumerate(trained):
        assert_trained_alike(result[name], trained[0][name]["reference"], f"rank {rank}")


def test_training_moves_every_parameter(trained):
    """Guards the comparisons against a run in which nothing trains."""
    params = trained[0][GUARDED]["params"]
    torch.manual_seed(BASE.seed)
    initial = make_model(BASE.config(), torch.device("cpu"), PRECISIONS["fp32"])
    assert all(not torch.equal(params[name], p.detach()) for name, p in initial.named_parameters())


def test_each_axis_replays_the_steps_collectives_on_its_own_groups(trained):
    """Per axis, an untimed round and AXIS_ROUNDS timed ones of that axis's collectives, in order, each on this
    rank's group along that axis (shard: (0, 1), (2, 3); replicate: (0, 2), (1, 3)), of the step's sizes; a time
    for each axis."""
    layout = AXIS_SPEC.layout_for(WORLD_SIZE)
    for rank, result in enumerate(trained):
        replayed = result[GUARDED]["axes"]
        group = {axis: next(g for g in layout.groups((axis,)) if rank in g) for axis in ("shard", "replicate")}
        expected = [(c.kind, group[axis], c.numel) for axis in ("shard", "replicate")
                    for _ in range(1 + AXIS_ROUNDS) for c in replayed["schedule"] if c.axis == axis]
        assert replayed["calls"] == expected, f"rank {rank}"
        assert set(replayed["axis_seconds"]) == {"shard", "replicate"}
        assert all(seconds > 0 for seconds in replayed["axis_seconds"].values())


def test_a_layout_that_does_not_fit_the_group_fails_on_every_rank_naming_both(trained):
    assert all(result["mismatch"] == "hsdp's layout 2x3 has 6 ranks; this process group has 4" for result in trained)


@pytest.mark.parametrize("text, layout", [("2x2", Layout(2, 2)), ("1x4", Layout(shard=4)), ("4X1", Layout(4)),
                                          ("1x2x2", Layout(1, 2, 2))])
def test_layout_text_is_replicas_by_shards_then_tensor(text, layout):
    assert Layout.parse(text) == layout
    assert Layout.parse(str(layout)) == layout


@pytest.mark.parametrize("text", ["2", "2x", "x2", "2x2x2x2", "2*2", "-1x4", "0x4", "two x two"])
def test_a_bad_layout_is_refused_by_name(text):
    with pytest.raises(ValueError, match="layout|Layout"):
        TrainSpec(variant="hsdp", layout=text)


@pytest.mark.parametrize("fields, message", [
    (dict(variant="hsdp"), "hsdp needs a layout of replicas x shards"),
    (dict(variant="torch-hsdp"), "torch-hsdp needs a layout"),
    (dict(variant="fsdp", layout="2x2"), "a layout is for hsdp, torch-hsdp, fsdp-tp, torch-fsdp-tp; fsdp shares the "
                                         "step over every rank"),
    (dict(variant="bucketed", layout="4x1"), "bucketed shares the step over every rank"),
    (dict(variant="hsdp", layout="1x2x2"), "no tensor parallelism"),
    (dict(variant="hsdp", layout="2x2", optimizer="sharded"), "shards the optimizer state itself"),
])
def test_a_layout_is_checked_against_the_variant_when_the_spec_is_made(fields, message):
    with pytest.raises(ValueError, match=message):
        TrainSpec(**fields)


@pytest.mark.parametrize("variant, world_size, layout", [
    ("single", 1, Layout()), ("bucketed", 4, Layout(replicate=4)), ("torch", 2, Layout(replicate=2)),
    ("fsdp", 4, Layout(shard=4)), ("fsdp2", 8, Layout(shard=8)),
])
def test_the_other_variants_lay_out_every_rank_along_their_own_axis(variant, world_size, layout):
    assert TrainSpec(variant=variant).layout_for(world_size) == layout
    assert Variant(variant).world_layout(world_size) == layout


def test_a_spec_checks_its_levers_and_resolves_nested_levels_once_where_the_run_starts(monkeypatch):
    """Nested checkpointing's levels are the accounting's search over the model and batch: a spec is checked
    without it, `resolved` searches once (where the run starts), and the resolved spec's config has the levels
    without searching again; an unresolved spec has no config."""
    found = []

    def search(config, *args, **kwargs):
        found.append(config.num_layers)
        return (2, 1)

    monkeypatch.setattr(spec_module, "nested_checkpoint", search)
    spec = TrainSpec(checkpoint="nested-keep1", preset="small")
    assert found == []
    with pytest.raises(ValueError, match="resolved"):
        spec.config()
    resolved = spec.resolved("cpu")
    config = resolved.config()
    assert resolved.resolved("cpu") is resolved and resolved.config() == config
    assert found == [config.num_layers] and (config.checkpoint, config.checkpoint_keep) == ((2, 1), 1)
