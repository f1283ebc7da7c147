"""The whole training step with its levers on (our FSDP, activation checkpointing, the chunked cross-entropy,
systems AdamW) trains exactly like one process with FSDP and checkpointing off: the same losses and parameters,
compared with torch.equal in fp32.

Why exact: the reference is test_fsdp's (tests/layout_reference.py: each rank's micro-batch gradient made apart,
with that rank's shapes and kernels, added in rank order and halved, as FSDP's collectives do); checkpointing
recomputes the same ops on the same inputs (test_checkpointing); AdamW updates each element on its own, so a
shard's update is a slice of the whole one. The chunked loss is not exact against the whole-logits one: the
weight's gradient is a sum over chunks where the whole loss makes one matmul over every token, so the reference
runs the same chunked loss, and tests/test_loss.py checks the chunked loss against float64 within a derived
bound.

Each spec trains 3 steps through systems.parallel.train.train on 2 gloo ranks (the bench's path), then one
more step counting the blocks' forward calls, which checks that the blocks were recomputed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from layout_reference import assert_trained_alike, train_one_process
from spawned_ranks import results_by_rank
from systems.accounting import recomputed_blocks
from systems.levers.layout import Layout
from systems.parallel.ranks import rank_device
from systems.parallel.spec import Schedule, TrainSpec
from systems.parallel.train import train
from systems.precision import PRECISIONS
from systems.step import make_model

# Tokens per rank 2 x 24 = 48: chunks of 10 leave a shorter last one.
BASE = TrainSpec(preset="leaderboard-2026-tiny", variant="fsdp", precision="fp32", batch_size=2, context=24,
                 lr=1e-2, loss_chunk=10)
SCHEDULE = Schedule(warmup=0, steps=3)
SPECS = {"every1": dataclasses.replace(BASE, checkpoint="every1"),
         "nested": dataclasses.replace(BASE, checkpoint="3x1", attention="flash"),
         "every2-naive": dataclasses.replace(BASE, checkpoint="every2", attention="naive"),
         "ops-keep1": dataclasses.replace(BASE, checkpoint="ops-keep1")}


def one_more_step(model, step) -> dict:
    """The gathered parameters after one more step, and how often that step ran a block's forward."""
    calls = []
    hooks = [block.register_forward_pre_hook(lambda module, args: calls.append(1)) for block in model.module.blocks]
    step()
    for hook in hooks:
        hook.remove()
    return {"params": {name: t.cpu() for name, t in model.gather_full_params().items()}, "block_calls": len(calls)}


def reference_rank(name: str, world_size: int) -> int:
    """The rank that makes spec `name`'s one-process reference: the specs' in turn, so that the ranks share them."""
    return list(SPECS).index(name) % world_size


def train_every_spec() -> dict:
    results = {}
    for name, spec in SPECS.items():
        results[name] = train(spec, SCHEDULE, one_more_step)
    for name, spec in SPECS.items():
        if reference_rank(name, dist.get_world_size()) == dist.get_rank():
            results[name]["reference"] = train_one_process(spec, SCHEDULE, Layout(shard=dist.get_world_size()),
                                                           rank_device(), extra_step=True)
    return results


def reference_of(trained: list, name: str) -> dict:
    return trained[reference_rank(name, len(trained))][name]["reference"]


trained = results_by_rank("trained", train_every_spec, gloo_world_sizes=(2,), timeout=600)


@pytest.mark.parametrize("name", SPECS)
def test_levers_on_train_exactly_like_one_process(trained, name):
    for rank, result in enumerate(trained):
        assert_trained_alike(result[name], reference_of(trained, name), f"rank {rank}")


@pytest.mark.parametrize("name", SPECS)
def test_the_backward_recomputes_the_checkpointed_blocks(trained, name):
    config = SPECS[name].config()
    layers, checkpointed = config.num_layers, config.num_layers - config.checkpoint_keep
    blocks, _ = recomputed_blocks(checkpointed, config.checkpoint)
    assert blocks >= checkpointed
    assert all(result[name]["block_calls"] == layers + blocks for result in trained)


def test_training_moves_the_parameters_and_lowers_no_loss_to_nan(trained):
    """Guards the comparisons against a run in which nothing trains."""
    reference = reference_of(trained, "every1")
    torch.manual_seed(BASE.seed)
    initial = make_model(BASE.config(), torch.device("cpu"), PRECISIONS["fp32"])
    assert all(not torch.equal(reference["params"][name], p.detach()) for name, p in initial.named_parameters())
    assert all(loss == loss for loss in reference["losses"])
