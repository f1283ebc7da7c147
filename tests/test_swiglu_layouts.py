"""One SwiGLU layer laid out over ranks (systems.parallel.swiglu) computes what one process computes, and issues
the collectives section 8 of the 2026 handout counts (systems.accounting.ffn_layouts).

Every layout of 2 and 4 gloo ranks runs one step in float64 on fresh inputs, and every rank compares its output
rows, its input gradient and its part of each weight gradient with the whole layer's, computed in float64 on the
full batch in the same job. A batch-splitting layout averages its data ranks' gradients, each the sum over its own
rows: the whole batch's gradient / data.

Tolerance: each compared value is at most six sums deep (x w1, x w3, then y = h w2; backward dh, the weight
gradients and dx), each of at most K = max(B, D, F) products, summed in another order than the reference's (other
row splits, partial sums added across ranks). Two orders of a sum of K terms differ by at most 2 K u times the sum
of the terms' magnitudes (u = 2^-53); the first-order differences of the six sums add up: 12 K u times the
magnitudes, bounded here by the same pipeline run on absolute values (|silu(a)| <= |a|, |silu'| <= 1.1). The
realistic bug of a tensor-parallel layer, g left out (y not summed over the ranks), run in the same job, must
exceed the tolerance a thousandfold.

Bytes: each pass's collectives are counted at the dispatcher (systems.parallel.issued) and must equal the
accounting's per-rank bytes, exactly, but for our DDP's flags (an int32 per weight, all-reduced after the
gradients: 12 bytes a step). Under gloo our all-reduce is an all-gather and a rank-ordered sum, which
sends (n - 1) S instead of a ring's 2 (n - 1) / n S: the same at n = 2, twice it for tp over 4 (counted so here);
our reduce-scatter is an all-to-all, which sends what a ring's does.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from spawned_ranks import results_by_rank
from systems.accounting.ffn_layouts import SwiGLULayer
from systems.bench.ffn import handout_cost
from systems.parallel import swiglu
from systems.parallel.issued import IssuedCollectives
from systems.parallel.ranks import rank_device
from systems.parallel.swiglu import FFNLayout, Placement, lay_out, placements

BATCH, D_MODEL, D_FF, SEED = 8, 12, 16, 7
U = 2.0**-53
DELTA = 12 * max(BATCH, D_MODEL, D_FF) * U  # see the module's docstring
WEIGHTS = ("w1", "w3", "w2")


def reference(x, dy, layer):
    """The whole layer's y, dx and weight gradients in float64, and the magnitudes that bound their rounding."""
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(dy)
    exact = {"y": y.detach(), "dx": x.grad} | {name: getattr(layer, name).weight.grad for name in WEIGHTS}
    w1, w3, w2 = (getattr(layer, name).weight.abs() for name in WEIGHTS)
    a1, a3 = x.detach().abs() @ w1.T, x.detach().abs() @ w3.T
    hidden, dh = a1 * a3, dy.abs() @ w2
    d1, d3 = 1.1 * dh * a3, dh * a1
    bound = {"y": hidden @ w2.T, "dx": d1 @ w1 + d3 @ w3, "w1": d1.T @ x.abs(), "w3": d3.T @ x.abs(),
             "w2": dy.abs().T @ hidden}
    return exact, {name: DELTA * values.max().item() for name, values in bound.items()}


def local_gradients(placement: Placement, module) -> dict[str, torch.Tensor]:
    """This rank's part of each weight gradient: whole (dp), a slice of d_ff (tp), FSDP's flat shard."""
    match placement.layout:
        case FFNLayout.DP:
            return {name: getattr(module.module, name).weight.grad for name in WEIGHTS}
        case FFNLayout.TP:
            return {name: getattr(module.inner, name).weight.grad for name in WEIGHTS}
        case FFNLayout.TORCH_TP:
            return {name: getattr(module, name).weight.grad.to_local() for name in WEIGHTS}
    fsdp = module if placement.layout == FFNLayout.FSDP else module.inner
    return {unit.name.removesuffix(".weight"): unit.shard.grad for unit in fsdp.units}


