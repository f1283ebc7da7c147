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
weight (cast to the compute dtype with it). One spawn per process group runs every model, precision and optimizer
under warnings-as-errors and deterministic algorithms, and some of them again with deeper prefetching (more
all-gathers in flight) or with a block's weights gathered and reduce-scattered at once (`gather="block"`),
which must change when weights are gathered, never what is computed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from layout_reference import layout_mean
from memory_probes import cpu_peak_bytes
from spawned_ranks import results_by_rank
from systems.accounting import Checkpointing, checkpointed, fsdp_memory
from systems.model import TransformerLM, get_config
from systems.optim import AdamW
from systems.parallel import fsdp as fsdp_module
from systems.parallel.fsdp import FSDP, fsdp_gather_full_params, fsdp_on_after_backward, get_fsdp
from systems.parallel.mesh import Layout
from systems.parallel.ranks import rank_device
from systems.parallel.spec import TrainSpec
from systems.precision import PRECISIONS
from systems.step import forward_loss, make_model, optimizer_step, random_batch

VOCAB, WIDTH, ROWS_PER_RANK, SEQ, STEPS, SEED = 23, 10, 2, 6, 3, 4321
MODELS = ["transformer", "toy"]
COMPUTE = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZERS = ["sgd", "torch-adamw", "adamw"]
LR = {"sgd": 0.2, "torch-adamw": 0.01, "adamw": 0.01}
PREFETCHES = [1, 2, 5]  # all-gathers in flight ahead: FSDP's default, and deeper ones; 5 spans a block
GATHERS = ["layer", "block"]  # what one collective covers: a layer's weight, or a Transformer block's
TRANSFORMER = get_config("tiny", vocab_size=101, d_model=32, num_heads=4, d_ff=88, context_length=16)


