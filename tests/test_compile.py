"""Regional torch.compile (TransformerConfig.compile: each block compiled, identical blocks sharing one graph) inside
our FSDP and under activation checkpointing: the same losses and gradients as eager, within the rounding that
reordered fp32 sums allow, and compiled once: no graph break or recompilation after the first step, and graph
breaks only at FSDP's hooks, which run eagerly between a block's graphs.

One spawn of 2 gloo ranks runs the selected cases (by default every block checkpointed, where a bug of either
shows; without checkpointing, and with the fused Triton kernels inside the compiled blocks, in the slow tier):
each rank runs the eager model in float64 (the reference, without the kernels, which compute in fp32), the eager
model in fp32 and the compiled one, on the same rank batches, and reports each step's loss and the gradients of
its shards and replicated parameters, and Dynamo's counters after each step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from spawned_ranks import results_by_rank
from plain_error import check_near_plain
from systems.kernels.launch import interpreted as kernels_interpreted
from systems.model import TransformerLM, get_config
from systems.parallel.fsdp import FSDP
from systems.parallel.ranks import rank_device

MODEL = get_config("tiny", vocab_size=101, d_model=32, num_heads=4, d_ff=88, context_length=16, num_layers=3)
ROWS, SEQ, STEPS, SEED = 2, 9, 3, 1234
# (checkpoint, fused)
CASES = {"none": ((), "none"), "every1": ((1,), "none"), "every1-fused": ((1,), "all")}


def run(levels: tuple[int, ...], fused: str, compile: bool, dtype: torch.dtype) -> dict:
    """STEPS forward and backward passes through FSDP (no optimizer: every step sees the same weights), on this
    rank's rows of fresh batches."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # each case compiles and counts its own graphs: none are shared with the case before
    counters.clear()
    torch.manual_seed(SEED)
    config = dataclasses.replace(MODEL, checkpoint=levels, fused=fused, compile=compile, loss_chunk=7)
    with torch.device(rank_device()):
        wrapped = FSDP(TransformerLM(config).to(dtype))
    data = torch.Generator().manual_seed(SEED + dist.get_rank())
    steps = []
    for _ in range(STEPS):
        batch = torch.randint(MODEL.vocab_size, (ROWS, SEQ + 1), generator=data).to(rank_device())
        loss = wrapped(batch[:, :-1], batch[:, 1:])
        loss.backward()
        wrapped.finish_gradient_synchronization()
        grads = [p.grad.detach().cpu().clone() for p in wrapped.parameters()]
        wrapped.zero_grad(set_to_none=True)
        steps.append({"loss": loss.detach().cpu(), "grads": grads,
                      "graph_breaks": dict(counters["graph_break"]), "graphs": counters["stats"]["unique_graphs"],
                      "recompiles": sum(counters["recompiles"].values())})
    return steps


def fused_kernels_run_here() -> bool:
    """Triton runs the kernels on CUDA tensors, or on CPU tensors under its interpreter (no GPU): a gloo rank of
    a GPU host computes on the CPU with kernels compiled for the GPU."""
    return rank_device().type == "cuda" or kernels_interpreted()


def run_all(selected: frozenset[str]) -> dict:
    return {name: {"float64": run(levels, "none", False, torch.float64),
                   "eager": run(levels, fused, False, torch.float32),
                   "compiled": run(levels, fused, True, torch.float32)}
            for name, (levels, fused) in CASES.items()
            if name in selected and (fused == "none" or fused_kernels_run_here())}


def runs_of(ranks: list, case: str) -> list:
    if case not in ranks[0]:
        pytest.skip("the fused kernels run on the GPU here: the NCCL ranks check them")
    return [rank[case] for rank in ranks]


ranks = results_by_rank("ranks", run_all, gloo_world_sizes=(2,), timeout=900, selects="case")
CASE_PARAMS = [pytest.param(name, marks=[] if name == "every1" else [pytest.mark.slow]) for name in CASES]


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_compiled_blocks_match_eager(ranks, case):
    """Each step's loss and every gradient on every rank against float64, within tests/plain_error.py's rule of
    eager fp32's error: the compiled graphs compute the same function with other orders of the same fp32 sums,
    and fuse ops eager rounds apart."""
    for runs in runs_of(ranks, case):
        for step, (exact, plain, compiled) in enumerate(zip(runs["float64"], runs["eager"], runs["compiled"])):
            check_near_plain([compiled["loss"], *compiled["grads"]], [plain["loss"], *plain["grads"]],
                             [exact["loss"], *exact["grads"]], f"step {step}, ")


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_blocks_compile_once_breaking_only_at_fsdps_hooks(ranks, case):
    """The first step compiles (identical blocks share the graphs); later steps and the recomputations run what it
    compiled, with no new graph, graph break or recompilation. Every graph break is at a hook FSDP runs eagerly
    (torch.compiler.disable): a gather around each sharded layer, and its saved-tensor hooks. The fused kernels'
    autograd Functions trace into the graphs (their launches are custom ops)."""
    for runs in runs_of(ranks, case):
        first, *later = runs["compiled"]
        assert first["graphs"] > 0 and first["recompiles"] == 0
        assert all((step["graphs"], step["graph_breaks"], step["recompiles"]) ==
                   (first["graphs"], first["graph_breaks"], 0) for step in later)
        others = [reason for reason in first["graph_breaks"] if "disable" not in reason]
        assert first["graph_breaks"] and not others, "graph breaks not at FSDP's hooks:\n" + "\n\n".join(others)
