"""The whole training step with its levers on (our FSDP, activation checkpointing, the chunked cross-entropy,
systems AdamW) trains exactly like one process with FSDP and checkpointing off: the same losses and parameters,
compared with torch.equal in fp32.

Why exact: the reference is test_fsdp's (each rank's micro-batch gradient made apart, with that rank's shapes
and kernels, added in rank order and halved, as FSDP's collectives do); checkpointing recomputes the same ops
on the same inputs (test_checkpointing); AdamW updates each element on its own, so a shard's update is a slice
of the whole one. The chunked loss is not exact against the whole-logits one: the weight's gradient is a sum
over chunks where the whole loss makes one matmul over every token, so the reference runs the same chunked loss,
and tests/test_loss.py checks the chunked loss against float64 within a derived bound.

Each spec trains 3 steps through systems.parallel.train.train on 2 gloo ranks (the bench's path), then one
more step counting the blocks' forward calls, which checks that the blocks were recomputed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from spawned_ranks import results_by_rank
from systems.accounting import recomputed_blocks
from systems.optim import AdamW
from systems.parallel.ranks import rank_device
from systems.parallel.spec import TrainSpec
from systems.parallel.train import Rank, rank_batches, train
from systems.precision import PRECISIONS
from systems.step import make_model

# Tokens per rank 2 x 24 = 48: chunks of 10 leave a shorter last one.
BASE = TrainSpec(preset="leaderboard-2026-tiny", variant="fsdp", precision="fp32", batch_size=2, context=24,
                 warmup=0, steps=3, lr=1e-2, loss_chunk=10)
SPECS = {"every1": dataclasses.replace(BASE, checkpoint="every1"),
         "nested": dataclasses.replace(BASE, checkpoint="3x1", attention="flash"),
         "every2-naive": dataclasses.replace(BASE, checkpoint="every2", attention="naive")}


def one_more_step(model, step) -> dict:
    """The gathered parameters after one more step, and how often that step ran a block's forward."""
    calls = []
    hooks = [block.register_forward_pre_hook(lambda module, args: calls.append(1)) for block in model.module.blocks]
    step()
    for hook in hooks:
        hook.remove()
    return {"params": {name: t.cpu() for name, t in model.gather_full_params().items()}, "block_calls": len(calls)}


def one_process(spec: TrainSpec, world_size: int, device: torch.device) -> dict:
    """The same steps without FSDP or checkpointing: per-rank micro-batch gradients, summed in rank order, halved."""
    config = dataclasses.replace(spec.config(), checkpoint=(), checkpoint_keep=0, checkpoint_saves="inputs")
    torch.manual_seed(spec.seed)  # rank 0's, which FSDP broadcasts
    model = make_model(config, device, spec.precision)
    params = list(model.parameters())
    optimizer = AdamW(params, lr=spec.lr)
    steps = list(zip(*(rank_batches(config, spec, Rank(r, world_size, device)) for r in range(world_size))))
    losses = []
    for micro_batches in steps + steps[-1:]:  # the extra step runs on the last batch again
        total, step_losses = None, []
        for tokens, targets in micro_batches:
            loss = model(tokens, targets)
            grads = torch.autograd.grad(loss, params)
            total = list(grads) if total is None else [t.add_(g) for t, g in zip(total, grads)]
            step_losses.append(loss.detach())
        for param, grad in zip(params, total):
            param.grad = grad.div_(world_size)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(sum(step_losses[1:], step_losses[0]) / world_size)
    return {"losses": [loss.item() for loss in losses[:-1]],
            "params": {name: p.detach().cpu().clone() for name, p in model.named_parameters()}}


def train_every_spec() -> dict:
    results = {}
    for name, spec in SPECS.items():
        results[name] = train(spec, one_more_step)
        if dist.get_rank() == 0:
            results[name]["reference"] = one_process(spec, dist.get_world_size(), rank_device())
    return results


replicas = results_by_rank("replicas", train_every_spec, gloo_world_sizes=(2,), timeout=600)


@pytest.mark.parametrize("name", SPECS)
def test_levers_on_train_exactly_like_one_process(replicas, name):
    expected = replicas[0][name]["reference"]
    for rank, result in enumerate(replicas):
        assert result[name]["losses"] == expected["losses"], f"rank {rank}"
        actual = result[name]["params"]
        assert list(actual) == list(expected["params"])
        for param, value in expected["params"].items():
            assert torch.equal(actual[param], value), f"rank {rank}, {param}"


@pytest.mark.parametrize("name", SPECS)
def test_the_backward_recomputes_the_checkpointed_blocks(replicas, name):
    config = SPECS[name].config()
    layers, checkpointed = config.num_layers, config.num_layers - config.checkpoint_keep
    blocks, _ = recomputed_blocks(checkpointed, config.checkpoint)
    assert blocks >= checkpointed
    assert all(result[name]["block_calls"] == layers + blocks for result in replicas)


def test_training_moves_the_parameters_and_lowers_no_loss_to_nan(replicas):
    """Guards the comparisons against a run in which nothing trains."""
    reference = replicas[0]["every1"]["reference"]
    torch.manual_seed(BASE.seed)
    initial = make_model(BASE.config(), torch.device("cpu"), PRECISIONS["fp32"])
    assert all(not torch.equal(reference["params"][name], p.detach()) for name, p in initial.named_parameters())
    assert all(loss == loss for loss in reference["losses"])
