"""The training loop with tensor parallelism (`train(spec)`, systems.parallel.parallelize): ours and torch's TP alone
over 2 ranks (`tp`, `torch-tp`: Layout(tensor=2)) and under FSDP on a 2 x 2 mesh (`fsdp-tp`, `torch-fsdp-tp`:
Layout(shard=2, tensor=2)) train like one process (tests/layout_reference.py, in fp32), within a tolerance.

Why a tolerance: TP computes the same sums as one process, grouped otherwise (each row-parallel layer's output is
its ranks' partial products added, each column-parallel region's input gradient its ranks' parts), so its gradients
differ by rounding. As in tests/test_tensor_parallel.py, two orders of a sum of K <= 2 d_ff fp32 terms differ by at
most 2 K u of the terms' magnitudes (u = 2^-24), and a gradient lies downstream of at most 16 such sums (2 blocks
x 2 regions x f and g x forward and backward): DELTA = 16 x 2 x 2 d_ff x u = 9.8e-4 of the terms' scale, for the
tiny preset (d_ff = 256). A loss differs by at most DELTA of itself. AdamW normalizes each gradient by its running
RMS: a gradient moved by a relative d moves the step m / sqrt(v) by at most 2 d relative (m and v each by d), and a
step is at most about lr, so to first order a weight differs by at most STEPS x 2 DELTA x lr. That holds where a
gradient's rounding is small beside the gradient itself; where the terms cancel to within their rounding (a rare
vocabulary row of the LM head, a weight whose gradient changes sign from step to step), Adam's normalized step
turns on the rounding and may move by up to 2 lr. So each tensor may have a few elements beyond the bound: at most
1 in MAX_BEYOND. A bug moves nearly every element by about lr: TP ranks taking different rows (run here beside ours,
under `rows-of-each-rank`), a global batch of world-size rows per rank, slices gathered in another order than the
model's, qkv's rows in torch's order.

In the same ranks, each wrapper shows that parallelize applies TP before FSDP: our FSDP shards each rank's TP
slices (a unit's shape is 1/T of the weight's, its shard 1/(S T)), and FSDP2's DTensors span the shard and tensor
axes with a local part of 1/(S T).
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from layout_reference import train_one_process
from spawned_ranks import process_groups, results_by_rank, worker_group
from systems.levers.layout import Layout
from systems.levers.variant import Variant
from systems.parallel.__main__ import parse_args
from systems.parallel.fsdp import FSDP
from systems.parallel.parallelize import full_parameters
from systems.parallel.ranks import rank_device
from systems.parallel.spec import Schedule, TrainSpec
from systems.parallel.train import Rank, train

BASE = TrainSpec(preset="tiny", variant="tp", precision="fp32", batch_size=2, context=12, lr=1e-2, fsdp_gather="layer")
SCHEDULE = Schedule(warmup=0, steps=3)
CONFIG = BASE.config()
U = 2.0**-24
DELTA = 16 * 2 * 2 * CONFIG.d_ff * U  # see the module's docstring
BOUND = SCHEDULE.steps * 2 * DELTA * BASE.lr
MAX_BEYOND = 1000
# Per world size, the runs: ours and torch's, alone and under FSDP, and a bug.
SPECS = {2: {"tp": BASE, "torch-tp": dataclasses.replace(BASE, variant="torch-tp"), "rows-of-each-rank": BASE},
         4: {name: dataclasses.replace(BASE, variant=name, layout="1x2x2") for name in ("fsdp-tp", "torch-fsdp-tp")}}


def rows_of_each_rank() -> contextlib.ExitStack:
    """The data-parallel loop's rows under TP: each rank its own (by its global rank) of a batch of world-size rows,
    so the ranks of a tensor group compute on different rows."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(Rank, "data_index", property(lambda rank: rank.index)))
    stack.enter_context(mock.patch.object(Rank, "data_size", property(lambda rank: rank.world_size)))
    return stack


BUGS = {"rows-of-each-rank": rows_of_each_rank}
MEASURED_AGAINST = "tp"  # the run whose reference the bugs are measured against
SPLIT = "blocks.0.attn.qkv.weight"  # (3 d_model, d_model) whole


def trained_parameters(model, step) -> dict:
    """`train`'s `after_training`: the parameters, whole, and how the wrapper holds qkv."""
    held = {}
    if isinstance(model, FSDP):
        unit = next(unit for unit in model.units if unit.name == SPLIT)
        held = {"shape": tuple(unit.shape), "shard": unit.shard.numel()}
    else:
        param = dict(model.module.named_parameters())[SPLIT]
        if hasattr(param, "device_mesh"):
            held = {"axes": param.device_mesh.mesh_dim_names, "local": param.to_local().numel()}
    return {"params": full_parameters(model), "held": held}


def train_every_spec(selected: frozenset[str]) -> dict:
    wanted = selected | ({MEASURED_AGAINST} if selected & set(BUGS) else set())
    specs = {name: spec for name, spec in SPECS[dist.get_world_size()].items() if name in wanted}
    results = {}
    for name, spec in specs.items():
        with BUGS.get(name, contextlib.nullcontext)():
            results[name] = train(spec, SCHEDULE, trained_parameters)
    if dist.get_rank() == 0:
        for name, spec in specs.items():
            if name not in BUGS:
                # On the ranks' device: under NCCL the weights come from the GPU's generator, as the ranks' do.
                results[name]["reference"] = train_one_process(spec, SCHEDULE, spec.layout_for(dist.get_world_size()),
                                                               rank_device())
    return results


