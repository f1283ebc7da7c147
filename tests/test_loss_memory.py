"""The LM head and loss's memory (systems.accounting.loss) for each way the model computes its loss, whole, in chunks
and fused, against the tensors autograd saves, the CPU allocator's peaks and, on a GPU, torch.cuda's."""

import dataclasses

import pytest
import torch

from covering import tiered
from memory_probes import cuda_phase_peak, saved_tensor_bytes, training_peaks
from test_accounting import precisions
from systems.accounting import activation_memory, kept_weight_copies, model_state, peak_memory
from systems.kernels.launch import interpreted as kernels_interpreted
from systems.model import TransformerConfig
from systems.optim import AdamW
from systems.precision import PRECISIONS
from systems.step import make_model, random_batch

# A vocabulary large next to the blocks, so that the loss's logits decide the peaks; 2 x 64 tokens. Written-out
# attention: on a GPU, SDPA's backend for so small a head dim saves what the accounting does not model
# (test_accounting says what).
LOSS_BOUND = TransformerConfig(d_model=64, d_ff=128, num_layers=2, num_heads=4, vocab_size=2048, context_length=128,
                               attention="naive")
BATCH, SEQ = 2, 64
# (fused, loss_chunk): chunks of 48 tokens (the last one shorter), one chunk of all 128, a chunk longer than them.
LOSSES = {"whole": ("none", None), "chunks": ("none", 48), "one-chunk": ("none", 128), "long-chunk": ("none", 200),
          "fused": ("loss", None), "fused-chunks": ("loss", 48)}
EAGER_CHUNKED = ["chunks", "one-chunk", "long-chunk"]


def loss_config(config: TransformerConfig, loss: str, **levers) -> TransformerConfig:
    fused, chunk = LOSSES[loss]
    return dataclasses.replace(config, **{"fused": fused, "loss_chunk": chunk, **levers})


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("precision", precisions("fp32", "bf16", "bf16-weights"))
@pytest.mark.parametrize("loss", LOSSES)
def test_saved_tensors_match_autograd(loss, precision, device):
    """A chunked loss keeps the hidden states and a log-sum-exp per token, and no autocast copy of the head's
    weight; the whole loss the head's input and three fp32 logits tensors."""
    if device == "cpu" and LOSSES[loss][0] == "loss" and not kernels_interpreted():
        pytest.skip("the fused loss runs on CPU tensors under Triton's interpreter only, off where there is a GPU")
    config, seq = loss_config(LOSS_BOUND, loss), SEQ
    if device == "cpu" and LOSSES[loss][0] == "loss":
        # Triton's interpreter pays milliseconds for each vocabulary block of each row: an eighth of the words,
        # still two blocks a row, and fewer rows, still a chunk and a shorter one, as many as no size of the model.
        config, seq = dataclasses.replace(config, vocab_size=LOSS_BOUND.vocab_size // 8), 40
    model = make_model(config, torch.device(device), precision)
    # Contiguous targets: the loss flattens them, a view of them then, not a copy.
    tokens, targets = (t.clone() for t in random_batch(config, BATCH, seq, torch.device(device)))
    predicted = activation_memory(config, BATCH, seq, precision, device=device)
    assert saved_tensor_bytes(model, tokens, targets, precision) == predicted.total + kept_weight_copies(config,
                                                                                                        precision)


def chunked_peak_cases() -> list:
    """(loss, checkpoint, precision) parameters, every eager chunked loss with and without checkpointing in each
    precision: a covering array of them (tests/covering.py) in the default tier, the rest in the slow tier."""
    checkpoints = {"none": (), "every1": (1,)}
    return [pytest.param(loss, checkpoints[checkpoint], PRECISIONS[precision], id=f"{loss}-{checkpoint}-{precision}",
                         marks=marks)
            for (loss, checkpoint, precision), marks in tiered(EAGER_CHUNKED, list(checkpoints),
                                                               ["fp32", "bf16", "bf16-weights"])]


@pytest.mark.parametrize("loss, checkpoint, precision", chunked_peak_cases())
def test_chunked_peaks_match_cpu_allocations(loss, checkpoint, precision):
    """The forward peaks in a chunk's logsumexp (its fp32 logits and their exponentials), the backward in a chunk's
    term of the head's weight gradient (the logits' gradient beside the term and its fp32 promotion). Tolerances
    as in test_accounting: 2%, the per-token vectors left out (the targets' flattened copy, the chunks'
    log-sum-exps); 10% under no_grad, where the blocks' working set is modelled loosely. (The fused loss is not
    measured here: Triton's interpreter copies a kernel's tensors, which a GPU does not.)"""
    config = loss_config(LOSS_BOUND, loss, checkpoint=checkpoint)
    measured = training_peaks(config, BATCH, SEQ, precision)
    predicted = peak_memory(config, BATCH, SEQ, precision, device="cpu")
    for moment in ("forward", "forward_backward", "train_step"):
        assert measured[moment] == pytest.approx(getattr(predicted, moment), rel=0.02), moment
    assert measured["inference"] == pytest.approx(predicted.inference, rel=0.1)


# The same on a GPU, larger: the loss's logits (4,096 tokens over 32,768 words: 512 MiB in fp32) far outweigh the
# weights and the blocks' activations.
GPU_LOSS_BOUND = TransformerConfig(d_model=256, d_ff=512, num_layers=2, num_heads=4, vocab_size=32768,
                                   context_length=512)


@pytest.mark.gpu
@pytest.mark.parametrize("phase", ["forward", "step"])
@pytest.mark.parametrize("precision", precisions("fp32", "bf16", "bf16-weights"))
@pytest.mark.parametrize("loss", ["chunks", "fused", "fused-chunks"])
def test_peaks_match_cuda(loss, precision, phase, device):
    """What a phase allocates above what stays between steps (the weights, AdamW's state, cuBLAS's workspace, all
    allocated by the warm-up), measured by torch.cuda against the accounting's peak less that state. Within 5%:
    the caching allocator rounds each tensor up to 512 bytes, and the per-token vectors left out are under 0.1%."""
    config = loss_config(GPU_LOSS_BOUND, loss, loss_chunk=LOSSES[loss][1] and 1024)
    batch_size, seq = 8, 512
    model = make_model(config, device, precision)
    tokens, targets = random_batch(config, batch_size, seq, device)
    resident, peak = cuda_phase_peak(model, AdamW(model.parameters()), tokens, targets, precision, phase)
    measured = peak - resident
    predicted = peak_memory(config, batch_size, seq, precision)
    state = model_state(config, precision)
    if phase == "forward":
        expected = predicted.forward - state.params - state.buffers
    else:
        expected = predicted.train_step - state.training
    assert measured == pytest.approx(expected, rel=0.05)
