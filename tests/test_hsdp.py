"""FSDP over a mesh (systems.parallel.mesh) trains exactly like one process: HSDP (2 replicas x 2 shards), FSDP
(1 x 4) and its DDP-like end (4 x 1), and torch's FSDP2 over a 2D DeviceMesh beside it.

Each rank builds the model from its own seed (FSDP broadcasts rank 0's), trains 3 steps on its rows of every
global batch (rank = replica * shards + shard), and the gathered parameters and every rank's losses must equal
one process's. The reference computes each rank's micro-batch gradient separately and reduces them in the order
the 2D reduction does: for each replica, its shard group's gradients added in rank order and divided by the
shards (the reduce-scatter), then those means added in replica order and divided by the replicas (the
all-reduce across the replicate axis); the replicated parameters (norm gains) are averaged the same way. Under
gloo every collective sums in rank order (systems.parallel.collectives), so fp32 and bf16 compute compare with
torch.equal; a reduce-scatter over the world instead of the shard group, or a replicate all-reduce left out,
changes the parameters far beyond any rounding. Under NCCL only 2 x 2 runs: every group has two ranks, and a
sum of two terms is the same in any order (1 x 4 and 4 x 1 sum four terms in NCCL's ring order).

Torch's FSDP2 over a 2D mesh (TorchFSDP2) at 2 x 2 is compared exactly too: its reductions are not rank-ordered,
but each sums two terms, and it divides by 2 before the reduce-scatter and by 2 after the all-reduce, exact in
binary, so ((a/2 + b/2) + (c/2 + d/2)) / 2 is bit for bit ((a + b)/2 + (c + d)/2) / 2.

The bytes each collective sends on each axis are counted from the run and must equal systems.accounting's
hsdp_traffic; rank 0's state must equal hsdp_memory's.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.func import functional_call

from fsdp_cases import ROWS_PER_RANK, SEED, SEQ, STEPS, TRANSFORMER, batches, loss_of, rows
from layout_reference import layout_mean
from spawned_ranks import results_by_rank
from systems.accounting import fsdp_memory, hsdp_memory, hsdp_traffic
from systems.accounting.traffic import all_reduce_bytes, gather_bytes
from systems.levers.layout import Layout
from systems.model import TransformerLM
from systems.optim import AdamW
from systems.parallel import fsdp as fsdp_module
from systems.parallel.fsdp import FSDP
from systems.parallel.mesh import Mesh, device_mesh
from systems.parallel.parallelize import DATA_AXES, TorchFSDP2
from systems.parallel.ranks import rank_device
from systems.precision import PRECISIONS

LAYOUTS = {"2x2": Layout(replicate=2, shard=2), "1x4": Layout(shard=4), "4x1": Layout(replicate=4)}
COMPUTE = {"fp32": torch.float32, "bf16": torch.bfloat16}
LR = {"sgd": 0.2, "adamw": 0.01}
# (wrapper, layout, compute, optimizer, gather): ours in every layout, in bf16 (the replicas' all-reduce in bf16)
# and with AdamW by blocks; torch's FSDP2 at 2 x 2.
RUNS = [("ours", "2x2", "fp32", "sgd", "layer"), ("ours", "1x4", "fp32", "sgd", "layer"),
        ("ours", "4x1", "fp32", "sgd", "layer"), ("ours", "2x2", "bf16", "sgd", "block"),
        ("ours", "2x2", "fp32", "adamw", "block"), ("torch", "2x2", "fp32", "sgd", "block")]
NCCL_LAYOUTS = ("2x2",)  # groups of two ranks: sums no order changes


def run_id(run: tuple) -> str:
    return "-".join(run)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":  # weight decay and momentum: a sum where a mean belongs moves every weight
        return torch.optim.SGD(params, lr=LR[name], momentum=0.9, weight_decay=0.05)
    return AdamW(params, lr=LR[name], weight_decay=0.1)


def set_lr(optimizer: torch.optim.Optimizer, name: str, step: int) -> None:
    for group in optimizer.param_groups:
        group["lr"] = LR[name] * (1 + step) / 2


def train_one_process(layout: Layout, compute: str, optimizer_name: str, device) -> dict:
    """Rank micro-batches' gradients, the sharded weights' in the compute dtype, averaged over each shard group in
    rank order and then over the replicas in replica order; every rank's losses."""
    torch.manual_seed(SEED)  # rank 0's seed
    model = TransformerLM(TRANSFORMER).to(device)
    dtype = COMPUTE[compute]
    sharded = {m.weight for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    if dtype != torch.float32:  # FSDP casts a sharded layer's inputs to the compute dtype
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.register_forward_pre_hook(
                    lambda m, args: tuple(a.to(dtype) if a.is_floating_point() else a for a in args))
    params = dict(model.named_parameters())
    optimizer = make_optimizer(optimizer_name, params.values())
    losses = []
    for step, tokens, targets in batches("transformer", device, layout.world_size):
        weights = {name: p.detach().to(dtype).requires_grad_() if p in sharded else p for name, p in params.items()}
        grads, step_losses = [], []
        for rank in range(layout.world_size):
            loss = loss_of(functional_call(model, weights, (tokens[rows(rank)],)), targets[rows(rank)])
            grads.append(torch.autograd.grad(loss, list(weights.values())))
            step_losses.append(loss.detach())
        for param, grad in zip(params.values(), layout_mean(grads, layout)):
            param.grad = grad.to(param.dtype)
        set_lr(optimizer, optimizer_name, step)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(torch.stack(step_losses).cpu())
    return {"params": {name: p.detach().cpu().clone() for name, p in params.items()}, "losses": losses}


@contextlib.contextmanager
def counting(mesh: Mesh, sent: Counter):
    """Adds to sent[axis, collective] the bytes this rank sends (as the ring algorithm sends them,
    systems.accounting.traffic) in each of FSDP's collectives."""
    def axis(group) -> str:  # a collective over any other group is a bug the counts show
        return next((name for name in ("shard", "replicate") if getattr(mesh, name).group is group), repr(group))

    def all_gather(outputs, shards, name, group):
        sent[axis(group), "all_gather"] += sum(gather_bytes(dist.get_world_size(group), s.nbytes) for s in shards)
        return gather(outputs, shards, name, group)

    def reduce_scatter_mean(outputs, fulls, name, group):
        sent[axis(group), "reduce_scatter"] += sum(gather_bytes(dist.get_world_size(group), o.nbytes)
                                                   for o in outputs)
        return reduce_scatter(outputs, fulls, name, group)

    def all_reduce_mean(tensor, name, group):
        sent[axis(group), "all_reduce"] += all_reduce_bytes(dist.get_world_size(group), tensor.numel(),
                                                            tensor.itemsize)
        return all_reduce(tensor, name, group)

    gather, reduce_scatter, all_reduce = (fsdp_module.all_gather, fsdp_module.reduce_scatter_mean,
                                          fsdp_module.all_reduce_mean)
    with (mock.patch.object(fsdp_module, "all_gather", all_gather),
          mock.patch.object(fsdp_module, "reduce_scatter_mean", reduce_scatter_mean),
          mock.patch.object(fsdp_module, "all_reduce_mean", all_reduce_mean)):
        yield


def train_sharded(wrapper: str, layout_name: str, compute: str, optimizer_name: str, gather: str, device) -> dict:
    layout = LAYOUTS[layout_name]
    mesh = Mesh(layout)
    torch.manual_seed(SEED + dist.get_rank())
    model = TransformerLM(TRANSFORMER).to(device)
    if wrapper == "ours":
        wrapped = FSDP(model, None if compute == "fp32" else COMPUTE[compute], gather=gather, mesh=mesh)
    else:
        wrapped = TorchFSDP2(model, COMPUTE[compute], device_mesh(layout, DATA_AXES))
    optimizer = make_optimizer(optimizer_name, wrapped.parameters())
    mine = rows(mesh.data.index)
    losses, sent = [], Counter()
    with counting(mesh, sent) if wrapper == "ours" else contextlib.nullcontext():
        for step, tokens, targets in batches("transformer", device, layout.world_size):
            loss = loss_of(wrapped(tokens[mine]), targets[mine])
            loss.backward()
            wrapped.finish_gradient_synchronization()
            set_lr(optimizer, optimizer_name, step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=step < STEPS - 1)  # the last step's gradients stay for state_bytes
            losses.append(loss.detach().cpu())
    if wrapper == "ours":
        params = wrapped.gather_full_params()
        state = {"params": sum(p.nbytes for p in wrapped.parameters()),
                 "grads": sum(p.grad.nbytes for p in wrapped.parameters() if p.grad is not None),
                 "optimizer": sum(t.nbytes for s in optimizer.state.values() for t in s.values()
                                  if torch.is_tensor(t) and t.dim() > 0)}
    else:
        params = {name: p.full_tensor() for name, p in wrapped.module.named_parameters()}
        state = {}
    return {"params": {name: t.detach().cpu() for name, t in params.items()}, "losses": losses,
            "sent": dict(sent), "state_bytes": state}


def train_all() -> dict:
    warnings.simplefilter("error")
    torch.use_deterministic_algorithms(True)
    device = rank_device()
    runs = [run for run in RUNS if dist.get_backend() == "gloo" or run[1] in NCCL_LAYOUTS]
    results = {run: train_sharded(*run, device) for run in runs}
    if dist.get_rank() == 0:
        for training in dict.fromkeys(run[1:4] for run in runs):
            results[training] = train_one_process(LAYOUTS[training[0]], *training[1:], device)
    return results


trained = results_by_rank("trained", train_all, gloo_world_sizes=(4,), timeout=300, nccl_world_sizes=(4,))


def result_of(trained: list, run: tuple) -> list:
    if run not in trained[0]:
        pytest.skip(f"{run[1]} sums more than two terms per group in NCCL's order")
    return [result[run] for result in trained]


@pytest.mark.parametrize("run", RUNS, ids=map(run_id, RUNS))
def test_matches_one_process_exactly(trained, run):
    results, reference = result_of(trained, run), trained[0][run[1:4]]
    for rank, result in enumerate(results):
        assert list(result["params"]) == list(reference["params"])
        for name, expected in reference["params"].items():
            actual = result["params"][name]
            assert actual.dtype == expected.dtype and torch.equal(actual, expected), f"rank {rank}, {name}"


@pytest.mark.parametrize("run", RUNS, ids=map(run_id, RUNS))
def test_every_rank_loses_what_one_process_loses_on_its_rows(trained, run):
    results, reference = result_of(trained, run), trained[0][run[1:4]]
    for rank, result in enumerate(results):
        assert all(torch.equal(mine, every[rank]) for mine, every in zip(result["losses"], reference["losses"]))


def test_training_moves_every_parameter(trained):
    """Guards the comparisons against a run in which nothing trains."""
    torch.manual_seed(SEED)
    initial = dict(TransformerLM(TRANSFORMER).named_parameters())
    params = trained[0]["2x2", "fp32", "sgd"]["params"]
    assert all(not torch.equal(params[name], initial[name].detach()) for name in initial)


@pytest.mark.parametrize("run", [run for run in RUNS if run[0] == "ours"], ids=run_id)
def test_bytes_sent_on_each_axis_match_the_accounting(trained, run):
    """Every collective's bytes as the run issued them, per axis: what hsdp_traffic predicts, each of 3 steps."""
    _, layout, compute, _, gather = run
    predicted = hsdp_traffic(TRANSFORMER, PRECISIONS[compute], LAYOUTS[layout], gather)
    expected = {(axis, kind): STEPS * getattr(traffic, kind) for axis, traffic in predicted.items()
                for kind in ("all_gather", "reduce_scatter", "all_reduce") if getattr(traffic, kind)}
    for result in result_of(trained, run):
        assert {key: sent for key, sent in result["sent"].items() if sent} == expected


def test_sharded_state_matches_the_accounting(trained):
    """Rank 0 holds the largest shards of its shard group: its parameters, gradients and AdamW moments are what
    hsdp_memory predicts (a shard of ceil(numel / 2), whatever the replicas)."""
    predicted = hsdp_memory(TRANSFORMER, ROWS_PER_RANK, SEQ, PRECISIONS["fp32"], LAYOUTS["2x2"], device="cpu")
    state = result_of(trained, ("ours", "2x2", "fp32", "adamw", "block"))[0]["state_bytes"]
    assert state == {"params": predicted.params, "grads": predicted.grads, "optimizer": predicted.optimizer}


def test_traffic_by_hand():
    """TRANSFORMER (d 32, d_ff 88, vocabulary 101, 2 blocks) at 2 x 2 in fp32, a layer per group. Sharded weights
    and their chunks of ceil(numel / 2): embedding and LM head 3232 -> 1616; a block's qkv 3072 -> 1536, out 1024
    -> 512, w1, w3, w2 2816 -> 1408: 15776 chunk elements in all, 14160 without the embedding. Norm gains: 2 x 2
    x 32 + 32 = 160."""
    traffic = hsdp_traffic(TRANSFORMER, PRECISIONS["fp32"], LAYOUTS["2x2"], "layer")
    # Shard axis (2 ranks: one chunk out of two): gathers forward and backward, reduce-scatters, the gains'
    # all-reduce 2 x 1 x 80 elements.
    assert (traffic["shard"].all_gather, traffic["shard"].reduce_scatter) == (4 * (15776 + 14160), 4 * 15776)
    assert traffic["shard"].all_reduce == 4 * 2 * 80
    # Replicate axis (2 ranks): every group's chunks all-reduced, 2 x 1 x m / 2 of each (all even), and the gains.
    assert traffic["replicate"].all_reduce == 4 * 15776 + 4 * 2 * 80
    assert traffic["replicate"].all_gather == traffic["replicate"].reduce_scatter == 0
    # A block's five weights at once over 3 replicas: 6272 chunk elements, ceil(6272 / 3) = 2091 per ring step.
    blocks = hsdp_traffic(TRANSFORMER, PRECISIONS["bf16"], Layout(replicate=3, shard=2), "block")["replicate"]
    assert blocks.all_reduce == 2 * 2 * (2 * 539 + 2 * 2091) * 2 + 2 * 2 * math.ceil(160 / 3) * 4


def test_memory_by_hand():
    """The same model at 2 x 2 beside FSDP over 2 ranks (the same shards), in fp32 on gloo, a layer per group.
    Backward completes the gradients in the order LM head, then per block w2, w3, w1, out, qkv: inside block 0's
    backward, block 0's w2 and block 1's qkv are in their reduce-scatter, block 1's out and w1 in their replicas'
    all-reduce (each their chunks, concatenated, and gloo's two gathered copies: 3 x (512 + 1408) x 4 bytes),
    whose gradients FSDP would have made already ((512 + 1408) x 4). At the embedding's gradient the last
    replicated are block 0's w1 and w3 (2 x 1408 chunk elements)."""
    precision = PRECISIONS["fp32"]
    hsdp = hsdp_memory(TRANSFORMER, ROWS_PER_RANK, SEQ, precision, LAYOUTS["2x2"], device="cpu", gather="layer")
    fsdp = fsdp_memory(TRANSFORMER, ROWS_PER_RANK, SEQ, precision, 2, device="cpu", gather="layer")
    assert (hsdp.params, hsdp.grads, hsdp.optimizer) == (fsdp.params, fsdp.grads, fsdp.optimizer)
    moments = {m.name: (m.grads - f.grads, m.in_flight - f.in_flight) for m, f in zip(hsdp.moments, fsdp.moments)}
    assert moments["block 0 backward"] == (-(512 + 1408) * 4, 3 * (512 + 1408) * 4)
    assert moments["embedding gradient"] == (-2 * 1408 * 4, 3 * 2 * 1408 * 4)
    assert moments["forward"] == moments["block 1 backward"] == moments["optimizer step"] == (0, 0)


@pytest.mark.parametrize("build", [lambda: Layout(replicate=0), lambda: Layout(shard=2.0), lambda: Layout(tensor=True)],
                         ids=["zero", "float", "bool"])
def test_layout_sizes_are_positive_ints(build):
    with pytest.raises(ValueError, match="Layout"):
        build()


def test_layout_places_tensor_ranks_adjacent_then_shards_then_replicas():
    layout = Layout(replicate=2, shard=2, tensor=2)
    assert layout.groups(("tensor",)) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layout.groups(("shard",)) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert layout.groups(("replicate",)) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert layout.groups(("replicate", "shard")) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert [layout.coordinates(rank) for rank in (0, 5)] == [{"replicate": 0, "shard": 0, "tensor": 0},
                                                            {"replicate": 1, "shard": 0, "tensor": 1}]


def test_fsdp_takes_a_mesh_or_none():
    with pytest.raises(TypeError, match="mesh"):
        FSDP(torch.nn.Linear(2, 2), mesh=Layout(shard=2))
