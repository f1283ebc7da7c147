"""Tensor parallelism (systems.parallel.tensor) trains like one process: TP over 2 and 4 ranks, TP with our FSDP
on a 2 x 2 mesh (dp x tp), and torch's DTensor TP over 2, each 3 steps of SGD against the plain model.

Each rank builds the model from its own seed (tensor_parallel and FSDP broadcast the first rank's), TP ranks train
on the same rows and data-parallel ranks on their own. The reference trains the unsharded model in one process,
each data-parallel rank's micro-batch gradient averaged in rank order. Every rank's full parameters (its slices,
gathered over the TP group by the test's own indexing) and losses are compared with a tolerance:

TP computes the same sums as one process, grouped otherwise: a row-parallel layer's output is its ranks' partial
products added (g), a column-parallel region's input gradient its ranks' parts added (f), and each rank's matmuls
run over slices, which BLAS may block otherwise. Two orders of a sum of K fp32 terms differ by at most 2 K u times
the sum of the terms' magnitudes (Higham's gamma_K for either, u = 2^-24); K <= 2 d_ff = 176 here (SwiGLU's f adds
w1's and w3's parts). A gradient lies downstream of at most 16 such sums (2 blocks x 2 regions x f and g x the
forward and backward of their matmuls), each adding its relative difference once to first order, the terms being
of the gradient's scale: DELTA = 16 x 2 x 176 x 2^-24 = 3.4e-4 of it. SGD moves a weight by lr x its momentum-summed
gradients, so the runs differ by at most DELTA times the weight's movement M (measured on the reference: max
|trained - initial| over the tensor) plus one rounding of the weight per step (2^-23 |w| each). A loss differs by
at most DELTA of itself. Measured: ~1 ulp. The realistic bugs, run in the same job (f or g left out, the fused qkv
split into contiguous rows instead of by heads, replicated gradients not averaged over dp), must exceed that
tolerance 100-fold; a w2 split on the wrong dimension fails the shapes check (and the matmul).
"""

from __future__ import annotations

import contextlib
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from fsdp_cases import SEED, STEPS, TRANSFORMER, batches, loss_of, rows
from spawned_ranks import process_groups, results_by_rank, worker_group
from systems.levers.layout import Layout
from systems.model import TransformerLM
from systems.parallel import tensor as tensor_module
from systems.parallel.fsdp import FSDP
from systems.parallel.mesh import Mesh, device_mesh
from systems.parallel.ranks import rank_device

U = 2.0**-24
DELTA = 16 * 2 * 2 * TRANSFORMER.d_ff * U  # see the module's docstring
SHARDED = ("attn.qkv", "attn.out", "ffn.w1", "ffn.w3", "ffn.w2")
# (what, layout) per world size: ours and the bugs, torch's.
RUNS = {2: [("ours", Layout(tensor=2)), ("torch", Layout(tensor=2)), ("no-f", Layout(tensor=2)),
            ("no-g", Layout(tensor=2)), ("heads-as-rows", Layout(tensor=2))],
        4: [("ours", Layout(tensor=4)), ("ours", Layout(shard=2, tensor=2)),
            ("replicated-not-averaged", Layout(shard=2, tensor=2))]}
BUGS = ("no-f", "no-g", "heads-as-rows", "replicated-not-averaged")


def run_id(run: tuple) -> str:
    what, layout = run
    return f"{what}-dp{layout.shard}-tp{layout.tensor}"


def sgd(params) -> torch.optim.Optimizer:  # weight decay and momentum: a sum where a mean belongs shows
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.05, foreach=False)


def set_lr(optimizer: torch.optim.Optimizer, step: int) -> None:
    for group in optimizer.param_groups:
        group["lr"] = 0.1 * (1 + step)


def head_slices(index: int, size: int) -> list[int]:
    """The heads rank `index` of `size` holds, one by one."""
    per_rank = TRANSFORMER.num_heads // size
    return list(range(index * per_rank, (index + 1) * per_rank))


def local_slice(name: str, full: torch.Tensor, index: int, size: int) -> torch.Tensor:
    """Rank `index`'s slice of a full weight, spelled out head by head and row by row."""
    d_head, d_ff = TRANSFORMER.d_head, TRANSFORMER.d_ff // size
    if name.endswith("attn.qkv.weight"):  # rows: q of heads 0..H-1, then k, then v
        return torch.cat([full[part * TRANSFORMER.d_model + h * d_head:][:d_head]
                          for part in range(3) for h in head_slices(index, size)])
    if name.endswith("attn.out.weight"):  # columns: head after head
        return torch.cat([full[:, h * d_head:(h + 1) * d_head] for h in head_slices(index, size)], dim=1)
    if name.endswith(("ffn.w1.weight", "ffn.w3.weight")):
        return full[index * d_ff:(index + 1) * d_ff]
    if name.endswith("ffn.w2.weight"):
        return full[:, index * d_ff:(index + 1) * d_ff]
    return full


