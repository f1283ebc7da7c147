"""Parameters and memory of the Transformer LM, as executable arithmetic (its FLOPs: flops.py).

The memory model follows what this repository's model makes autograd save (systems/model.py):
RMSNorm works in fp32, so the residual stream and both norms' saved tensors stay fp32 under
autocast (with bf16 weights the residual stream is bf16, and the norms save fp32 copies of it);
RoPE saves only its cos/sin tables; SwiGLU saves w1's and w3's outputs, the SiLU and
the product; the LM head and loss as loss.py says (whole, chunked or fused).
The blocks' fused kernels (`config.fused`) keep less: RMSNorm its input as it comes and 1/rms, SwiGLU no SiLU
output, RoPE no table casts (and q and k laid out as v is, which some attention kernels' outputs follow).
tests/test_accounting.py checks it against the tensors autograd actually saves (CPU) and against
torch.cuda.max_memory_allocated (GPU). Activation memory and peak memory follow the config's activation
checkpointing, selective included (checkpointing.py holds its arithmetic; tests/test_checkpointing.py checks
it). Peak memory adds what is made and freed around the moment each phase peaks at, written-out attention's seq²
tensors among them (scores.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from systems.accounting.activations import Activations, BlockActivations
from systems.accounting.checkpointing import held_in_backward, least_peak_levels
from systems.accounting.flops import check_shape, selects_attention
from systems.accounting.loss import chunks_the_loss, loss_memory
from systems.accounting.scores import written_out_backward_peak, written_out_forward_peak, written_out_scores
from systems.levers.checkpointing import Checkpointing
from systems.model import Attention, Fused, TransformerConfig
from systems.precision import FP32, Precision
from systems.recompute import Saves

GB = 10**9
H100_BYTES = 80 * GB


def count_parameters(config: TransformerConfig) -> int:
    d, d_ff, layers, vocab = config.d_model, config.d_ff, config.num_layers, config.vocab_size
    per_block = 4 * d * d + 3 * d * d_ff + 2 * d  # qkv + out, SwiGLU, two RMSNorm gains
    return vocab * d + layers * per_block + d + d * vocab  # embedding, blocks, final norm, LM head


def parameter_numels(config: TransformerConfig) -> list[int]:
    """Element counts of TransformerLM's parameters in its `parameters()` order: the embedding, each block's
    (attention's norm, qkv, out; the FFN's norm, w1, w3, w2), the final norm, the LM head."""
    d, d_ff = config.d_model, config.d_ff
    block = [d, 3 * d * d, d * d, d, d * d_ff, d * d_ff, d_ff * d]
    return [config.vocab_size * d] + config.num_layers * block + [d, d * config.vocab_size]


def count_matmul_parameters(config: TransformerConfig) -> int:
    """Weights of the Linear layers: the ones autocast copies to low precision."""
    d, d_ff = config.d_model, config.d_ff
    return config.num_layers * (4 * d * d + 3 * d * d_ff) + d * config.vocab_size


# ---------------------------------------------------------------------------------------------
# Memory of one model on one device


@dataclass(frozen=True)
class ModelState:
    """Bytes that do not scale with the batch: weights and gradients in the weights' dtype, AdamW's state
    (two fp32 moments, and fp32 master copies of low-precision weights), RoPE tables, and under autocast of
    fp32 weights the low-precision weight copies the forward caches and the backward consumes."""

    params: int
    grads: int
    optimizer: int
    buffers: int
    autocast_weights: int

    @property
    def training(self) -> int:
        """What a warm training step keeps between steps (gradients are freed by zero_grad)."""
        return self.params + self.buffers + self.optimizer


def model_state(config: TransformerConfig, precision: Precision) -> ModelState:
    params = count_parameters(config)
    # cos and sin, every block; cast with the weights
    rope_tables = 2 * config.context_length * (config.d_head // 2) * precision.weight_bytes
    return ModelState(
        params=precision.weight_bytes * params,
        grads=precision.grad_bytes * params,
        optimizer=precision.optimizer_bytes * params,
        buffers=config.num_layers * rope_tables,
        autocast_weights=precision.autocast_copy_bytes * count_matmul_parameters(config),
    )


def residual_stream_bytes(config: TransformerConfig, batch_size: int, seq: int, precision: Precision) -> int:
    """One (batch, seq, d_model) residual-stream tensor, in the weights' dtype: fp32 even under autocast,
    because the embedding's output is fp32 and each residual add promotes the low-precision branch to it."""
    check_shape(config, batch_size, seq)
    return precision.weight_bytes * batch_size * seq * config.d_model


