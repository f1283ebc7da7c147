"""FSDP trains exactly like one process does, with 1/N of the weights per rank.

Each rank builds the model from its own seed (FSDP broadcasts rank 0's), trains 3 steps on its rows of
every global batch with a learning rate that changes each step, and the gathered full parameters must equal
those of one process training on all rows. The reference is exact arithmetic, not a tolerance: it computes
each rank's micro-batch gradient separately (the same shapes, casts and kernels as that rank's backward),
adds them in rank order in the gradient's dtype and divides by N, which is what FSDP's collectives compute
(systems.parallel.collectives: under gloo a rank-ordered sum at any N; under NCCL on 2 ranks a two-term
sum, which no order changes, and a halving, exact in binary), then casts to fp32 and steps the optimizer on
fp32 masters. Optimizers update each element on its own, so a shard's update is the same slice of the
full one. So fp32, bf16 and fp16 compute are all compared with torch.equal: the low-precision runs round
the same values in the same places as the reference (weights cast before the gather, gradients summed in
the compute dtype), and a tolerance would only hide a wrong cast.

Models: the project's TransformerLM (sizes not divisible by 3), and a toy built from its own classes named
Linear and Embedding (not torch's), with an LM head tied to the embedding, a frozen layer, a bias and a
LayerNorm that stay replicated, and a torch Linear whose bias is replicated too but computes with its sharded
weight (cast to the compute dtype with it). One spawn per process group runs the selected models, precisions and
optimizers (by default every pair of them) under warnings-as-errors and deterministic algorithms, and some of them
again with deeper prefetching (more all-gathers in flight) or with a block's weights gathered and reduce-scattered
at once (`gather="block"`), which must change when weights are gathered, never what is computed.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.func import functional_call

from covering import tiered
from fsdp_cases import (MODELS, PREFETCHES, ROWS_PER_RANK, SEED, SEQ, STEPS, TRANSFORMER, Embedding, Linear, ToyModel,
                        batches, build, loss_of, rows)
from layout_reference import layout_mean
from spawned_ranks import results_by_rank
from systems.accounting import fsdp_memory
from systems.levers.layout import Layout
from systems.model import get_config
from systems.optim import AdamW
from systems.parallel.fsdp import FSDP, fsdp_gather_full_params, fsdp_on_after_backward, get_fsdp
from systems.parallel.fsdp_units import linear_or_embedding
from systems.parallel.ranks import rank_device
from systems.parallel.spec import TrainSpec
from systems.precision import PRECISIONS

COMPUTE = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZERS = ["sgd", "torch-adamw", "adamw"]
LR = {"sgd": 0.2, "torch-adamw": 0.01, "adamw": 0.01}


def gather_for(model_name: str, gather: str):
    """FSDP's `gather`: on the toy, which has no blocks, "block" is a policy picking the whole model, so its
    tied, frozen and trainable weights go in one group."""
    return (lambda module: isinstance(module, ToyModel)) if (model_name, gather) == ("toy", "block") else gather


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR[name], momentum=0.9, weight_decay=0.05)
    kind = torch.optim.AdamW if name == "torch-adamw" else AdamW
    return kind(params, lr=LR[name], weight_decay=0.1)


def set_lr(optimizer: torch.optim.Optimizer, name: str, step: int) -> None:
    for group in optimizer.param_groups:
        group["lr"] = LR[name] * (1 + step) / 2


def is_sharded(module: nn.Module) -> bool:
    """The reference's own reading of the policy: torch's or any class named Linear or Embedding."""
    return isinstance(module, (nn.Linear, nn.Embedding)) or type(module).__name__ in ("Linear", "Embedding")


def train_one_process(model_name: str, precision: str, optimizer_name: str, device, world_size: int):
    """The same training in one process: rank micro-batches, their gradients averaged in rank order.
    Returns the parameters before and after (a CUDA model starts from other values than a CPU one)."""
    torch.manual_seed(SEED)  # rank 0's seed
    model = build(model_name, device)
    initial = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    dtype = COMPUTE[precision]
    sharded = {m.weight for m in model.modules() if is_sharded(m)}
    own = {p for m in model.modules() if is_sharded(m) for name, p in m.named_parameters(recurse=False)
           if name != "weight"}  # a Linear's bias: cast with its weight, its gradient summed in its own dtype
    if dtype is not None:
        for module in model.modules():
            if is_sharded(module):
                module.register_forward_pre_hook(
                    lambda m, args: tuple(a.to(dtype) if a.is_floating_point() else a for a in args))
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    optimizer = make_optimizer(optimizer_name, trainable.values())
    for step, tokens, targets in batches(model_name, device, world_size):
        # Sharded weights in the compute dtype, as leaves of their own: their gradients stay in it.
        weights = {name: (p.detach().to(dtype).requires_grad_(p.requires_grad) if dtype is not None and p in sharded
                          else p.to(dtype) if dtype is not None and p in own else p)
                   for name, p in model.named_parameters()}
        leaves = [weights[name] if p in sharded else p for name, p in trainable.items()]
        grads = [torch.autograd.grad(loss_of(functional_call(model, weights, (tokens[rows(rank)],)),
                                         targets[rows(rank)]), leaves)
                 for rank in range(world_size)]
        for param, grad in zip(trainable.values(), layout_mean(grads, Layout(shard=world_size))):
            param.grad = grad.to(param.dtype)
        set_lr(optimizer, optimizer_name, step)
        optimizer.step()
        optimizer.zero_grad()
    return initial, {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


def train_sharded(model_name: str, precision: str, optimizer_name: str, prefetch: int, gather: str, device,
                  world_size: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(SEED + rank)
    wrapped = get_fsdp(build(model_name, device), COMPUTE[precision], prefetch=prefetch,
                       gather=gather_for(model_name, gather))
    optimizer = make_optimizer(optimizer_name, wrapped.parameters())
    for step, tokens, targets in batches(model_name, device, world_size):
        loss_of(wrapped(tokens[rows(rank)]), targets[rows(rank)]).backward()
        fsdp_on_after_backward(wrapped, optimizer)
        set_lr(optimizer, optimizer_name, step)
        optimizer.step()
        if step < STEPS - 1:
            optimizer.zero_grad()
    shards = [unit.shard for unit in wrapped.units]
    return {"params": {name: t.cpu() for name, t in fsdp_gather_full_params(wrapped).items()},
            "replicated_grads": {name: p.grad.cpu().clone() for name, p in wrapped.module.named_parameters()
                                 if p.grad is not None},
            "shard_numels": {unit.name: unit.shard.numel() for unit in wrapped.units},
            "shard_grads": [(s.grad.shape, s.grad.dtype) == (s.shape, s.dtype) for s in shards if s.requires_grad],
            "state_bytes": {"params": sum(p.nbytes for p in wrapped.parameters()),
                            "grads": sum(p.grad.nbytes for p in wrapped.parameters() if p.grad is not None),
                            "optimizer": sum(t.nbytes for state in optimizer.state.values() for t in state.values()
                                             if torch.is_tensor(t) and t.dim() > 0)},
            "peak_gathered": wrapped.gathered.peak,
            "gathered_after_step": wrapped.gathered.bytes,
            "gathered_sizes": [(g.name, sum(u.chunk * world_size * u.dtype.itemsize for u in g.units))
                               for g in wrapped._order]}


# (model, precision, optimizer, prefetch, gather): every training at depth 1 a layer at a time, each model at
# the deeper ones, and gathering blocks in every precision and with AdamW two blocks ahead; each with its tier's
# marks: the depth-1 trainings and the deeper depths as pairwise covering arrays (tests/covering.py), the rest of
# those grids in the slow tier.
RUN_CASES = ([((*training, 1, "layer"), marks) for training, marks in tiered(MODELS, list(COMPUTE), OPTIMIZERS)]
             + [((m, p, "sgd", k, "layer"), marks)
                for (m, p, k), marks in tiered(MODELS, ("fp32", "bf16"), PREFETCHES[1:])]
             + [((m, p, "sgd", 1, "block"), []) for m in MODELS for p in COMPUTE]
             + [((m, "bf16", "adamw", 2, "block"), []) for m in MODELS])
RUNS = [run for run, _ in RUN_CASES]
# What the tests other than the comparisons with one process read: trained whatever is selected, in the default tier.
READ = ([(m, p, "sgd", 1, "layer") for m in MODELS for p in ("fp32", "bf16")]
        + [("transformer", "fp32", "adamw", 1, "layer")])


def run_id(run: tuple) -> str:
    *training, prefetch, gather = run
    return "-".join(training) + f"-prefetch{prefetch}" + ("-block" if gather == "block" else "")


def run_params(keep: Callable[[tuple], bool] = lambda run: True) -> list:
    return [pytest.param(run, marks=[] if run in READ else marks, id=run_id(run))
            for run, marks in RUN_CASES if keep(run)]


def train_all(selected: frozenset[tuple]) -> dict:
    warnings.simplefilter("error")
    torch.use_deterministic_algorithms(True)
    world_size, device = dist.get_world_size(), rank_device()
    runs = [run for run in RUNS if run in selected or run in READ]
    results = {run: train_sharded(*run, device, world_size) for run in runs}
    if dist.get_rank() == 0:  # what one process computes, whatever the prefetching
        for training in dict.fromkeys(run[:3] for run in runs):
            initial, reference = train_one_process(*training, device, world_size)
            results[training] = {"initial": initial, "reference": reference}
    return results


# By default 3 ranks, which shard every weight unevenly and divide by other than 2; 2 ranks, as NCCL runs, in the
# slow tier.
trained = results_by_rank("trained", train_all, gloo_world_sizes=(3,), slow_gloo_world_sizes=(2,), timeout=600,
                          selects="run")


@pytest.mark.parametrize("run", run_params())
def test_matches_one_process_exactly(trained, run):
    expected = trained[0][run[:3]]["reference"]
    for rank, result in enumerate(trained):
        actual = result[run]["params"]
        assert list(actual) == list(expected)  # the wrapped module's own names, in its order
        for name, value in expected.items():
            assert actual[name].dtype == value.dtype and torch.equal(actual[name], value), f"rank {rank}, {name}"


@pytest.mark.parametrize("model_name", MODELS)
def test_replicated_gradients_are_identical_on_every_rank(trained, model_name):
    grads = [result[model_name, "fp32", "sgd", 1, "layer"]["replicated_grads"] for result in trained]
    assert grads[0]
    for other in grads[1:]:
        assert list(other) == list(grads[0])
        assert all(torch.equal(other[name], grads[0][name]) for name in grads[0])


@pytest.mark.parametrize("model_name", MODELS)
def test_gradients_arrive_in_the_shards_shape_and_fp32(trained, model_name):
    for result in trained:
        assert all(result[model_name, "bf16", "sgd", 1, "layer"]["shard_grads"])


def test_training_moves_every_trainable_parameter(trained):
    """Guards the comparisons against a run in which nothing trains."""
    for model_name in MODELS:
        run = trained[0][model_name, "fp32", "sgd"]
        for name, param in build(model_name, "meta").named_parameters():
            assert torch.equal(run["reference"][name], run["initial"][name]) != param.requires_grad, name


@pytest.mark.parametrize("model_name", MODELS)
def test_each_rank_holds_its_share_of_every_sharded_weight(trained, model_name):
    """Shards of ceil(numel / N): the sharded state per rank is 1/N of the whole, up to N - 1 elements a weight."""
    world_size = len(trained)
    model = build(model_name, "cpu")
    sharded = {name: p.numel() for name, p in model.named_parameters()
               if any(m.weight is p for m in model.modules() if is_sharded(m))}
    numels = [result[model_name, "fp32", "sgd", 1, "layer"]["shard_numels"] for result in trained]
    for name, numel in sharded.items():
        shares = [n[name] for n in numels]
        assert sum(shares) == numel and max(shares) == math.ceil(numel / world_size), name


@pytest.mark.parametrize("run", run_params(lambda run: run[2] == "sgd"))
def test_gathered_weights_alive_at_once_are_the_computing_layer_and_those_prefetched(trained, run):
    """At most `prefetch + 1` consecutive groups' weights beyond the shards (in the compute dtype, a weight
    two layers share once), exactly as many as the largest such window holds, and none outlives the step: a
    prefetch too shallow, past the forward's end, or gathering a gathered weight again changes the peak."""
    prefetch = run[3]
    for result in trained:
        uses = result[run]["gathered_sizes"]  # (group, bytes) of each use, in forward order
        windows = [dict(uses[i:i + prefetch + 1]) for i in range(len(uses))]
        assert result[run]["gathered_after_step"] == 0
        assert result[run]["peak_gathered"] == max(sum(window.values()) for window in windows)