def full_from_slices(name: str, slices: list[torch.Tensor]) -> torch.Tensor:
    """The full weight from every TP rank's slice (local_slice undone)."""
    size = len(slices)
    if not any(name.endswith(f"{part}.weight") for part in SHARDED):
        return slices[0]
    shape = {"qkv": (3 * TRANSFORMER.d_model, TRANSFORMER.d_model), "out": (TRANSFORMER.d_model,) * 2,
             "w1": (TRANSFORMER.d_ff, TRANSFORMER.d_model), "w3": (TRANSFORMER.d_ff, TRANSFORMER.d_model),
             "w2": (TRANSFORMER.d_model, TRANSFORMER.d_ff)}[name.split(".")[-2]]
    full = torch.zeros(shape, dtype=slices[0].dtype)
    marks = torch.arange(full.numel(), dtype=torch.float64).view(shape)  # where each element of a slice goes
    for index, part in enumerate(slices):
        where = local_slice(name, marks, index, size).long().flatten()
        full.view(-1)[where] = part.flatten()
    return full


def gather_over(group, tensor: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return [part.cpu() for part in parts]


def train_ours(what: str, layout: Layout, device) -> dict:
    mesh = Mesh(layout)
    torch.manual_seed(SEED + dist.get_rank())
    model = tensor_module.tensor_parallel(TransformerLM(TRANSFORMER).to(device), mesh.tensor.group)
    if what == "heads-as-rows":  # qkv's rows split into contiguous chunks, as if a rank's heads were adjacent
        for block in model.blocks:
            full = full_from_slices("attn.qkv.weight", gather_over(mesh.tensor.group, block.attn.qkv.weight.detach()))
            chunk = len(full) // layout.tensor
            block.attn.qkv.weight.data = full[mesh.tensor.index * chunk:][:chunk].to(device)
    sliced = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    wrapped = FSDP(model, mesh=mesh) if layout.shard > 1 else model
    bugs = {"no-f": mock.patch.object(tensor_module._CopyToRegion, "backward", lambda ctx, grad: (grad, None)),
            "no-g": mock.patch.object(tensor_module._ReduceFromRegion, "forward", lambda ctx, x, group: x.clone()),
            "replicated-not-averaged": mock.patch.object(FSDP, "_average_replicated_gradients", lambda self: None)}
    optimizer = sgd(wrapped.parameters())
    losses = []
    with bugs.get(what, contextlib.nullcontext()):
        for step, tokens, targets in batches("transformer", device, layout.shard):
            mine = rows(mesh.data.index)
            loss = loss_of(wrapped(tokens[mine]), targets[mine])
            loss.backward()
            if layout.shard > 1:
                wrapped.finish_gradient_synchronization()
            set_lr(optimizer, step)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach().cpu())
    local = wrapped.gather_full_params() if layout.shard > 1 else dict(model.named_parameters())
    params = {name: full_from_slices(name, gather_over(mesh.tensor.group, p.detach())) for name, p in local.items()}
    return {"params": params, "losses": losses, "sliced": sliced,
            "replicated": {name: p.detach().cpu() for name, p in local.items() if not name.endswith(
                tuple(f"{part}.weight" for part in SHARDED))}}


def train_torch(layout: Layout, device) -> dict:
    torch.manual_seed(SEED + dist.get_rank())
    model = tensor_module.torch_tensor_parallel(TransformerLM(TRANSFORMER).to(device),
                                                device_mesh(layout, ("tensor",)))
    optimizer = sgd(model.parameters())
    losses = []
    for step, tokens, targets in batches("transformer", device, 1):
        loss = loss_of(model(tokens), targets)
        loss.backward()
        set_lr(optimizer, step)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().cpu())
    params = {}
    for name, p in model.named_parameters():
        full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
        if name.endswith("attn.qkv.weight"):
            full = tensor_module.qkv_in_model_order(full, TRANSFORMER, layout.tensor)
        params[name] = full
    return {"params": params, "losses": losses}


def train_one_process(data_ranks: int, device) -> dict:
    torch.manual_seed(SEED)
    model = TransformerLM(TRANSFORMER).to(device)
    initial = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    optimizer = sgd(model.parameters())
    losses = []
    for step, tokens, targets in batches("transformer", device, data_ranks):
        grads, step_losses = [], []
        for rank in range(data_ranks):
            loss = loss_of(model(tokens[rows(rank)]), targets[rows(rank)])
            grads.append(torch.autograd.grad(loss, list(model.parameters())))
            step_losses.append(loss.detach().cpu())
        for i, param in enumerate(model.parameters()):
            total = grads[0][i].clone()
            for rank in range(1, data_ranks):
                total.add_(grads[rank][i])
            param.grad = total.div_(data_ranks)
        set_lr(optimizer, step)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(torch.stack(step_losses))
    return {"initial": initial, "params": {name: p.detach().cpu().clone() for name, p in model.named_parameters()},
            "losses": losses}