def head_weight_copy(config: TransformerConfig, precision: Precision) -> int:
    """The LM head's autocast weight copy: made, and kept for the backward, where the loss is whole; the chunked
    losses cast the weight themselves (loss.py) and keep no copy."""
    return 0 if chunks_the_loss(config) else precision.autocast_copy_bytes * config.d_model * config.vocab_size


def kept_weight_copies(config: TransformerConfig, precision: Precision) -> int:
    """The autocast weight copies autograd keeps after the forward: every block's, or under checkpointing those of
    the blocks left out (the checkpointed blocks' leave with the forward's autocast cache), and the LM head's."""
    d = config.d_model
    kept_layers = config.checkpoint_keep if config.checkpoint else config.num_layers
    layer = precision.autocast_copy_bytes * (4 * d * d + 3 * d * config.d_ff)
    return kept_layers * layer + head_weight_copy(config, precision)


def activation_memory(config: TransformerConfig, batch_size: int, seq: int, precision: Precision, *,
                      attention: Attention | None = None, device: str = "cuda") -> Activations:
    """Saved-for-backward bytes for `attention` ("naive" has the seq² terms; "sdpa" and "flash" keep
    q, k, v, the output and its logsumexp). `device` matters where kernels differ: CUDA's SDPA as
    cuDNN runs it (on Hopper, for the presets' head dims; small ones get other backends) writes its output
    (batch, seq, heads, d_head)-major, so the out projection saves a view of it,
    and CUDA autocast runs softmax in fp32 while CPU autocast does not."""
    attention = Attention(attention or config.attention)
    check_shape(config, batch_size, seq)
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    block = _block_activations(config, batch_size, seq, precision, attention, device)
    tokens = batch_size * seq
    # The hidden states reach the head in the residual stream's dtype, the weights'.
    loss = loss_memory(config, tokens, compute=precision.compute.itemsize, hidden=precision.weight_bytes,
                       weight_cast=precision.autocast_copy_bytes, weight_grad=precision.grad_bytes, device=device)
    selected, untaken = _selected(config, batch_size, seq, precision, attention, device)
    return Activations(per_layer=block.total, num_layers=config.num_layers,
                       final_norm=_norm_saved(config, tokens, precision), loss=loss,
                       segment_input=residual_stream_bytes(config, batch_size, seq, precision),
                       checkpoint=config.checkpoint, keep=config.checkpoint_keep, selected=selected,
                       untaken=untaken)


def _selected(config: TransformerConfig, batch_size: int, seq: int, precision: Precision, attention: Attention,
              device: str) -> tuple[int, int]:
    """What op-level selection keeps of a checkpointed block beside its input, and the part of that the
    recomputation never takes: attention's output and log-sum-exp; with the matmuls, their outputs (qkv's, the
    out projection's, w1's and w3's, and w2's, which the recomputation stops before)."""
    if config.checkpoint_saves == Saves.INPUTS:
        return 0, 0
    low, tokens = precision.compute.itemsize, batch_size * seq
    act = tokens * config.d_model * low
    kept = act + FP32 * batch_size * config.num_heads * seq if selects_attention(attention, device) else 0
    if config.checkpoint_saves == Saves.ATTENTION:
        return kept, 0
    return kept + 5 * act + 2 * tokens * config.d_ff * low, act


def _norm_saved(config: TransformerConfig, tokens: int, precision: Precision) -> int:
    """An RMSNorm's saved tensors: its fp32 input (the residual stream, or an fp32 copy of a bf16 one), the
    normalized input and the rsqrt; the fused kernel's, its input as it comes (the residual stream) and 1/rms."""
    if config.fused.fuses(Fused.RMSNORM):
        return tokens * config.d_model * precision.weights.itemsize + FP32 * tokens
    return 2 * FP32 * tokens * config.d_model + FP32 * tokens