@pytest.mark.parametrize("prefetch, error", [(0, ValueError), (-2, ValueError), (2.0, TypeError), ("2", TypeError),
                                             (True, TypeError)])
@pytest.mark.parametrize("build", [
    lambda k: FSDP(nn.Linear(2, 2), prefetch=k),
    lambda k: TrainSpec(variant="fsdp", fsdp_prefetch=k),
    lambda k: fsdp_memory(get_config("tiny"), 1, 8, PRECISIONS["fp32"], 2, prefetch=k),
], ids=["FSDP", "TrainSpec", "fsdp_memory"])
def test_prefetch_is_a_positive_int_checked_before_anything_runs(build, prefetch, error, request):
    if isinstance(prefetch, str) and request.node.callspec.id.startswith("TrainSpec"):
        error = None  # a spec given text parses it with the lever's parser, as torchrun's command line does
    with pytest.raises(error, match="prefetch") if error else contextlib.nullcontext():
        build(prefetch)


def test_a_spec_parses_text_with_the_levers_one_parser():
    assert TrainSpec(variant="fsdp", fsdp_prefetch="2").fsdp_prefetch == 2
    with pytest.raises(ValueError, match="prefetch must be at least 1"):
        TrainSpec(variant="fsdp", fsdp_prefetch="0")