def train_all(selected: frozenset[tuple]) -> dict:
    warnings.simplefilter("error")
    torch.backends.cuda.matmul.allow_tf32 = False  # the tolerance is fp32's (torch's default, made sure of)
    device = rank_device()
    runs = [run for run in RUNS[dist.get_world_size()] if run in selected]
    results = {}
    for what, layout in runs:
        results[what, layout] = train_torch(layout, device) if what == "torch" else train_ours(what, layout, device)
    if dist.get_rank() == 0:
        for data_ranks in {layout.shard for _, layout in runs}:
            results["reference", data_ranks] = train_one_process(data_ranks, device)
    return results


WORLD_SIZES = (2, 4)  # under gloo and NCCL alike
GROUPS = process_groups(WORLD_SIZES, WORLD_SIZES, worker_group=worker_group(train_all, "ranks"))
ranks = results_by_rank("ranks", train_all, WORLD_SIZES, timeout=300, nccl_world_sizes=WORLD_SIZES, selects="run")


def runs(*whats: str):
    """Parametrize a test by ("ranks", "run"): each run under each process group of its size, the bugs in the slow
    tier (they show the tolerance is tight; ours and torch's runs catch what they plant). Module-scoped, so that the
    ranks fixture launches each group once for every test of the module."""
    params = [pytest.param(group.values[0], run, id=f"{group.id}-{run_id(run)}",
                           marks=[*group.marks] + ([pytest.mark.slow] if run[0] in BUGS else []))
              for group in GROUPS for run in RUNS[group.values[0][1]] if run[0] in whats]
    return pytest.mark.parametrize("ranks, run", params, indirect=["ranks"], scope="module")


def results_of(ranks: list, run: tuple) -> list:
    return [result[run] for result in ranks]


def excess(result: dict, reference: dict, data_rank: int) -> float:
    """The largest difference from the reference, parameters and the rank's losses, in units of the tolerance
    (see the module's docstring)."""
    worst = 0.0
    for name, expected in reference["params"].items():
        moved = (expected - reference["initial"][name]).abs().max()
        tolerance = STEPS * 2 * U * expected.abs() + DELTA * moved
        worst = max(worst, ((result["params"][name] - expected).abs() / tolerance).max().item())
    for mine, every in zip(result["losses"], reference["losses"]):
        worst = max(worst, ((mine - every[data_rank]).abs() / (DELTA * every[data_rank].abs())).item())
    return worst


@runs("ours", "torch")
def test_matches_one_process_within_rounding(ranks, run):
    results = results_of(ranks, run)
    reference = ranks[0]["reference", run[1].shard]
    for rank, result in enumerate(results):
        assert list(result["params"]) == list(reference["params"])
        assert excess(result, reference, run[1].coordinates(rank)["shard"]) <= 1, f"rank {rank}"


@runs(*BUGS)
def test_realistic_bugs_fail_by_far_more_than_the_tolerance(ranks, run):
    results = results_of(ranks, run)
    reference = ranks[0]["reference", run[1].shard]
    for rank, result in enumerate(results):
        assert excess(result, reference, run[1].coordinates(rank)["shard"]) > 100, f"rank {rank}"


@runs("ours")
def test_replicated_parameters_stay_identical_on_every_rank(ranks, run):
    """The embedding, norms and LM head: one computation on identical inputs across TP ranks, averaged in one
    order across dp ranks."""
    results = results_of(ranks, run)
    for result in results[1:]:
        assert all(torch.equal(result["replicated"][name], value) for name, value in results[0]["replicated"].items())


@runs("ours")
def test_each_rank_keeps_its_heads_and_d_ff_slices(ranks, run):
    """Shapes: qkv (3 d/T, d), out (d, d/T), w1 and w3 (d_ff/T, d), w2 (d, d_ff/T); values, before FSDP's
    broadcast over dp: the slices of the model of the TP group's first rank, picked head by head (a contiguous
    third of qkv's rows or a w2 split by rows fails)."""
    layout = run[1]
    for rank, result in enumerate(results_of(ranks, run)):
        index = layout.coordinates(rank)["tensor"]
        torch.manual_seed(SEED + rank - index)  # tensor ranks are adjacent: the group's first is rank - index
        full = dict(TransformerLM(TRANSFORMER).named_parameters())
        for name, value in result["sliced"].items():
            assert torch.equal(value, local_slice(name, full[name].detach(), index, layout.tensor)), (rank, name)


def test_local_slices_of_the_full_weights_reassemble_them():
    """The test's own indexing: every rank's slices put back give the weight (for the comparisons above)."""
    for name, shape in (("attn.qkv.weight", (96, 32)), ("attn.out.weight", (32, 32)), ("ffn.w2.weight", (32, 88))):
        full = torch.randn(shape)
        for size in (2, 4):
            assert torch.equal(full_from_slices(name, [local_slice(name, full, i, size) for i in range(size)]), full)


def test_heads_and_d_ff_must_split_evenly():
    with pytest.raises(ValueError, match="num_heads"):
        with mock.patch.object(dist, "get_world_size", return_value=3), mock.patch.object(dist, "get_rank",
                                                                                         return_value=0):
            tensor_module.tensor_parallel(TransformerLM(TRANSFORMER), None)