class Linear(nn.Module):
    """Another codebase's own Linear: weight (out, in), applied by einsum, which saves a view of it."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / math.sqrt(d_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...i,oi->...o", x, self.weight)


class Embedding(nn.Module):
    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, width))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight[tokens]


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = Embedding(VOCAB, WIDTH)  # 230 elements
        self.hidden = Linear(WIDTH, WIDTH)  # 100
        self.bias = nn.Parameter(torch.randn(WIDTH))
        self.frozen = Linear(WIDTH, WIDTH).requires_grad_(False)
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)  # torch's, with a bias
        self.head = Linear(WIDTH, VOCAB)
        self.head.weight = self.embed.weight
        with torch.no_grad():  # LayerNorm starts at ones and zeros: make every rank's start differ
            self.norm.weight.normal_()
            self.norm.bias.normal_()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (rows, seq, width)
        x = torch.tanh(self.hidden(x) + self.bias) + self.frozen(x)
        x = x + self.mix(x)
        return self.head(self.norm(x))  # (rows, seq, vocab)


def gather_for(model_name: str, gather: str):
    """FSDP's `gather`: on the toy, which has no blocks, "block" is a policy picking the whole model, so its
    tied, frozen and trainable weights go in one group."""
    return (lambda module: isinstance(module, ToyModel)) if (model_name, gather) == ("toy", "block") else gather


def build(model_name: str, device) -> nn.Module:
    with torch.device(device):
        return TransformerLM(TRANSFORMER) if model_name == "transformer" else ToyModel()


def vocab(model_name: str) -> int:
    return TRANSFORMER.vocab_size if model_name == "transformer" else VOCAB


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR[name], momentum=0.9, weight_decay=0.05)
    kind = torch.optim.AdamW if name == "torch-adamw" else AdamW
    return kind(params, lr=LR[name], weight_decay=0.1)


def batches(model_name: str, device, world_size: int):
    """(step, tokens, targets) of each global batch: world_size * ROWS_PER_RANK rows."""
    data = torch.Generator().manual_seed(SEED)
    for step in range(STEPS):
        tokens = torch.randint(vocab(model_name), (world_size * ROWS_PER_RANK, SEQ + 1), generator=data).to(device)
        yield step, tokens[:, :-1], tokens[:, 1:]


def rows(rank: int) -> slice:
    return slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


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


TRAININGS = [(m, p, o) for m in MODELS for p in COMPUTE for o in OPTIMIZERS]
# (model, precision, optimizer, prefetch, gather): every training at depth 1 a layer at a time, each model at
# the deeper ones, and gathering blocks in every precision and with AdamW two blocks ahead.
RUNS = ([(*training, 1, "layer") for training in TRAININGS]
        + [(m, p, "sgd", k, "layer") for m in MODELS for p in ("fp32", "bf16") for k in PREFETCHES[1:]]
        + [(m, p, "sgd", 1, "block") for m in MODELS for p in COMPUTE]
        + [(m, "bf16", "adamw", 2, "block") for m in MODELS])


def train_all() -> dict:
    warnings.simplefilter("error")
    torch.use_deterministic_algorithms(True)
    world_size, device = dist.get_world_size(), rank_device()
    results = {}
    for prefetch, gather in itertools.product(PREFETCHES, GATHERS):
        results["trace", prefetch, gather] = trace_step(world_size, device, prefetch, gather)
        results["checkpointed", prefetch, gather] = trace_checkpointed_step(world_size, device, prefetch, gather)
    for run in RUNS:
        results[run] = train_sharded(*run, device, world_size)
    if dist.get_rank() == 0:  # what one process computes, whatever the prefetching
        for training in TRAININGS:
            initial, reference = train_one_process(*training, device, world_size)
            results[training] = {"initial": initial, "reference": reference}
    return results


replicas = results_by_rank("replicas", train_all, gloo_world_sizes=(2, 3), timeout=600)


def run_id(run: tuple) -> str:
    *training, prefetch, gather = run
    return "-".join(training) + f"-prefetch{prefetch}" + ("-block" if gather == "block" else "")


@pytest.mark.parametrize("run", RUNS, ids=run_id)
def test_matches_one_process_exactly(replicas, run):
    expected = replicas[0][run[:3]]["reference"]
    for rank, result in enumerate(replicas):
        actual = result[run]["params"]
        assert list(actual) == list(expected)  # the wrapped module's own names, in its order
        for name, value in expected.items():
            assert actual[name].dtype == value.dtype and torch.equal(actual[name], value), f"rank {rank}, {name}"


@pytest.mark.parametrize("model_name", MODELS)
def test_replicated_gradients_are_identical_on_every_rank(replicas, model_name):
    grads = [result[model_name, "fp32", "sgd", 1, "layer"]["replicated_grads"] for result in replicas]
    assert grads[0]
    for other in grads[1:]:
        assert list(other) == list(grads[0])
        assert all(torch.equal(other[name], grads[0][name]) for name in grads[0])


@pytest.mark.parametrize("model_name", MODELS)
def test_gradients_arrive_in_the_shards_shape_and_fp32(replicas, model_name):
    for result in replicas:
        assert all(result[model_name, "bf16", "sgd", 1, "layer"]["shard_grads"])


def test_training_moves_every_trainable_parameter(replicas):
    """Guards the comparisons against a run in which nothing trains."""
    for model_name in MODELS:
        run = replicas[0][model_name, "fp32", "sgd"]
        for name, param in build(model_name, "meta").named_parameters():
            assert torch.equal(run["reference"][name], run["initial"][name]) != param.requires_grad, name


@pytest.mark.parametrize("model_name", MODELS)
def test_each_rank_holds_its_share_of_every_sharded_weight(replicas, model_name):
    """Shards of ceil(numel / N): the sharded state per rank is 1/N of the whole, up to N - 1 elements a weight."""
    world_size = len(replicas)
    model = build(model_name, "cpu")
    sharded = {name: p.numel() for name, p in model.named_parameters()
               if any(m.weight is p for m in model.modules() if is_sharded(m))}
    numels = [result[model_name, "fp32", "sgd", 1, "layer"]["shard_numels"] for result in replicas]
    for name, numel in sharded.items():
        shares = [n[name] for n in numels]
        assert sum(shares) == numel and max(shares) == math.ceil(numel / world_size), name


@pytest.mark.parametrize("run", [run for run in RUNS if run[2] == "sgd"], ids=run_id)
def test_gathered_weights_alive_at_once_are_the_computing_layer_and_those_prefetched(replicas, run):
    """At most `prefetch + 1` consecutive groups' weights beyond the shards (in the compute dtype, a weight
    two layers share once), exactly as many as the largest such window holds, and none outlives the step: a
    prefetch too shallow, past the forward's end, or gathering a gathered weight again changes the peak."""
    prefetch = run[3]
    for result in replicas:
        uses = result[run]["gathered_sizes"]  # (group, bytes) of each use, in forward order
        windows = [dict(uses[i:i + prefetch + 1]) for i in range(len(uses))]
        assert result[run]["gathered_after_step"] == 0
        assert result[run]["peak_gathered"] == max(sum(window.values()) for window in windows)


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