WORLD_SIZES = tuple(SPECS)  # under gloo and NCCL alike
GROUPS = process_groups(WORLD_SIZES, WORLD_SIZES, worker_group=worker_group(train_every_spec, "trained"))
trained = results_by_rank("trained", train_every_spec, WORLD_SIZES, timeout=600, nccl_world_sizes=WORLD_SIZES,
                          selects="name")


def runs(*names: str):
    """Parametrize a test by ("trained", "name"): each run under each process group of its size, the bugs in the
    slow tier (they show the bound is tight; the runs of ours and torch's catch what they plant). Module-scoped, so
    that the fixture launches each group's job once for every test of the module."""
    params = [pytest.param(group.values[0], name, id=f"{group.id}-{name}",
                           marks=[*group.marks] + ([pytest.mark.slow] if name in BUGS else []))
              for group in GROUPS for name in SPECS[group.values[0][1]] if name in names]
    return pytest.mark.parametrize("trained, name", params, indirect=["trained"], scope="module")


def beyond(result: dict, reference: dict) -> dict[str, float]:
    """Per parameter, the fraction of its elements farther from the reference than BOUND; the losses' largest
    difference in units of DELTA of the loss."""
    assert list(result["params"]) == list(reference["params"])
    fractions = {}
    for name, expected in reference["params"].items():
        assert result["params"][name].shape == expected.shape, name
        fractions[name] = ((result["params"][name] - expected).abs() > BOUND).float().mean().item()
    fractions["losses"] = max(abs(mine - theirs) / (DELTA * abs(theirs))
                              for mine, theirs in zip(result["losses"], reference["losses"], strict=True))
    return fractions


@runs("tp", "torch-tp", "fsdp-tp", "torch-fsdp-tp")
def test_tensor_parallel_trains_like_one_process_within_rounding(trained, name):
    reference = trained[0][name]["reference"]
    for rank, result in enumerate(trained):
        fractions = beyond(result[name], reference)
        assert fractions.pop("losses") <= 1, f"rank {rank}"
        assert max(fractions.values()) <= 1 / MAX_BEYOND, f"rank {rank}: {fractions}"


@runs("rows-of-each-rank")
def test_ranks_of_a_tensor_group_taking_their_own_rows_fail_by_far(trained, name):
    """The bug the data-parallel index guards against (Rank.rows by global rank): most elements beyond BOUND."""
    fractions = beyond(trained[0][name], trained[0][MEASURED_AGAINST]["reference"])
    fractions.pop("losses")
    assert sorted(fractions.values())[len(fractions) // 2] > 0.5


@runs("fsdp-tp", "torch-fsdp-tp")
def test_parallelize_applies_tensor_parallelism_before_fsdp(trained, name):
    """Our FSDP's unit of qkv is a TP slice, (3 d / T, d), and its shard 1/S of that; torch's qkv is a DTensor over
    the shard and tensor axes, 1/(S T) of the weight on each rank."""
    whole = 3 * CONFIG.d_model * CONFIG.d_model
    for result in trained:
        held = result[name]["held"]
        if name == "fsdp-tp":
            assert held == {"shape": (3 * CONFIG.d_model // 2, CONFIG.d_model), "shard": whole // 4}
        else:
            assert held["axes"][-2:] == ("shard", "tensor") and held["local"] == whole // 4, held


def test_tensor_parallel_ranks_share_rows_and_data_ranks_split_the_batch():
    layout = Layout(shard=2, tensor=2)
    ranks = [Rank(index, 4, torch.device("cpu"), layout) for index in range(4)]
    assert [rank.rows(3) for rank in ranks] == [slice(0, 3), slice(0, 3), slice(3, 6), slice(3, 6)]
    assert {rank.data_size for rank in ranks} == {2}


@pytest.mark.parametrize("flags, variant, layout", [
    (["--variant", "tp"], Variant.TP, None), (["--variant", "torch-tp"], Variant.TORCH_TP, None),
    (["--variant", "fsdp-tp", "--layout", "1x2x2"], Variant.FSDP_TP, Layout(shard=2, tensor=2)),
    (["--variant", "torch-fsdp-tp", "--layout", "2x1x2"], Variant.TORCH_FSDP_TP, Layout(replicate=2, tensor=2))])
def test_torchrun_takes_tensor_parallel_variants_and_layouts(flags, variant, layout):
    launch, spec, schedule = parse_args(["--backend", "gloo", *flags])
    assert (spec.variant, spec.layout) == (variant, layout)


@pytest.mark.parametrize("variant, world_size, layout", [
    ("tp", 4, Layout(tensor=4)), ("torch-tp", 2, Layout(tensor=2))])
def test_tensor_parallelism_alone_splits_every_rank_along_the_tensor_axis(variant, world_size, layout):
    assert TrainSpec(variant=variant).layout_for(world_size) == layout


@pytest.mark.parametrize("fields, message", [
    (dict(variant="fsdp-tp"), "fsdp-tp needs a layout of replicas x shards x tensor, e.g. 1x2x2"),
    (dict(variant="torch-fsdp-tp", layout="2x2"), "torch-fsdp-tp splits every block over the layout's tensor axis"),
    (dict(variant="hsdp", layout="1x2x2"), "layout 1x2x2: hsdp has no tensor parallelism; fsdp-tp"),
    (dict(variant="tp", layout="1x1x2"), "tp shares the step over every rank"),
    (dict(variant="tp", optimizer="sharded"), "tp splits the weights and their state itself: use optimizer 'adamw'"),
])
def test_a_tensor_parallel_layout_is_checked_against_the_variant(fields, message):
    with pytest.raises(ValueError, match=message):
        TrainSpec(**fields)
