"""Every DDP variant trains exactly like one process does.

Each rank builds the model from its own seed (so the wrapper must broadcast rank 0's weights,
the frozen layer and the buffer included), trains on its slice of every global batch, and must
end with the parameters of single-process training on all slices: the mean of the slices'
losses. The toy model ties its output layer to its embedding and has a layer used on all
ranks in step 0, on none in step 1 (its gradient must stay None, or weight decay would touch
it) and on one rank only in steps 2 and 3. Optimizers: SGD with momentum and weight decay (which
catches a sum where a mean belongs), AdamW, and ShardedOptimizer(AdamW), checked against
single-process AdamW. Every variant also trains with bf16 weights (so bf16 gradients and
all-reduces; AdamW keeps fp32 master copies; autocast on) and must match single-process training
with bf16 weights to within bf16 rounding. One spawn per process group runs every variant, bucket
size, optimizer and precision and returns all results; the single-process references run in the
same ranks, on the same device.
"""

from __future__ import annotations

import gc
import weakref
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from spawned_ranks import results_by_rank
from systems.levers.buckets import fill_buckets
from systems.optim import AdamW, ShardedOptimizer
from systems.parallel.ddp import DDPBucketed, make_ddp
from systems.parallel.ranks import rank_device
from systems.precision import get_precision

VOCAB, WIDTH, ROWS_PER_RANK, SEQ, STEPS, SEED = 23, 8, 3, 5, 4, 1234
TRAINABLE = ["norm.bias", "norm.weight", "sometimes.bias", "sometimes.weight", "hidden.bias", "hidden.weight",
             "embed.weight"]  # reverse registration order; head.weight is embed.weight
# Bucket sizes, with their layouts of the fp32 parameters: below every parameter; 90 floats (a few
# buckets); everything in one bucket.
BUCKETS = {
    "per-parameter": (1e-9, [[name] for name in TRAINABLE]),
    "few": (90 * 4 / 2**20, [TRAINABLE[:4], TRAINABLE[4:6], TRAINABLE[6:]]),
    "one": (None, [TRAINABLE]),
}
VARIANTS = ["naive", "flat", "individual"] + [f"bucketed-{name}" for name in BUCKETS]
OPTIMIZERS = ["sgd", "adamw", "sharded-adamw"]  # sharded-adamw is checked against single-process AdamW
PRECISIONS = ["fp32", "bf16-weights"]
# bf16 weights train with AdamW only: its fp32 master copies keep the small updates that SGD would round away.
RUNS = [(name, "fp32") for name in OPTIMIZERS] + [("adamw", "bf16-weights"), ("sharded-adamw", "bf16-weights")]
# bf16: the ranks' gradients are summed in another order than one process sums them, which moves
# a weight by a bf16 rounding or two (2**-8 to 2**-7 relative each); unsynchronized gradients move
# about half of every weight's elements far beyond that.
TOLERANCE = {"fp32": dict(rtol=1e-5, atol=1e-6), "bf16-weights": dict(rtol=3e-2, atol=1e-3)}
ADAMW = dict(lr=0.02, weight_decay=0.1)


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.sometimes = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("shift", torch.randn(WIDTH))
        with torch.no_grad():  # LayerNorm starts at ones and zeros: make every rank's start differ
            self.norm.weight.normal_()
            self.norm.bias.normal_()

    def forward(self, tokens: torch.Tensor, use_sometimes: bool) -> torch.Tensor:
        x = self.embed(tokens) + self.shift  # (rows, seq, width)
        x = torch.tanh(self.hidden(x)) + self.frozen(x)
        if use_sometimes:
            x = x + torch.tanh(self.sometimes(x))
        return self.head(self.norm(x))  # (rows, seq, vocab)


def toy_model(precision: str, device) -> ToyModel:
    return ToyModel().to(device, get_precision(precision).weights)


def uses_sometimes(step: int, rank: int, world_size: int) -> bool:
    return [True, False, rank == 0, rank == world_size - 1][step]


def slice_loss(model, tokens, targets, step, rank, world_size, precision) -> torch.Tensor:
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    with get_precision(precision).autocast(tokens.device):
        logits = model(tokens[rows], uses_sometimes(step, rank, world_size))
        return F.cross_entropy(logits.flatten(0, 1), targets[rows].flatten())


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.2, momentum=0.9, weight_decay=0.05)
    if name == "sharded-adamw":
        return ShardedOptimizer(params, AdamW, **ADAMW)
    return AdamW(params, **ADAMW)


def wrap(variant: str, model: nn.Module) -> nn.Module:
    if variant.startswith("bucketed-"):
        return make_ddp("bucketed", model, BUCKETS[variant.removeprefix("bucketed-")][0])
    return make_ddp(variant, model)


def batches(device, world_size):
    data = torch.Generator().manual_seed(SEED)
    for step in range(STEPS):
        tokens = torch.randint(VOCAB, (world_size * ROWS_PER_RANK, SEQ + 1), generator=data).to(device)
        yield step, tokens[:, :-1], tokens[:, 1:]


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}


def train_single_process(optimizer_name: str, precision: str, device, world_size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)  # rank 0's seed
    model = toy_model(precision, device)
    optimizer = make_optimizer(optimizer_name, model.parameters())
    for step, tokens, targets in batches(device, world_size):
        losses = [slice_loss(model, tokens, targets, step, rank, world_size, precision)
                  for rank in range(world_size)]
        torch.stack(losses).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return snapshot(model)