@pytest.mark.parametrize("build", [
    lambda: FSDP(nn.Linear(2, 2), gather="blocks"),
    lambda: TrainSpec(variant="fsdp", fsdp_gather="blocks"),
    lambda: fsdp_memory(get_config("tiny"), 1, 8, PRECISIONS["fp32"], 2, gather="blocks"),
], ids=["FSDP", "TrainSpec", "fsdp_memory"])
def test_gather_is_a_known_group_or_a_policy_checked_before_anything_runs(build):
    with pytest.raises(ValueError, match="gather"):
        build()


@pytest.mark.parametrize("compute_dtype", ["bf16", torch.int32, torch.bool, torch.complex64, 16])
@pytest.mark.parametrize("build", [lambda dtype: FSDP(nn.Linear(2, 2), compute_dtype=dtype),
                                   lambda dtype: get_fsdp(nn.Linear(2, 2), dtype)], ids=["FSDP", "get_fsdp"])
def test_compute_dtype_is_a_floating_dtype_checked_before_anything_runs(build, compute_dtype):
    """A name, an integer or bool dtype, or a number would otherwise fail inside torch at the first forward or
    backward, with a message that does not name the option (no process group here: checked before any)."""
    with pytest.raises(TypeError, match="compute_dtype"):
        build(compute_dtype)


def test_default_policy_picks_classes_named_linear_or_embedding():
    picked = [linear_or_embedding(m) for m in
              (nn.Linear(2, 2), nn.Embedding(3, 2), Linear(2, 2), Embedding(3, 2), nn.LayerNorm(2),
               nn.Bilinear(2, 2, 2))]
    assert picked == [True, True, True, True, False, False]


def test_sharded_state_matches_the_accounting(trained):
    """Rank 0 holds the largest shards: its parameters, gradients and AdamW moments are what fsdp_memory predicts."""
    predicted = fsdp_memory(TRANSFORMER, ROWS_PER_RANK, SEQ, PRECISIONS["fp32"], len(trained), device="cpu")
    state = trained[0]["transformer", "fp32", "adamw", 1, "layer"]["state_bytes"]
    assert state == {"params": predicted.params, "grads": predicted.grads, "optimizer": predicted.optimizer}