@pytest.mark.parametrize("traced", TRACES, ids=map(trace_id, TRACES))
def test_forward_gathers_each_group_prefetch_groups_ahead(replicas, traced):
    """Each group's gather (a layer's, or a block's: one collective named after the block) is issued before
    the group `prefetch` before it runs, none earlier, none for the next forward."""
    for result in replicas:
        trace = result["trace", *traced]
        uses = trace["uses"]
        assert all(name.count(".") == 1 for name in uses[1:-1]) == (traced[1] == "block")  # "blocks.3"
        expected = gathered_ahead(uses, traced[0], [("run", name) for name in uses])
        assert by_group(trace, "forward") == expected


@pytest.mark.parametrize("traced", TRACES, ids=map(trace_id, TRACES))
def test_backward_gathers_each_saved_group_once_prefetch_ahead_in_reverse_order(replicas, traced):
    """The embedding saves no weight for backward, so backward gathers every other group, last first, each
    before the gradients of the group `prefetch` after it in the forward are complete (its reduce-scatter
    issued); the embedding's gradient comes last."""
    for result in replicas:
        trace = result["trace", *traced]
        uses = trace["uses"]
        saved = uses[1:][::-1]
        expected = gathered_ahead(saved, traced[0], [("reduce_scatter", name) for name in saved])
        assert by_group(trace, "backward") == expected + [("reduce_scatter", uses[0])]


@pytest.mark.parametrize("traced", TRACES, ids=map(trace_id, TRACES))
def test_checkpointed_blocks_reduce_scatter_during_backward(replicas, traced):
    """A recomputed block runs its layers again, but only the forward's uses receive gradients: every
    group's reduce-scatter is issued during backward (none waits for finish_gradient_synchronization), and
    the forward order the prefetches follow is the forward's alone."""
    for result in replicas:
        trace = result["checkpointed", *traced]
        assert trace["uses"] == result["trace", *traced]["uses"]
        issued = [name for kind, name in trace["backward"] if kind == "reduce_scatter"]
        assert sorted(issued) == sorted(trace["trainable"])


@pytest.mark.parametrize("traced", TRACES, ids=map(trace_id, TRACES))
def test_recomputation_prefetches_within_its_block_only(replicas, traced):
    """Backward gathers the LM head's saved weight, then recomputes the blocks last first, each gathering its
    layers' groups in forward order `prefetch` ahead, and nothing across a block's end (the next was
    recomputed already, or is the LM head, which saved its own)."""
    prefetch = traced[0]
    for result in replicas:
        trace = result["checkpointed", *traced]
        uses = trace["uses"]
        blocks = {}
        for name in uses[1:-1]:  # between the embedding and the LM head
            blocks.setdefault(name.split(".")[1], []).append(name)
        expected = [("gather", uses[-1])]
        for layers in reversed(blocks.values()):
            expected += gathered_ahead(layers, prefetch, [("run", name) for name in layers])
        assert [event for event in by_group(trace, "backward") if event[0] != "reduce_scatter"] == expected


@pytest.mark.parametrize("prefetch, error", [(0, ValueError), (-2, ValueError), (2.0, TypeError), ("2", TypeError),
                                             (True, TypeError)])