def train_replicas() -> dict:
    """On every rank: all variants, optimizers and precisions, the references, and the bucket layouts."""
    rank, world_size, device = dist.get_rank(), dist.get_world_size(), rank_device()
    results = {"reference": {(name, precision): train_single_process(name, precision, device, world_size)
                             for name, precision in RUNS if name in ("sgd", "adamw")},
               "buckets": {}, "launched_in_backward": {}, "reduced_dtypes": {}}
    trained = {}  # variant -> weak reference to its last model
    for variant in VARIANTS:
        for optimizer_name, precision in RUNS:
            torch.manual_seed(SEED + rank)
            model = toy_model(precision, device)
            ddp = wrap(variant, model)
            optimizer = make_optimizer(optimizer_name, ddp.parameters())
            for step, tokens, targets in batches(device, world_size):
                loss = slice_loss(ddp, tokens, targets, step, rank, world_size, precision)
                with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
                    loss.backward()
                    launched_in_backward = all_reduce.call_count
                    ddp.finish_gradient_synchronization()
                if step == 0:
                    results["launched_in_backward"][variant, precision] = launched_in_backward
                    reduced = [call.args[0] for call in all_reduce.call_args_list]  # gradients, and int32 flags
                    results["reduced_dtypes"][variant, precision] = {t.dtype for t in reduced if t.is_floating_point()}
                optimizer.step()
                optimizer.zero_grad()
            results[variant, optimizer_name, precision] = snapshot(model)
            if isinstance(ddp, DDPBucketed):
                names = {param: name for name, param in model.named_parameters()}
                results["buckets"][variant, precision] = [[names[p] for p in unit.params] for unit in ddp.units]
        trained[variant] = weakref.ref(model)
    del model, ddp, optimizer
    gc.collect()
    results["freed"] = {variant: ref() is None for variant, ref in trained.items()}
    return results


# By default 4 ranks: a divisor other than 2, and exact in binary, as bf16's tolerance assumes (3 would round each
# gradient once more); 2, as NCCL runs, in the slow tier.
trained = results_by_rank("trained", train_replicas, gloo_world_sizes=(4,), slow_gloo_world_sizes=(2,), timeout=240)


@pytest.mark.parametrize("optimizer_name, precision", RUNS, ids=["-".join(run) for run in RUNS])
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_single_process_training(trained, variant, optimizer_name, precision):
    for rank, result in enumerate(trained):
        expected = result["reference"][optimizer_name.removeprefix("sharded-"), precision]
        actual = result[variant, optimizer_name, precision]
        for name, value in expected.items():
            torch.testing.assert_close(actual[name], value, **TOLERANCE[precision],
                                       msg=lambda m: f"rank {rank}, {name}: {m}")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_gradients_are_all_reduced_in_the_weights_dtype(trained, variant, precision):
    """bf16 weights have bf16 gradients: the all-reduces move half the bytes of fp32 ones."""
    for result in trained:
        assert result["reduced_dtypes"][variant, precision] == {get_precision(precision).weights}


@pytest.mark.parametrize("size", list(BUCKETS))
def test_buckets_fill_in_reverse_parameter_order(trained, size):
    for result in trained:
        assert result["buckets"][f"bucketed-{size}", "fp32"] == BUCKETS[size][1]


@pytest.mark.parametrize("variant", VARIANTS)
def test_overlapping_variants_launch_all_reduces_during_backward(trained, variant):
    """In step 0 every parameter gets a gradient, so every unit launches before backward returns."""
    expected = {"naive": 0, "flat": 0, "individual": len(TRAINABLE)}
    expected.update({f"bucketed-{name}": len(layout) for name, (_, layout) in BUCKETS.items()})
    for result in trained:
        assert result["launched_in_backward"][variant, "fp32"] == expected[variant]


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_dropped_wrapper_frees_its_module(trained, variant):
    """Gradient hooks must not keep a wrapper, its module and their memory alive once dropped."""
    for result in trained:
        assert result["freed"][variant]


def test_reference_training_moves_every_trainable_parameter(trained):
    """Guards the comparisons above against a model in which nothing trains."""
    for (_, precision), reference in trained[0]["reference"].items():
        torch.manual_seed(SEED)
        initial = snapshot(toy_model(precision, "cpu"))
        for name in TRAINABLE:
            assert not torch.allclose(reference[name], initial[name])
        torch.testing.assert_close(reference["frozen.weight"], initial["frozen.weight"], rtol=0, atol=0)


def test_a_change_of_dtype_starts_a_new_bucket():
    """A bucket is one flat tensor, so gradients of different dtypes never share one."""
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float32]
    params = [nn.Parameter(torch.zeros(2, dtype=dtype)) for dtype in dtypes]
    buckets = fill_buckets(params, None)
    assert [[p.dtype for p in bucket] for bucket in buckets] == [dtypes[:2], dtypes[2:3], dtypes[3:]]


@pytest.mark.parametrize("bucket_size_mb", [0, -1.0, float("nan")])
def test_bucketed_rejects_bad_bucket_size(bucket_size_mb):
    with pytest.raises(ValueError, match="bucket_size_mb"):
        DDPBucketed(ToyModel(), bucket_size_mb)


@pytest.mark.parametrize("variant, bucket_size_mb, message", [
    ("buckted", None, "unknown DDP variant 'buckted'"),
    ("naive", 25.0, "bucket_size_mb is for the bucketed variant"),
])
def test_make_ddp_rejects_what_it_cannot_build(variant, bucket_size_mb, message):
    with pytest.raises(ValueError, match=message):  # before any collective: no process group needed
        make_ddp(variant, torch.nn.Linear(2, 2), bucket_size_mb)