def _block_activations(config: TransformerConfig, batch_size: int, seq: int, precision: Precision, attention: str,
                       device: str) -> BlockActivations:
    low = precision.compute.itemsize
    casts = precision.weights != precision.compute  # autocast casts the fp32 residual stream and tables
    tokens = batch_size * seq
    act = tokens * config.d_model * low  # one (batch, seq, d_model) tensor in the matmul dtype
    norm = _norm_saved(config, tokens, precision)
    ffn_in = 2 * act if casts else act  # w1 and w3 each cast the same fp32 input
    # w1 out (SiLU input), SiLU out (not kept by the fused kernel), w3 out, product (w2 input)
    swiglu = (3 if config.fused.fuses(Fused.SWIGLU) else 4) * tokens * config.d_ff * low
    ffn = norm + ffn_in + swiglu
    fused_rope = config.fused.fuses(Fused.ROPE)  # reads the fp32 tables; writes q and k (batch, seq)-major
    rope_tables = 2 * 2 * seq * (config.d_head // 2) * low if casts and not fused_rope else 0  # cos/sin casts
    # qkv's input (autocast casts an fp32 norm output), q and k after RoPE.
    attention_in = norm + act + rope_tables + 2 * act
    if attention == "naive":
        scores = written_out_scores(config, batch_size, seq, precision, device)
        # V, which P @ V's batched matmul copies contiguous, unless the batch or the heads are one: then it keeps a
        # view of the whole qkv output. Then the probabilities' cast, if any, and the output re-laid for `out`.
        v = 3 * act if 1 in (batch_size, config.num_heads) else act
        return BlockActivations(ffn=ffn, attention_out=v + scores.probs_cast + act, attention_in=attention_in,
                                 scores=scores.mask + scores.probs)
    # The out projection's copy of attention's output, unless that is (batch, seq)-major already: cuDNN's SDPA's always;
    # on a CPU SDPA's and FlashAttention-2 in PyTorch follow q's layout, which the fused RoPE writes so. (Our Triton
    # kernel's, on CUDA, is (batch, heads)-major whatever q's layout.)
    follows_q = device == "cpu" and fused_rope
    out_copy = 0 if (attention == "sdpa" and device == "cuda") or follows_q else act
    # qkv output (kept whole through the V view), output, fp32 logsumexp
    lse = FP32 * batch_size * config.num_heads * seq
    return BlockActivations(ffn=ffn, attention_out=3 * act + act + lse + out_copy, attention_in=attention_in,
                             scores=0)


@dataclass(frozen=True)
class PeakMemory:
    """Predicted torch.cuda.max_memory_allocated, in bytes, with the model already on the device."""

    inference: int  # forward and loss under torch.no_grad
    forward: int  # forward and loss recording autograd (the benchmarks' forward phase)
    forward_backward: int  # forward, loss and backward without optimizer state (backward phases)
    train_step: int  # forward, backward and AdamW step once the optimizer state exists


def peak_memory(config: TransformerConfig, batch_size: int, seq: int, precision: Precision, *,
                attention: str | None = None, device: str = "cuda") -> PeakMemory:
    attention = attention or config.attention
    state = model_state(config, precision)
    acts = activation_memory(config, batch_size, seq, precision, attention=attention, device=device)
    block = _block_activations(config, batch_size, seq, precision, attention, device)
    low, grad = precision.compute.itemsize, precision.grad_bytes
    tokens = batch_size * seq
    d, d_ff, vocab = config.d_model, config.d_ff, config.vocab_size
    residual = residual_stream_bytes(config, batch_size, seq, precision)
    weights = state.params + state.buffers
    copy = precision.autocast_copy_bytes
    layer_copies = copy * (4 * d * d + 3 * d * d_ff)
    # Autocast's weight copies in the forward: every block's, and the LM head's unless the loss casts it itself.
    forward_copies = config.num_layers * layer_copies + head_weight_copy(config, precision)
    after_forward = weights + kept_weight_copies(config, precision) + acts.total
    forward = weights + forward_copies + acts.total + acts.loss.forward
    if attention == "naive":
        in_attention = written_out_forward_peak(config, batch_size, seq, precision, device, acts, block)
        forward = max(forward, weights + in_attention)

    # Each block's backward frees its activations and weight copies and adds its gradients; its peak is inside
    # SwiGLU's backward (w2's gradient done, the product's two gradients being made) or, for written-out
    # attention, in its softmax's. Without checkpointing the blocks' peak is in the top block or the bottom one;
    # with it, at the top of some segment. A recomputed block's forward holds what its attention's backward
    # will, but two score-sized tensors where that holds three or four: it peaks lower.
    layer_grads = grad * (4 * d * d + 3 * d * d_ff + 2 * d)
    w2_copy = copy * d * d_ff
    in_block_peak = grad * d * d_ff - w2_copy + 2 * tokens * d_ff * low  # SwiGLU's backward
    if attention == "naive":
        in_block_peak = max(in_block_peak, written_out_backward_peak(config, batch_size, seq, precision, device, block))
    layers, keep = config.num_layers, config.checkpoint_keep
    shared = residual if precision.weights == torch.float32 else 0  # a norm saves an fp32 input as it is

    def in_block(i: int) -> int:  # blocks above i are done
        held = held_in_backward(config.checkpoint, i, acts.per_layer + layer_copies, residual, shared,
                                checkpointed=layers - keep, selected=acts.selected, untaken=acts.untaken)
        return weights + grad * (d * vocab + d) + (layers - 1 - i) * layer_grads + held + residual + in_block_peak

    all_grads = weights + state.grads
    forward_backward = max(forward, after_forward + acts.loss.backward, *map(in_block, range(layers)),
                           all_grads + residual)
    train_step = state.optimizer + max(forward_backward, all_grads + _optimizer_transient(config, precision, device))

    # No grad: the loss's, or one block's working set on top of the residual stream: SwiGLU's, or written-out
    # attention's (the norm's output, qkv's, q and k).
    working_set = max(acts.loss.no_grad, 2 * residual + 3 * tokens * d_ff * low)
    if attention == "naive":
        scores = written_out_scores(config, batch_size, seq, precision, device)
        working_set = max(working_set, 2 * residual + 5 * tokens * d * low + scores.forward_working_set)
    inference = weights + forward_copies + working_set
    return PeakMemory(inference=inference, forward=forward, forward_backward=forward_backward,
                      train_step=train_step)


def nested_checkpoint(config: TransformerConfig, batch_size: int, seq: int, precision: Precision, *,
                      attention: str | None = None, device: str = "cuda") -> tuple[int, ...]:
    """The two-level `checkpoint` sizes whose forward and backward peak least (checkpointing.py says why)."""
    def peak(levels: tuple[int, ...]) -> int:
        checkpointed = dataclasses.replace(config, checkpoint=levels)
        peak = peak_memory(checkpointed, batch_size, seq, precision, attention=attention, device=device)
        return peak.forward_backward

    return least_peak_levels(config.num_layers - config.checkpoint_keep, peak)


def checkpointed(scheme: Checkpointing, config: TransformerConfig, batch_size: int, seq: int, precision: Precision,
                 *, attention: Attention | None = None, device: str = "cuda") -> TransformerConfig:
    """`config` checkpointed as `scheme` says: its levels (nested's least-peak ones for this model and batch), the
    blocks it leaves out and what its segments keep."""
    config = scheme.configure(config)
    if scheme.levels is not None:
        return config
    # Nested's levels are chosen with the blocks left out already left out.
    return scheme.configure(config, nested_checkpoint(config, batch_size, seq, precision, attention=attention,
                                                      device=device))


def largest_context(config: TransformerConfig, batch_size: int, precision: Precision, *, capacity: int = H100_BYTES,
                    attention: str | None = None, device: str = "cuda") -> int:
    """The longest sequence whose training step's predicted peak fits in `capacity` bytes (0 if none does), with
    `config`'s checkpointing and a context length equal to the sequence."""
    def fits(seq: int) -> bool:
        at_seq = dataclasses.replace(config, context_length=seq)
        peak = peak_memory(at_seq, batch_size, seq, precision, attention=attention, device=device)
        return peak.train_step <= capacity

    low, high = 0, 1  # fits(low) or low == 0; not fits(high) once found
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _optimizer_transient(config: TransformerConfig, precision: Precision, device: str) -> int:
    """AdamW's scratch: none for the fused CUDA kernel; off CUDA, fp32 temporaries the size of the largest
    parameter: the square root of the second moment and its bias-corrected quotient, and for
    low-precision weights the gradient cast to fp32."""
    if device == "cuda":
        return 0
    temporaries = 2 if precision.weights == torch.float32 else 3
    return temporaries * FP32 * max(config.vocab_size * config.d_model, config.d_model * config.d_ff)