@pytest.mark.parametrize("build", [
    lambda k: FSDP(nn.Linear(2, 2), prefetch=k),
    lambda k: TrainSpec(variant="fsdp", fsdp_prefetch=k),
    lambda k: fsdp_memory(get_config("tiny"), 1, 8, PRECISIONS["fp32"], 2, prefetch=k),
], ids=["FSDP", "TrainSpec", "fsdp_memory"])
def test_prefetch_is_a_positive_int_checked_before_anything_runs(build, prefetch, error):
    with pytest.raises(error, match="prefetch"):
        build(prefetch)


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
    picked = [fsdp_module.linear_or_embedding(m) for m in
              (nn.Linear(2, 2), nn.Embedding(3, 2), Linear(2, 2), Embedding(3, 2), nn.LayerNorm(2),
               nn.Bilinear(2, 2, 2))]
    assert picked == [True, True, True, True, False, False]


def test_sharded_state_matches_the_accounting(replicas):
    """Rank 0 holds the largest shards: its parameters, gradients and AdamW moments are what fsdp_memory predicts."""
    predicted = fsdp_memory(TRANSFORMER, ROWS_PER_RANK, SEQ, PRECISIONS["fp32"], len(replicas), device="cpu")
    state = replicas[0]["transformer", "fp32", "adamw", 1, "layer"]["state_bytes"]
    assert state == {"params": predicted.params, "grads": predicted.grads, "optimizer": predicted.optimizer}


# Memory: a step's measured peaks against fsdp_memory. A vocabulary large next to the blocks, so the LM head's
# gathered weight and the loss's logits are large parts of the peaks, and a d_ff large next to the tokens, so the
# prefetched w2 and w3 are too.
MEMORY_MODEL = get_config("tiny", d_model=64, d_ff=512, num_layers=3, num_heads=4, vocab_size=2048,
                          context_length=128)
MEMORY_ROWS, MEMORY_SEQ = 2, 64
STEPS_MEASURED = 6
# (precision, checkpointing, loss chunk, prefetch, gather)
MEMORY_RUNS = {"fp32": ("fp32", "none", None, 1, "layer"), "bf16": ("bf16", "none", None, 1, "layer"),
               "bf16-chunked": ("bf16", "none", 48, 1, "layer"),
               # Checkpointed: every block, pairs of blocks (a recomputation holds the block below's weights),
               # and nested segments, in both precisions, with the whole loss and chunks of it.
               "fp32-blocks": ("fp32", "every1", None, 1, "layer"),
               "bf16-blocks-chunked": ("bf16", "every1", 48, 1, "layer"),
               "fp32-pairs": ("fp32", "every2", None, 1, "layer"),
               "bf16-pairs-chunked": ("bf16", "every2", 48, 1, "layer"),
               "fp32-nested": ("fp32", "2x1", None, 1, "layer"),
               "bf16-nested-chunked": ("bf16", "3x1", 48, 1, "layer"),
               # Selective: the top block left out (its weights saved, so backward prefetches them), and op-level
               # selection (the recomputation gathers its weights all the same).
               "bf16-keep-chunked": ("bf16", "every1-keep1", 48, 1, "layer"),
               "fp32-ops": ("fp32", "ops", None, 1, "layer"),
               "bf16-attn-keep-block": ("bf16", "attn-keep1", 48, 1, "block"),
               # A block's weights in flight ahead: the chunked loss's backward peaks with them beside the LM head;
               # a recomputation's prefetches stay inside its segment, which it holds whole anyway.
               "bf16-chunked-prefetch5": ("bf16", "none", 48, 5, "layer"),
               "fp32-pairs-prefetch5": ("fp32", "every2", None, 5, "layer"),
               # Block groups: a block's gradients wait for its last, two blocks' reduce-scatters in flight, and
               # whole blocks prefetched (two ahead beside the LM head in the chunked loss's backward).
               "fp32-block": ("fp32", "none", None, 1, "block"), "bf16-block": ("bf16", "none", None, 1, "block"),
               "bf16-chunked-prefetch2-block": ("bf16", "none", 48, 2, "block"),
               "fp32-pairs-block": ("fp32", "every2", None, 1, "block")}


def memory_config(precision_name: str, scheme: str, chunk: int | None):
    return checkpointed(Checkpointing.parse(scheme), dataclasses.replace(MEMORY_MODEL, loss_chunk=chunk),
                        MEMORY_ROWS, MEMORY_SEQ, PRECISIONS[precision_name], device="cpu")


