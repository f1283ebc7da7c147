"""Selective activation checkpointing (systems.recompute): the top blocks left out (`-keepN`) and op-level
selection (`attn`, `ops`) give the same loss and gradients as keeping every activation, and the memory and FLOPs
systems.accounting predicts for them, checked against autograd's saved tensors, the CPU allocator and the FLOP
counter, as tests/test_checkpointing.py checks the plain schemes."""

import dataclasses
import json

import pytest
import torch

from memory_probes import saved_tensor_bytes, training_peaks
from spawned_ranks import results_by_rank
from test_checkpointing import (BLOCK_BOUND, CPU, FIVE_BLOCKS, counted_flops, counted_flops_once, linear_calls,
                                loss_and_grads, without_checkpointing)
from systems.accounting import (activation_memory, checkpointed, kept_weight_copies, nested_checkpoint, peak_memory,
                                recomputed_flops)
from systems.accounting.checkpointing import held_in_backward
from systems.levers.checkpointing import Checkpointing
from systems.model import Fused, TransformerConfig, TransformerLM, get_config
from systems.parallel.fsdp import FSDP
from systems.parallel.ranks import rank_device
from systems.precision import PRECISIONS
from systems.recompute import Saves
from systems.step import make_model, random_batch

# Five blocks: the top one or two left out of one-block, two-block (a shorter last segment) and nested segments,
# and both op-level selections, alone and with blocks left out.
SCHEMES = ["every1-keep1", "every2-keep2", "3x1-keep1", "attn", "ops", "attn-keep2", "ops-keep1"]


def scheme_config(config, text: str, batch_size: int = 2, seq: int = 32, precision=PRECISIONS["fp32"]):
    return checkpointed(Checkpointing.parse(text), config, batch_size, seq, precision, device="cpu")


def cases(*groups):
    """(scheme, attention, precision) parameters: each group's schemes with its attention and precision."""
    return [pytest.param(scheme, attention, PRECISIONS[precision], id=f"{precision}-{attention}-{scheme}")
            for schemes, attention, precision in groups for scheme in schemes]


# Every scheme with SDPA in fp32; written-out attention (whose matmuls op-level selection recomputes), autocast
# (whose state the recomputation restores, and whose weight copies the blocks left out keep) and bf16 weights
# (a bf16 residual stream) on a few.
SELECTIVE = ["every2-keep2", "ops", "attn-keep2"]
CASES = cases((SCHEMES, "sdpa", "fp32"), (SELECTIVE, "naive", "fp32"), (SELECTIVE, "sdpa", "bf16"),
              (["3x1-keep1"], "naive", "bf16"), (["ops-keep1", "every1-keep1"], "sdpa", "bf16-weights"))


@pytest.mark.parametrize("scheme, attention, precision",
                         CASES + cases((["ops", "attn-keep2"], "flash", "fp32")))
def test_same_loss_and_gradients_as_without_checkpointing(scheme, attention, precision):
    """Exactly equal, as the plain schemes are: what op-level selection keeps is the forward's own tensor, and what
    it recomputes runs the same CPU kernels on the same inputs (under autocast's state, restored)."""
    model, tokens, targets, loss, grads = without_checkpointing(attention, precision)
    model.config = scheme_config(model.config, scheme, *tokens.shape, precision)
    checkpointed_loss, checkpointed_grads = loss_and_grads(model, tokens, targets, precision)
    assert torch.equal(checkpointed_loss, loss)
    assert all(torch.equal(a, b) for a, b in zip(checkpointed_grads, grads, strict=True))


