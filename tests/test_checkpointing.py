"""Activation checkpointing: the same loss and gradients as keeping every activation, and the memory and FLOPs
that systems.accounting predicts for it, checked against autograd's saved tensors, the CPU allocator and the
FLOP counter."""

import copy
import dataclasses
import functools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from covering import tiered
from memory_probes import cpu_peak_bytes, saved_tensor_bytes, training_peaks
from systems.accounting import (Flops, activation_memory, checkpointed, largest_context, model_state, nested_checkpoint,
                                peak_memory, recomputed_flops)
from systems.levers.checkpointing import Checkpointing
from systems.loss import cross_entropy
from systems.model import TransformerConfig, TransformerLM, get_config
from systems.precision import PRECISIONS
from systems.step import forward_loss, make_model, random_batch
from test_accounting import ATTENTION_BOUND, precisions

CPU = torch.device("cpu")
# Five blocks: segments of 2, 3 and 4 leave a shorter last one, 5 and 7 take them all in one; nested sizes
# whose outer segments split unevenly too.
LEVELS = [(1,), (2,), (3,), (4,), (5,), (7,), (3, 1), (4, 2), (5, 2)]
# Tiny's blocks, five of them, and a vocabulary of a size no other of tiny's has, small, so that the work is the
# blocks' (what checkpointing recomputes) rather than the LM head's and the loss's.
FIVE_BLOCKS = get_config("tiny", num_layers=5, vocab_size=500)
# Few, small blocks and a small vocabulary: the blocks' activations, not the logits, decide the peak.
BLOCK_BOUND = TransformerConfig(d_model=64, d_ff=256, num_layers=6, num_heads=4, vocab_size=256, context_length=128)
# test_accounting's attention-bound model at half its context: the scores, a quarter of theirs, are still most of
# what a block holds.
WRITTEN_OUT = dataclasses.replace(ATTENTION_BOUND, context_length=128)


def levels_id(levels):
    return "x".join(map(str, levels)) or "none"


def grid(precision_names: tuple[str, ...], attentions: tuple[str, ...], levels: list, slow: bool = False) -> list:
    """(levels, attention, precision) parameters over the whole grid: a covering array of it (tests/covering.py)
    in the default tier, the rest in the slow tier; all of it there if `slow`."""
    return [pytest.param(levels, attention, PRECISIONS[precision], id=f"{precision}-{attention}-{levels_id(levels)}",
                         marks=[pytest.mark.slow] if slow else marks)
            for (precision, attention, levels), marks in tiered(precision_names, attentions, levels)]


def loss_and_grads(model, tokens, targets, precision):
    model.zero_grad(set_to_none=True)
    loss = forward_loss(model, tokens, targets, precision)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@functools.cache
def _without_checkpointing(attention: str, precision) -> tuple:
    """FIVE_BLOCKS's model under `attention` in `precision`, a batch of 3 x 40 tokens, and the loss and gradients
    without checkpointing, made once for every scheme compared with them here and in
    test_selective_checkpointing (from a seed of their own: the test that first asks keeps its random stream)."""
    config = dataclasses.replace(FIVE_BLOCKS, attention=attention)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = make_model(config, CPU, precision)
        tokens, targets = random_batch(config, 3, 40, CPU)
    return model, tokens, targets, *loss_and_grads(model, tokens, targets, precision)


def without_checkpointing(attention: str, precision) -> tuple:
    """A copy of the cached model without checkpointing (to set a scheme on), its batch, loss and gradients."""
    model, tokens, targets, loss, grads = _without_checkpointing(attention, precision)
    return copy.deepcopy(model), tokens, targets, loss, grads


@pytest.mark.parametrize("levels, attention, precision", grid(("fp32", "bf16"), ("naive", "sdpa"), LEVELS))
def test_same_loss_and_gradients_as_without_checkpointing(levels, attention, precision):
    """Exactly equal: the recomputation runs the same ops on the same inputs, and the CPU kernels are
    deterministic, so every recomputed tensor is bit for bit the one the forward made; the backward then runs
    the same ops on them in the same order. Under bf16 autocast this also checks that the recomputation runs
    under the forward's autocast state (in fp32 it would give other gradients)."""
    model, tokens, targets, loss, grads = without_checkpointing(attention, precision)
    model.config = dataclasses.replace(model.config, checkpoint=levels)
    checkpointed_loss, checkpointed_grads = loss_and_grads(model, tokens, targets, precision)
    assert torch.equal(checkpointed_loss, loss)
    assert all(torch.equal(a, b) for a, b in zip(checkpointed_grads, grads, strict=True))


def test_forward_without_grad_is_unchanged():
    config = get_config("tiny", num_layers=3)
    model = TransformerLM(config)
    tokens, _ = random_batch(config, 2, 16, CPU)
    with torch.no_grad():
        expected = model(tokens)
        model.config = dataclasses.replace(config, checkpoint=(2, 1))
        assert torch.equal(model(tokens), expected)