def expected_part(placement: Placement, name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """The same part of the whole gradient, averaged over the data ranks."""
    tensor_index, data = rank % placement.tensor, placement.data
    if placement.tensor > 1:
        d_ff = D_FF // placement.tensor
        mine = slice(tensor_index * d_ff, (tensor_index + 1) * d_ff)
        full = full[:, mine] if name == "w2" else full[mine]
    full = full / data
    if placement.layout in (FFNLayout.FSDP, FFNLayout.FSDP_TP):
        flat, chunk = full.reshape(-1), -(-full.numel() // data)
        index = rank // placement.tensor
        return flat[index * chunk:(index + 1) * chunk]
    return full


def gloo_bytes(placement: Placement, cost) -> float:
    """The accounting's bytes, with our all-reduce as gloo runs it: an all-gather, (n - 1) S; and DDP's flags
    (which weights had a gradient: an int32 each, all-reduced after them)."""
    ours = placement.layout in (FFNLayout.TP, FFNLayout.FSDP_TP)
    sent = sum((c.devices - 1) * c.nbytes if ours and c.kind == "all-reduce" else c.bytes_sent
               for axis in cost.collectives.values() for c in axis)
    if placement.layout == FFNLayout.DP and cost.collectives:
        sent += 2 * (placement.data - 1) / placement.data * 4 * len(WEIGHTS)
    return sent


def run_layouts() -> list[dict]:
    """On every rank: each placement of this world size (and tp without g), its errors over the tolerance and
    the bytes it sent per pass."""
    device, rank = rank_device(), dist.get_rank()
    generator = torch.Generator().manual_seed(SEED)  # the same batch on every rank
    x = torch.randn(BATCH, D_MODEL, generator=generator, dtype=torch.float64).to(device)
    dy = torch.randn(BATCH, D_MODEL, generator=generator, dtype=torch.float64).to(device)
    exact, tolerance = reference(x, dy, swiglu.full_layer(D_MODEL, D_FF, device, SEED).double())
    runs = [(p, False) for layout in FFNLayout for p in placements(layout, dist.get_world_size())]
    runs.append((Placement(FFNLayout.TP, 1, dist.get_world_size()), True))
    results = []
    for placement, without_g in runs:
        no_g = mock.patch.object(swiglu, "reduce_from_region", lambda y, group: y)
        with no_g if without_g else contextlib.nullcontext():
            laid = lay_out(placement, BATCH, D_MODEL, D_FF, torch.float64, device, seed=SEED)
            x_rows = x[laid.rows].clone().requires_grad_(True)
            with IssuedCollectives() as forward:
                y = laid.module(x_rows)
            summed = not isinstance(y, AsyncCollectiveTensor) or y.completed  # the step's end waits for it
            with IssuedCollectives() as backward:
                y.backward(dy[laid.rows])
                laid.finish()
        step = handout_cost(placement, SwiGLULayer(BATCH, D_MODEL, D_FF, bytes_per_element=8))
        errors = {"y": (y - exact["y"][laid.rows]).abs().max().item() / tolerance["y"],
                  "dx": (x_rows.grad - exact["dx"][laid.rows]).abs().max().item() / tolerance["dx"]}
        for name, grad in local_gradients(placement, laid.module).items():
            errors[name] = (grad - expected_part(placement, name, exact[name], rank)).abs().max().item() \
                / tolerance[name]
        results.append({"placement": str(placement), "without_g": without_g, "errors": errors, "summed": summed,
                        "sent": (sum(forward.bytes_sent().values()), sum(backward.bytes_sent().values())),
                        "expected": tuple(gloo_bytes(placement, cost) for cost in (step.forward, step.backward))})
    return results


layout_results = results_by_rank("layout_results", run_layouts, gloo_world_sizes=(2, 4), timeout=240,
                                 nccl_world_sizes=())


def test_every_layout_computes_the_whole_layer(layout_results):
    for rank, results in enumerate(layout_results):
        for result in results:
            if not result["without_g"]:
                assert max(result["errors"].values()) <= 1, (rank, result)


def test_every_layout_has_summed_its_output_when_its_forward_returns(layout_results):
    """Else a step that only backpropagates through y (as bench_ffn's) never waits for its forward's all-reduce,
    and times the layout without it."""
    for results in layout_results:
        assert [result["placement"] for result in results if not result["summed"]] == []


def test_leaving_out_g_is_caught(layout_results):
    for results in layout_results:
        (bug,) = [result for result in results if result["without_g"]]
        assert bug["errors"]["y"] > 1000


def test_each_pass_sends_the_handouts_bytes(layout_results):
    for results in layout_results:
        for result in results:
            if not result["without_g"]:
                assert result["sent"] == pytest.approx(result["expected"], rel=1e-12), result


def test_placements_cover_each_world_size():
    assert [str(p) for layout in FFNLayout for p in placements(layout, 4)] == [
        "dp-4x1", "fsdp-4x1", "tp-1x4", "torch-tp-1x4", "fsdp-tp-2x2"]
    assert [str(p) for p in placements(FFNLayout.FSDP_TP, 8)] == ["fsdp-tp-2x4", "fsdp-tp-4x2"]
    assert placements(FFNLayout.SINGLE, 1) == [Placement(FFNLayout.SINGLE, 1, 1)]
    with pytest.raises(ValueError, match="splits the batch"):
        Placement(FFNLayout.DP, 1, 2)
    with pytest.raises(ValueError, match="evenly"):
        Placement(FFNLayout.TP, 1, 3).check_shape(8, 16)