def test_the_fused_kernels_recompute_exactly():
    """The fused Triton kernels under op-level selection: they run as custom ops there (a dispatch mode is on),
    which the policy recomputes, giving the forward's values again."""
    pytest.importorskip("systems.kernels", reason="needs Triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where Triton runs: a GPU, else interpreted
    # Small, for Triton's interpreter: one block recomputed, one left out; two chunks of the loss.
    config = TransformerConfig(d_model=32, d_ff=64, num_layers=2, num_heads=2, vocab_size=100, context_length=16,
                               fused=Fused.ALL, loss_chunk=8)
    model = make_model(config, device, PRECISIONS["fp32"])
    tokens, targets = random_batch(config, 2, 6, device)
    loss, grads = loss_and_grads(model, tokens, targets, PRECISIONS["fp32"])
    model.config = scheme_config(config, "ops-keep1", 2, 6)
    checkpointed_loss, checkpointed_grads = loss_and_grads(model, tokens, targets, PRECISIONS["fp32"])
    assert torch.equal(checkpointed_loss, loss)
    assert all(torch.equal(a, b) for a, b in zip(checkpointed_grads, grads, strict=True))


# Under our FSDP: every collective's layer and the block's at once, prefetching deeper than a block, in fp32 and in
# bf16 compute.
FSDP_RUNS = {"ops-block-prefetch2-fp32": ("ops", "block", 2, None),
             "ops-block-bf16": ("ops", "block", 1, torch.bfloat16),
             "attn-keep1-layer-prefetch5-fp32": ("attn-keep1", "layer", 5, None)}


def sharded_steps(scheme: str, gather: str, prefetch: int, compute_dtype) -> list:
    """Two steps' losses and gradients (no optimizer) of this rank's FSDP model under `scheme`: the second's
    forward prefetches in the first's order."""
    torch.manual_seed(0)
    config = scheme_config(get_config("leaderboard-2026-tiny", context_length=32, loss_chunk=10), scheme, 2, 24)
    with torch.device(rank_device()):
        wrapped = FSDP(TransformerLM(config), compute_dtype=compute_dtype, gather=gather, prefetch=prefetch)
    data = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    steps = []
    for _ in range(2):
        batch = torch.randint(config.vocab_size, (2, 25), generator=data).to(rank_device())
        loss = wrapped(batch[:, :-1], batch[:, 1:])
        loss.backward()
        wrapped.finish_gradient_synchronization()
        steps.append([loss.detach().cpu(), *(p.grad.cpu() for p in wrapped.parameters())])
        wrapped.zero_grad(set_to_none=True)
    return steps


def sharded_runs() -> dict:
    return {name: (sharded_steps(scheme, *levers), sharded_steps("none", *levers))
            for name, (scheme, *levers) in FSDP_RUNS.items()}


sharded = results_by_rank("sharded", sharded_runs, gloo_world_sizes=(2,), timeout=600)


@pytest.mark.parametrize("run", FSDP_RUNS)
def test_fsdp_steps_match_without_checkpointing(sharded, run):
    """Exactly, step after step: FSDP's gathers run out of sight of selective checkpointing's dispatch modes, which
    would otherwise count them among the block's ops, and the second step's forward gathers ahead of the block
    where its recomputation does not."""
    for rank in sharded:
        selective, plain = rank[run]
        for step, (actual, expected) in enumerate(zip(selective, plain, strict=True)):
            assert all(map(torch.equal, actual, expected)), f"step {step}"


@pytest.mark.parametrize("scheme, recomputed", [("every1-keep2", {0, 1, 2}), ("ops-keep1", {0, 1, 2, 3})])
def test_recomputation_runs_the_hooks_of_the_checkpointed_blocks_only(scheme, recomputed):
    """A sharded layer all-gathers its weight in a forward pre-hook: a recomputed block runs it again (also where
    op-level selection takes the matmul's output from the forward: autograd's node still saves the weight); a block
    left out runs it once."""
    calls = linear_calls(TransformerLM(scheme_config(FIVE_BLOCKS, scheme)))
    block_of = {name: int(name.split(".")[1]) for name in calls if name.startswith("blocks.")}
    assert calls == {name: 2 if block_of.get(name) in recomputed else 1 for name in calls}


@pytest.mark.parametrize("scheme, attention, precision", cases(
    (["every1-keep1", "every2-keep2", "3x1-keep1"], "sdpa", "fp32"), (["every2-keep2"], "naive", "fp32"),
    (["every1-keep1", "3x1-keep1"], "sdpa", "bf16"), (["every2-keep2"], "sdpa", "bf16-weights")))
def test_saved_activations_match_autograd(scheme, attention, precision):
    """The checkpointed segments' inputs, and every tensor the blocks left out save, with their autocast weight
    copies. (What op-level selection keeps is no saved tensor of autograd's: the peaks below measure it.)"""
    batch_size, seq = 3, 48
    config = scheme_config(dataclasses.replace(FIVE_BLOCKS, attention=attention), scheme, batch_size, seq, precision)
    model = make_model(config, CPU, precision)
    tokens, targets = (t.clone() for t in random_batch(config, batch_size, seq, CPU))
    predicted = activation_memory(config, batch_size, seq, precision, device="cpu")
    copies = kept_weight_copies(config, precision)
    assert saved_tensor_bytes(model, tokens, targets, precision) == predicted.total + copies


@pytest.mark.parametrize("scheme, attention, precision", CASES)
def test_peak_memory_matches_cpu_allocations(scheme, attention, precision):
    """The forward's end holds the blocks left out whole; the backward peaks in a recomputed block, holding the
    selections of the blocks below it, its recomputation and, with matmuls selected, its w2's output, which the
    recomputation never takes. Tolerance as in test_accounting."""
    batch_size, seq = 2, 64
    config = scheme_config(BLOCK_BOUND, scheme, batch_size, seq, precision)
    measured = training_peaks(config, batch_size, seq, precision, inference=False)
    predicted = peak_memory(config, batch_size, seq, precision, device="cpu")
    for moment in ("forward", "forward_backward", "train_step"):
        assert measured[moment] == pytest.approx(getattr(predicted, moment), rel=0.02), moment


def test_held_in_backward_by_hand():
    """Five blocks of P bytes with inputs of r, s of a recomputed block's shared with its input. Pairs with the top
    block left out: its backward holds the two pairs' inputs and itself; block 3's, two inputs and the pair
    recomputed (less s); block 0's, its pair's input and itself. One-block segments with two left out, selecting
    S bytes of which U stay untaken: the top blocks hold the three inputs, their selections and the blocks left
    out up to themselves; block 2 its inputs, the selections below it, itself recomputed and U."""
    P, r, s, S, U = 1000, 100, 10, 7, 3
    pairs = [held_in_backward((2,), i, P, r, s, checkpointed=4) for i in range(5)]
    assert pairs == [r + P - s, r + 2 * P - s, 2 * r + P - s, 2 * r + 2 * P - s, 2 * r + P]
    ones = [held_in_backward((1,), i, P, r, s, checkpointed=3, selected=S, untaken=U) for i in range(5)]
    assert ones == [r + P - s + U, 2 * r + S + P - s + U, 3 * r + 2 * S + P - s + U, 3 * r + 3 * S + P,
                    3 * r + 3 * S + 2 * P]


@pytest.mark.parametrize("scheme", SCHEMES + ["nested-keep1"])
@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_recomputed_flops_match_flop_counter(scheme, attention):
    """The blocks left out are not recomputed; under op-level selection the matmuls (ops) and SDPA's kernel (both)
    are not either. Written-out attention's matmuls are recomputed in both."""
    config = dataclasses.replace(FIVE_BLOCKS, attention=attention)
    batch_size, seq = 2, 32
    resolved = scheme_config(config, scheme, batch_size, seq)
    predicted = recomputed_flops(resolved, batch_size, seq, device="cpu")
    # The counter has no formula for the CPU SDPA kernel; written-out attention computes the masked half too.
    attention_flops = 2 * predicted.attention if attention == "naive" else 0
    recomputed = counted_flops(resolved, batch_size, seq) - counted_flops_once(config, batch_size, seq)
    assert recomputed == predicted.projections + attention_flops


def test_nested_levels_are_chosen_over_the_checkpointed_blocks():
    config, precision = get_config("xl", context_length=2048), PRECISIONS["bf16"]
    resolved = scheme_config(config, "nested-keep8", 4, 2048, precision)
    assert resolved.checkpoint_keep == 8 and len(resolved.checkpoint) == 2 and resolved.checkpoint[0] <= 40
    assert resolved.checkpoint == nested_checkpoint(resolved, 4, 2048, precision, device="cpu")


def test_a_selective_scheme_builds_the_whole_config():
    """checkpointed sets what a selective scheme keeps beside its levels."""
    config, precision = get_config("xl", context_length=2048), PRECISIONS["bf16"]
    resolved = scheme_config(config, "ops-keep4", 4, 2048, precision)
    assert (resolved.checkpoint, resolved.checkpoint_keep, resolved.checkpoint_saves) == ((1,), 4, Saves.MATMULS)


@pytest.mark.parametrize("text", ["every1-keep8", "6x1-keep4", "nested-keep3", "attn", "ops", "ops-keep2",
                                  "attn-keep1"])
def test_a_scheme_reads_back_from_its_spelling(text):
    assert str(Checkpointing.parse(text)) == text


@pytest.mark.parametrize("text", ["none-keep2", "every1-keep0", "every1-keep", "keep4", "ops1", "every1-ops",
                                  "ops-keep-1", "attn-keep2-keep1"])
def test_a_scheme_that_is_not_one_is_a_value_error_saying_how_to_write_one(text):
    with pytest.raises(ValueError, match="checkpointing"):
        Checkpointing.parse(text)


@pytest.mark.parametrize("fields, error, match", [
    ({"checkpoint_keep": 1}, ValueError, "set checkpoint too"),
    ({"checkpoint": (1,), "checkpoint_keep": 2}, ValueError, "at least one of the 2 blocks"),
    ({"checkpoint": (1,), "checkpoint_keep": -1}, ValueError, "at least one of the 2 blocks"),
    ({"checkpoint": (1,), "checkpoint_keep": True}, TypeError, "checkpoint_keep must be an int"),
    ({"checkpoint": (2,), "checkpoint_saves": "matmuls"}, ValueError, "checkpoint must be"),
    ({"checkpoint": (1,), "checkpoint_saves": "everything"}, ValueError, "unknown checkpoint_saves"),
    ({"checkpoint": (1,), "checkpoint_saves": "attention", "compile": True}, ValueError, "compiled block"),
    ({"compile": 1}, TypeError, "compile must be a bool"),
    ({"fused": "layernorm"}, ValueError, "unknown fused"),
], ids=["keep-without-levels", "keep-all", "keep-negative", "keep-bool", "saves-without-one-block-segments",
        "saves-unknown", "saves-compiled", "compile-int", "fused-unknown"])
def test_bad_levers_are_rejected(fields, error, match):
    with pytest.raises(error, match=match):
        get_config("tiny", **fields)


def test_the_levers_are_named_once_and_survive_a_record():
    """Given by name, kept as the enum; a history's JSON record of the config builds it again."""
    config = get_config("tiny", checkpoint=(1,), checkpoint_keep=1, checkpoint_saves="matmuls", fused="rope",
                        compile=False)
    assert (config.checkpoint_saves, config.fused) == (Saves.MATMULS, Fused.ROPE)
    record = json.loads(json.dumps(dataclasses.asdict(config)))
    assert TransformerConfig(**{**record, "checkpoint": tuple(record["checkpoint"])}) == config