def linear_calls(model: TransformerLM) -> dict[str, int]:
    """How often each Linear's forward pre-hook (where a sharded layer gathers its weight) runs in one forward and
    backward."""
    calls = {name: 0 for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    for name, module in model.named_modules():
        if name in calls:
            module.register_forward_pre_hook(lambda module, args, name=name: calls.__setitem__(name, calls[name] + 1))
    tokens, targets = random_batch(model.config, 2, 16, CPU)
    cross_entropy(model(tokens), targets).backward()
    return calls


def test_recomputation_runs_module_hooks_again():
    """A sharded layer all-gathers its weight in a forward pre-hook: the recomputation must run it again, for
    every layer of the blocks (w2's too, though the recomputation stops inside it, on saving its input)."""
    calls = linear_calls(TransformerLM(get_config("tiny", num_layers=3, checkpoint=(2,))))
    assert calls == {name: 1 if name == "lm_head" else 2 for name in calls}


@pytest.mark.parametrize("levels, attention, precision",
                         grid(("fp32", "bf16", "bf16-weights"), ("naive", "sdpa", "flash"), [(), *LEVELS]))
def test_saved_activations_match_autograd(levels, attention, precision):
    """Autograd keeps each outermost segment's input and nothing its blocks save (the saved-tensor hooks see
    the inputs, which checkpointing saves for the backward, and none of the tensors saved inside a segment)."""
    config = dataclasses.replace(FIVE_BLOCKS, attention=attention, checkpoint=levels)
    model = make_model(config, CPU, precision)
    batch_size, seq = 3, 48
    tokens, targets = (t.clone() for t in random_batch(config, batch_size, seq, CPU))
    predicted = activation_memory(config, batch_size, seq, precision, device="cpu")
    # The matmuls' autocast weight copies are saved too: with checkpointing only the LM head's.
    copies = model_state(config, precision).autocast_weights
    if levels:
        copies = precision.autocast_copy_bytes * config.d_model * config.vocab_size
    assert saved_tensor_bytes(model, tokens, targets, precision) == predicted.total + copies


PEAK_PRECISIONS, PEAK_ATTENTIONS = ("fp32", "bf16", "bf16-weights"), ("naive", "sdpa")


@pytest.mark.parametrize("levels, attention, precision", [
    # Without checkpointing these are test_accounting's peak cases on tiny's blocks, which the default tier runs.
    *grid(PEAK_PRECISIONS, PEAK_ATTENTIONS, [()], slow=True),
    *grid(PEAK_PRECISIONS, PEAK_ATTENTIONS, [(1,), (2,), (4,), (6,), (3, 1), (4, 2), (5, 2)])])
def test_peak_memory_matches_cpu_allocations(levels, attention, precision):
    """The peak during the backward: the kept segment inputs, one segment recomputed (and inside a nested one,
    its inner inputs and one inner segment) and the gradients so far. Tolerance as in test_accounting."""
    config = dataclasses.replace(BLOCK_BOUND, attention=attention, checkpoint=levels)
    batch_size, seq = 2, 64
    measured = training_peaks(config, batch_size, seq, precision, inference=False)
    predicted = peak_memory(config, batch_size, seq, precision, device="cpu")
    for moment in ("forward", "forward_backward", "train_step"):
        assert measured[moment] == pytest.approx(getattr(predicted, moment), rel=0.02), moment


@pytest.mark.parametrize("levels", [
    # Without checkpointing this is test_accounting's attention-bound case (at twice the context), which the
    # default tier runs.
    pytest.param((), marks=pytest.mark.slow), (1,), (2,), (3, 1)], ids=levels_id)
@pytest.mark.parametrize("precision", precisions("fp32", "bf16", "bf16-weights"))
def test_written_out_attention_peaks_match_cpu_allocations(levels, precision):
    """Attention's transients on top of what is held: the forward peaks inside the top block's attention (under
    checkpointing, the block whose forward holds the most segment inputs) at the masked fill, with two copies of
    the scores; the backward inside a softmax's backward, with the probabilities and two gradients of their size,
    the block's FFN activations freed by then. Tolerance as in test_accounting."""
    config = dataclasses.replace(WRITTEN_OUT, checkpoint=levels)
    batch_size, seq = 2, config.context_length
    measured = training_peaks(config, batch_size, seq, precision, inference=False)
    predicted = peak_memory(config, batch_size, seq, precision, device="cpu")
    for moment in ("forward", "forward_backward", "train_step"):
        assert measured[moment] == pytest.approx(getattr(predicted, moment), rel=0.02), moment


def test_nested_checkpointing_peaks_below_every_one_level_scheme():
    """Many thin blocks, long enough sequences: segment inputs are a large part of the peak, which two levels
    cut. Measured, the chosen nested scheme peaks below one level of the segment sizes the accounting ranks
    best here (its one-level peak grows with the size)."""
    config = TransformerConfig(d_model=32, d_ff=32, num_layers=16, num_heads=2, vocab_size=64, context_length=128)
    batch_size, seq, precision = 4, 128, PRECISIONS["fp32"]
    model = make_model(config, CPU, precision)
    tokens, targets = random_batch(config, batch_size, seq, CPU)

    def measured(levels):
        model.config = dataclasses.replace(config, checkpoint=levels)
        return cpu_peak_bytes(lambda: forward_loss(model, tokens, targets, precision).backward())

    nested = nested_checkpoint(config, batch_size, seq, precision, device="cpu")
    assert len(nested) == 2
    peak = measured(nested)
    assert peak < min(measured((k,)) for k in (1, 2, 4))
    # Here segment inputs are a few percent of the peak each: the accounting must count each once.
    state = model_state(config, precision)
    predicted = peak_memory(dataclasses.replace(config, checkpoint=nested), batch_size, seq, precision, device="cpu")
    assert state.params + state.buffers + peak == pytest.approx(predicted.forward_backward, rel=0.02)


def counted_flops(config: TransformerConfig, batch_size: int, seq: int) -> int:
    """The FLOP counter's total over a forward and backward of `config`'s model (which depends on the shapes only,
    not on the weights or tokens)."""
    model = TransformerLM(config)
    tokens, targets = random_batch(config, batch_size, seq, CPU)
    with FlopCounterMode(display=False) as counter:
        cross_entropy(model(tokens), targets).backward()
    return counter.get_total_flops()


# Counted once for each config without checkpointing: every scheme's test here and in
# test_selective_checkpointing subtracts it.
counted_flops_once = functools.cache(counted_flops)


# Written-out attention for every scheme: the counter sees its matmuls, so it checks the attention's FLOPs beside
# the projections'. SDPA's kernel it does not count, which leaves the projections, the same as written-out
# attention's: a one-level scheme with a shorter last segment and a nested one by default, the rest slow.
FLOP_CASES = [*(pytest.param("naive", levels, id=f"naive-{levels_id(levels)}") for levels in LEVELS),
              *(pytest.param("sdpa", levels, id=f"sdpa-{levels_id(levels)}",
                             marks=[] if levels in [(3,), (5, 2)] else [pytest.mark.slow]) for levels in LEVELS)]


@pytest.mark.parametrize("attention, levels", FLOP_CASES)
def test_recomputed_flops_match_flop_counter(attention, levels):
    config = dataclasses.replace(FIVE_BLOCKS, attention=attention)
    batch_size, seq = 2, 32
    checkpointing = dataclasses.replace(config, checkpoint=levels)
    predicted = recomputed_flops(checkpointing, batch_size, seq)
    # The counter has no formula for the CPU SDPA kernel; written-out attention computes the masked half too.
    attention_flops = 2 * predicted.attention if attention == "naive" else 0
    recomputed = counted_flops(checkpointing, batch_size, seq) - counted_flops_once(config, batch_size, seq)
    assert recomputed == predicted.projections + attention_flops
    assert recomputed_flops(config, batch_size, seq) == Flops(0, 0, 0)


@pytest.mark.parametrize("precision", precisions("fp32", "bf16"))
@pytest.mark.parametrize("levels", [(), (1,)], ids=["none", "1"])
def test_largest_context_is_the_last_that_fits(precision, levels):
    config = get_config("xl", attention="sdpa", checkpoint=levels)
    seq = largest_context(config, 4, precision)

    def step_peak(seq):
        return peak_memory(dataclasses.replace(config, context_length=seq), 4, seq, precision).train_step

    assert step_peak(seq) <= 80 * 10**9 < step_peak(seq + 1)


def test_checkpointed_configs_name_the_schemes_levels():
    config, precision = get_config("xl", context_length=2048), PRECISIONS["bf16"]

    def levels(text: str) -> tuple[int, ...]:
        return checkpointed(Checkpointing.parse(text), config, 4, 2048, precision).checkpoint

    assert (levels("none"), levels("every6"), levels("6x1")) == ((), (6,), (6, 1))
    assert levels("nested") == nested_checkpoint(config, 4, 2048, precision)


@pytest.mark.parametrize("text", ["none", "every1", "every12", "6x1", "12x4x1", "nested"])
def test_a_scheme_reads_back_from_its_spelling(text):
    assert str(Checkpointing.parse(text)) == text


@pytest.mark.parametrize("text", ["4", "every0", "every4x1", "1x2", "2x2", "x", "6x", "blocks", "Every4", ""])
def test_a_scheme_that_is_not_one_is_a_value_error_saying_how_to_write_one(text):
    with pytest.raises(ValueError, match="checkpointing"):
        Checkpointing.parse(text)


@pytest.mark.parametrize("call, error", [
    (lambda: get_config("tiny", checkpoint=[2]), TypeError),
    (lambda: get_config("tiny", checkpoint=(True,)), TypeError),
    (lambda: get_config("tiny", checkpoint=(0,)), ValueError),
    (lambda: get_config("tiny", checkpoint=(2, 2)), ValueError),
    (lambda: get_config("tiny", checkpoint=(1, 2)), ValueError),
], ids=["list", "bool", "zero", "equal-levels", "growing-levels"])
def test_bad_checkpointing_is_rejected(call, error):
    with pytest.raises(error):
        call()
