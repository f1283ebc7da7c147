"""When FSDP gathers and reduce-scatters: the order of its collectives and of the sharded modules' calls in a
step, at each prefetch depth and gather (a layer's weight, or a block's), with and without every block
checkpointed, traced on 2 gloo ranks (3 in the slow tier) against the order worked out from the forward's uses."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from fsdp_cases import GATHERS, PREFETCHES, TRANSFORMER, batches, build, loss_of, rows
from spawned_ranks import results_by_rank
from systems.model import TransformerLM
from systems.parallel import fsdp as fsdp_module
from systems.parallel.fsdp import FSDP
from systems.parallel.ranks import rank_device


@contextlib.contextmanager
def recording(wrapped: FSDP, events: list):
    """Appends ("run", name) as each sharded module runs, and ("gather", name) and ("reduce_scatter", name) as
    FSDP issues its collectives."""
    for unit in wrapped.units:
        for module in unit.modules:  # registered after FSDP's: runs once the weight is gathered
            module.register_forward_pre_hook(lambda m, args, name=unit.name: events.append(("run", name)))
    gather, reduce_scatter = fsdp_module.all_gather, fsdp_module.reduce_scatter_mean
    with (mock.patch.object(fsdp_module, "all_gather", side_effect=lambda out, shard, name, group: events.append(
              ("gather", name)) or gather(out, shard, name, group)),
          mock.patch.object(fsdp_module, "reduce_scatter_mean", side_effect=lambda out, full, name, group:
                            events.append(("reduce_scatter", name)) or reduce_scatter(out, full, name, group))):
        yield


def trace_step(world_size: int, device, prefetch: int, gather: str) -> dict:
    """The order of collectives and module calls in a second step's forward and backward (the first has no
    order to prefetch by)."""
    rank = dist.get_rank()
    wrapped = FSDP(build("transformer", device), prefetch=prefetch, gather=gather)
    events = []
    with recording(wrapped, events):
        for step, tokens, targets in batches("transformer", device, world_size):
            events.clear()
            logits = wrapped(tokens[rows(rank)])
            forward = list(events)
            events.clear()
            loss_of(logits, targets[rows(rank)]).backward()
            backward = list(events)
            wrapped.finish_gradient_synchronization()
            if step == 1:
                return {"forward": forward, "backward": backward, "uses": [g.name for g in wrapped._order],
                        "groups": {u.name: u.group.name for u in wrapped.units}}


def trace_checkpointed_step(world_size: int, device, prefetch: int, gather: str) -> dict:
    """All-gathers, module calls and reduce-scatters of one step of the Transformer with every block
    checkpointed, and which of them backward issued."""
    rank = dist.get_rank()
    with torch.device(device):
        wrapped = FSDP(TransformerLM(dataclasses.replace(TRANSFORMER, checkpoint=(1,))), prefetch=prefetch,
                       gather=gather)
    events = []
    with recording(wrapped, events):
        _, tokens, targets = next(batches("transformer", device, world_size))
        logits = wrapped(tokens[rows(rank)])
        events.clear()
        loss_of(logits, targets[rows(rank)]).backward()
        backward = list(events)
        wrapped.finish_gradient_synchronization()
    return {"backward": backward, "uses": [g.name for g in wrapped._order],
            "groups": {u.name: u.group.name for u in wrapped.units},
            "trainable": list(dict.fromkeys(u.group.name for u in wrapped.units if u.shard.requires_grad))}


def gathered_ahead(names: list[str], prefetch: int, marks: list[tuple]) -> list[tuple]:
    """The events of using groups `names` in turn with `prefetch` gathers in flight ahead: before use i
    records `marks[i]`, the gathers up to use i + prefetch are issued, each group's once."""
    events, issued = [], 0
    for i, mark in enumerate(marks):
        ahead = min(len(names), i + 1 + prefetch)
        events += [("gather", name) for name in names[issued:ahead]]
        issued = max(issued, ahead)
        events.append(mark)
    return events