def measure_peaks() -> dict:
    """Each run's forward and whole-step peaks on this rank (CPU allocations above the state between steps),
    the least of STEPS_MEASURED steps: gloo's worker threads sometimes free a buffer where the profiler does not see
    it, which only ever adds to a measurement (measured on a loaded 2-core host: about one step in five, the
    same few values each time; the least of three steps then missed the clean value now and then)."""
    if rank_device().type != "cpu":
        return {}
    return {name: measure_run(*run) for name, run in MEMORY_RUNS.items()}


def measure_run(precision_name: str, scheme: str, chunk: int | None, prefetch: int, gather: str) -> dict:
    config = memory_config(precision_name, scheme, chunk)
    precision = PRECISIONS[precision_name]
    torch.manual_seed(SEED)
    wrapped = FSDP(make_model(config, torch.device("cpu"), precision), compute_dtype=precision.compute,
                   prefetch=prefetch, gather=gather)
    optimizer = AdamW(wrapped.parameters())
    tokens, targets = random_batch(config, MEMORY_ROWS, MEMORY_SEQ, torch.device("cpu"))

    def forward():
        return forward_loss(wrapped, tokens, targets, precision)

    def step():
        forward().backward()
        wrapped.finish_gradient_synchronization()
        optimizer_step(optimizer)

    step()  # allocates the optimizer state
    state = sum(t.nbytes for t in itertools.chain(wrapped.parameters(), wrapped.buffers()))
    state += sum(t.nbytes for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    return {"forward": state + min(cpu_peak_bytes(forward, "gloo:") for _ in range(STEPS_MEASURED)),
            "step": state + min(cpu_peak_bytes(step, "gloo:") for _ in range(STEPS_MEASURED)),
            "gathered": wrapped.gathered.peak}


peaks = results_by_rank("peaks", measure_peaks, gloo_world_sizes=(2, 3), timeout=600)


def predicted_memory(run: str, world_size: int):
    precision_name, scheme, chunk, prefetch, gather = MEMORY_RUNS[run]
    config = memory_config(precision_name, scheme, chunk)
    return fsdp_memory(config, MEMORY_ROWS, MEMORY_SEQ, PRECISIONS[precision_name], world_size, device="cpu",
                       prefetch=prefetch, gather=gather)


@pytest.mark.parametrize("run", MEMORY_RUNS)
def test_step_peak_matches_the_accounting(peaks, run):
    """Rank 0 (the largest shards) against fsdp_memory's forward and whole-step peaks. Within 3%: the terms the
    accounting leaves out are per-token vectors (norms' rsqrt, log-sum-exp) under 0.5% here, and the least
    measurement of several steps still moves by up to 2% from run to run (gloo's threads). Not run: checkpointed fp32
    blocks with a chunked loss, whose forward peaks 2% above the loss where the LM head's weight is gathered,
    into gloo's staging copy of it, which the accounting leaves out."""
    if not peaks[0]:
        pytest.skip("CPU allocations are measured on gloo ranks only")
    predicted = predicted_memory(run, len(peaks))
    assert peaks[0][run]["forward"] == pytest.approx(predicted.at("forward"), rel=0.03)
    assert peaks[0][run]["step"] == pytest.approx(predicted.peak, rel=0.03)


@pytest.mark.parametrize("run", [run for run, (_, scheme, *_) in MEMORY_RUNS.items() if scheme == "none"])
def test_gathered_peak_matches_the_accounting(peaks, run):
    """FSDP's own count of the gathered weights it holds, exact where the peaks' tolerance is not: the most is
    the LM head's with the `prefetch` weights after it in backward (the top block's w2 onwards), as many as the
    forward holds while the top block's layers prefetch the head. Under checkpointing autograd holds recomputed
    weights that FSDP has let go, so it is left out."""
    if not peaks[0]:
        pytest.skip("CPU allocations are measured on gloo ranks only")
    predicted = predicted_memory(run, len(peaks))
    assert peaks[0][run]["gathered"] == max(moment.gathered for moment in predicted.moments)
