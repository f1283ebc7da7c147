"""One process computing what ranks laid out as a Layout (systems.parallel.mesh) compute: the references of the
exactness tests of FSDP, HSDP and the training loop (test_hsdp, test_fullstep, test_train_layouts,
test_multinode).

Each rank's micro-batch gradient is made apart, with that rank's shapes and kernels, and the gradients are
averaged as the layout's collectives average them under gloo (systems.parallel.collectives: every sum in rank
order, then a division): over each shard group in rank order, then those means over the replicas in replica
order. FSDP over the world is Layout(shard=N); its replicated parameters are averaged the same way. Under tensor
parallelism the ranks of a tensor group compute one micro-batch together: the reference computes it once, whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from systems.levers.layout import Layout
from systems.parallel.spec import Schedule, TrainSpec
from systems.parallel.train import Rank, build_optimizer, rank_batches
from systems.precision import PRECISIONS
from systems.recompute import Saves
from systems.step import make_model


def mean_in_order(terms: Sequence[torch.Tensor]) -> torch.Tensor:
    """terms[0] + terms[1] + ..., added one at a time, then divided by their number."""
    total = terms[0].clone()
    for term in terms[1:]:
        total.add_(term)
    return total.div_(len(terms))


def layout_mean(grads: Sequence[Sequence[torch.Tensor]], layout: Layout) -> list[torch.Tensor]:
    """Per parameter i, the ranks' gradients grads[rank][i] averaged over each shard group in rank order, then
    over the replicas in replica order."""
    return [mean_in_order([mean_in_order([grads[layout.rank(r, s, 0)][i] for s in range(layout.shard)])
                           for r in range(layout.replicate)])
            for i in range(len(grads[0]))]


def train_one_process(spec: TrainSpec, schedule: Schedule, layout: Layout, device: torch.device,
                      extra_step: bool = False) -> dict:
    """systems.parallel.train.train(spec, schedule)'s steps on `layout`'s ranks, in one process, in fp32: rank 0's
    starting weights (the wrappers broadcast them), every rank's rows of each global batch, their gradients averaged
    as `layout_mean` does, the optimizer `train` builds. Returns the losses (each step's mean over the data-parallel
    ranks, in rank order, as `train` reports them) and the parameters; `extra_step` runs the last batch once more
    (its loss left out), as test_fullstep's `one_more_step` does. Activation checkpointing is off: it recomputes
    the same ops on the same inputs (test_checkpointing)."""
    if spec.precision != PRECISIONS["fp32"]:
        raise ValueError("the reference computes in fp32")
    config = dataclasses.replace(spec.config(), checkpoint=(), checkpoint_keep=0,
                                 checkpoint_saves=Saves.INPUTS)
    torch.manual_seed(spec.seed)  # rank 0's
    model = make_model(config, device, spec.precision)
    params = list(model.parameters())
    optimizer = build_optimizer(model, spec)
    ranks = [Rank(index, layout.world_size, device, layout) for index in range(layout.world_size)]
    steps = list(zip(*(rank_batches(config, spec, schedule, rank) for rank in ranks)))
    losses = []
    for micro_batches in steps + steps[-1:] * extra_step:
        grads, step_losses = [], []
        for rank, (tokens, targets) in zip(ranks, micro_batches):
            if layout.coordinates(rank.index)["tensor"]:  # its tensor group's first rank's rows, computed there
                grads.append(None)
                continue
            loss = model(tokens, targets)
            grads.append(torch.autograd.grad(loss, params))
            step_losses.append(loss.detach())
        for param, grad in zip(params, layout_mean(grads, layout)):
            param.grad = grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(mean_in_order(step_losses).item())
    return {"losses": losses[:len(steps)],
            "params": {name: p.detach().cpu().clone() for name, p in model.named_parameters()}}


def assert_trained_alike(result: dict, expected: dict, where: str = "") -> None:
    """The same losses and parameters (names, order, dtypes and every bit) as `expected`."""
    assert result["losses"] == expected["losses"], where
    assert list(result["params"]) == list(expected["params"]), where
    for name, value in expected["params"].items():
        assert torch.equal(result["params"][name], value), f"{where} {name}"