def by_group(trace: dict, phase: str) -> list[tuple]:
    """The phase's events with each layer's run named by its group, and a group's consecutive runs as one."""
    events = []
    for kind, name in trace[phase]:
        event = (kind, trace["groups"][name] if kind == "run" else name)
        if kind != "run" or not events or events[-1] != event:
            events.append(event)
    return events


TRACES = list(itertools.product(PREFETCHES, GATHERS))
trace_id = "prefetch{0[0]}-{0[1]}".format


def trace_all() -> dict:
    warnings.simplefilter("error")
    torch.use_deterministic_algorithms(True)
    world_size, device = dist.get_world_size(), rank_device()
    return {(kind, *traced): trace(world_size, device, *traced) for traced in TRACES
            for kind, trace in (("trace", trace_step), ("checkpointed", trace_checkpointed_step))}


# The order of collectives does not depend on the ranks' number: 3 ranks (uneven shards) in the slow tier.
traces = results_by_rank("traces", trace_all, gloo_world_sizes=(2,), slow_gloo_world_sizes=(3,), timeout=300)


@pytest.mark.parametrize("traced", TRACES, ids=map(trace_id, TRACES))
def test_forward_gathers_each_group_prefetch_groups_ahead(traces, traced):
    """Each group's gather (a layer's, or a block's: one collective named after the block) is issued before
    the group `prefetch` before it runs, none earlier, none for the next forward."""
    for result in traces:
        trace = result["trace", *traced]
        uses = trace["uses"]
        assert all(name.count(".") == 1 for name in uses[1:-1]) == (traced[1] == "block")  # "blocks.3"
        expected = gathered_ahead(uses, traced[0], [("run", name) for name in uses])
        assert by_group(trace, "forward") == expected


@pytest.mark.parametrize("traced", TRACES, ids=map(trace_id, TRACES))
def test_backward_gathers_each_saved_group_once_prefetch_ahead_in_reverse_order(traces, traced):
    """The embedding saves no weight for backward, so backward gathers every other group, last first, each
    before the gradients of the group `prefetch` after it in the forward are complete (its reduce-scatter
    issued); the embedding's gradient comes last."""
    for result in traces:
        trace = result["trace", *traced]
        uses = trace["uses"]
        saved = uses[1:][::-1]
        expected = gathered_ahead(saved, traced[0], [("reduce_scatter", name) for name in saved])
        assert by_group(trace, "backward") == expected + [("reduce_scatter", uses[0])]


@pytest.mark.parametrize("traced", TRACES, ids=map(trace_id, TRACES))
def test_checkpointed_blocks_reduce_scatter_during_backward(traces, traced):
    """A recomputed block runs its layers again, but only the forward's uses receive gradients: every
    group's reduce-scatter is issued during backward (none waits for finish_gradient_synchronization), and
    the forward order the prefetches follow is the forward's alone."""
    for result in traces:
        trace = result["checkpointed", *traced]
        assert trace["uses"] == result["trace", *traced]["uses"]
        issued = [name for kind, name in trace["backward"] if kind == "reduce_scatter"]
        assert sorted(issued) == sorted(trace["trainable"])


@pytest.mark.parametrize("traced", TRACES, ids=map(trace_id, TRACES))
def test_recomputation_prefetches_within_its_block_only(traces, traced):
    """Backward gathers the LM head's saved weight, then recomputes the blocks last first, each gathering its
    layers' groups in forward order `prefetch` ahead, and nothing across a block's end (the next was
    recomputed already, or is the LM head, which saved its own)."""
    prefetch = traced[0]
    for result in traces:
        trace = result["checkpointed", *traced]
        uses = trace["uses"]
        blocks = {}
        for name in uses[1:-1]:  # between the embedding and the LM head
            blocks.setdefault(name.split(".")[1], []).append(name)
        expected = [("gather", uses[-1])]
        for layers in reversed(blocks.values()):
            expected += gathered_ahead(layers, prefetch, [("run", name) for name in layers])
        assert [event for event in by_group(trace, "backward") if event[0] != "reduce_scatter"] == expected
