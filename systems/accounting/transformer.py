"""Parameters, FLOPs and memory of the Transformer LM, as executable arithmetic.

The memory model follows what this repository's model makes autograd save (systems/model.py):
RMSNorm works in fp32, so the residual stream and both norms' saved tensors stay fp32 under
autocast (with bf16 weights the residual stream is bf16, and the norms save fp32 copies of it);
RoPE saves only its cos/sin tables; SwiGLU saves w1's and w3's outputs, the SiLU and
the product; cross_entropy upcasts the logits and keeps three (batch, seq, vocab) fp32 tensors.
tests/test_accounting.py checks it against the tensors autograd actually saves (CPU) and against
torch.cuda.max_memory_allocated (GPU). Activation memory, peak memory and FLOPs follow the config's activation
checkpointing (checkpointing.py holds its arithmetic; tests/test_checkpointing.py checks it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from systems.accounting.checkpointing import (SCHEMES, held_in_backward, kept_inputs, least_peak_levels,
                                              recomputed_blocks)
from systems.model import ATTENTION_BACKENDS, TransformerConfig
from systems.precision import FP32, Precision

GB = 10**9
H100_BYTES = 80 * GB


def count_parameters(config: TransformerConfig) -> int:
    d, d_ff, layers, vocab = config.d_model, config.d_ff, config.num_layers, config.vocab_size
    per_block = 4 * d * d + 3 * d * d_ff + 2 * d  # qkv + out, SwiGLU, two RMSNorm gains
    return vocab * d + layers * per_block + d + d * vocab  # embedding, blocks, final norm, LM head


def count_matmul_parameters(config: TransformerConfig) -> int:
    """Weights of the Linear layers: the ones autocast copies to low precision."""
    d, d_ff = config.d_model, config.d_ff
    return config.num_layers * (4 * d * d + 3 * d * d_ff) + d * config.vocab_size


# ---------------------------------------------------------------------------------------------
# FLOPs


@dataclass(frozen=True)
class Flops:
    """Matmul FLOPs of one forward pass by part; backward does two matmuls (dX, dW) per forward one."""

    projections: int  # qkv, out and the three SwiGLU matrices of every block
    attention: int  # QKᵀ and PV, the causal (unmasked) half only
    lm_head: int

    @property
    def forward(self) -> int:
        return self.projections + self.attention + self.lm_head

    @property
    def backward(self) -> int:
        return 2 * self.forward

    @property
    def step(self) -> int:
        return self.forward + self.backward

    @property
    def flash_step(self) -> int:
        """The step as FlashAttention's benchmarks and the course's leaderboard count it: attention's backward is
        the five matmuls a FlashAttention backward runs (QKᵀ again, dV, dP, dQ, dK), 2.5 times its forward
        rather than twice."""
        return self.step + self.attention // 2


def flops(config: TransformerConfig, batch_size: int, seq: int) -> Flops:
    _check_shape(config, batch_size, seq)
    d, d_ff, layers = config.d_model, config.d_ff, config.num_layers
    tokens = batch_size * seq
    return Flops(
        projections=layers * 2 * tokens * (4 * d * d + 3 * d * d_ff),
        attention=layers * 2 * 2 * batch_size * seq * seq * d // 2,
        lm_head=2 * tokens * d * config.vocab_size,
    )


def recomputed_flops(config: TransformerConfig, batch_size: int, seq: int) -> Flops:
    """The forward FLOPs the backward runs again under `config.checkpoint` (none without): the blocks
    `recomputed_blocks` counts, less the w2 matmul at the end of each innermost segment. Not model FLOPs:
    MFU leaves them out."""
    model = flops(config, batch_size, seq)
    blocks, segments = recomputed_blocks(config.num_layers, config.checkpoint)
    w2 = 2 * batch_size * seq * config.d_model * config.d_ff
    return Flops(projections=blocks * model.projections // config.num_layers - segments * w2,
                 attention=blocks * model.attention // config.num_layers, lm_head=0)


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
    _check_shape(config, batch_size, seq)
    return precision.weight_bytes * batch_size * seq * config.d_model


@dataclass(frozen=True)
class Activations:
    """Bytes autograd holds for backward after one forward pass and loss (inputs and weights excluded)."""

    per_layer: int
    num_layers: int
    head: int  # final norm, LM head input and cross-entropy
    logits: int  # one fp32 (batch, seq, vocab) tensor, the unit of the loss's transients
    segment_input: int  # one residual-stream tensor: what checkpointing keeps of a segment
    checkpoint: tuple[int, ...] = ()  # TransformerConfig.checkpoint

    @property
    def blocks(self) -> int:
        """What autograd keeps of the blocks: every block's activations, or under checkpointing the inputs of
        the outermost segments."""
        if self.checkpoint:
            return kept_inputs(self.num_layers, self.checkpoint) * self.segment_input
        return self.num_layers * self.per_layer

    @property
    def total(self) -> int:
        return self.blocks + self.head


def activation_memory(config: TransformerConfig, batch_size: int, seq: int, precision: Precision, *,
                      attention: str | None = None, device: str = "cuda") -> Activations:
    """Saved-for-backward bytes for `attention` ("naive" has the seq² terms; "sdpa" and "flash" keep
    q, k, v, the output and its logsumexp). `device` matters where kernels differ: CUDA's fused SDPA
    writes its output (batch, seq, heads, d_head)-major, so the out projection saves a view of it,
    and CUDA autocast runs softmax in fp32 while CPU autocast does not."""
    attention = attention or config.attention
    _check_shape(config, batch_size, seq)
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {attention!r}; choose from {sorted(ATTENTION_BACKENDS)}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    low = precision.compute.itemsize
    autocast = precision.uses_autocast
    casts = precision.weights != precision.compute  # autocast casts the fp32 residual stream and tables
    d, d_ff, heads, vocab = config.d_model, config.d_ff, config.num_heads, config.vocab_size
    tokens = batch_size * seq
    act = tokens * d * low  # one (batch, seq, d_model) tensor in the matmul dtype

    # Its fp32 input (the residual stream, or an fp32 copy of a bf16 one) and normalized input, the rsqrt.
    norm = 2 * FP32 * tokens * d + FP32 * tokens
    attn_in = act  # qkv's input; autocast casts an fp32 norm output
    ffn_in = 2 * act if casts else act  # w1 and w3 each cast the same fp32 input
    rope_tables = 2 * 2 * seq * (config.d_head // 2) * low if casts else 0  # cos/sin casts for q and k
    swiglu = 4 * tokens * d_ff * low  # w1 out (SiLU input), SiLU out, w3 out, product (w2 input)
    q_k = 2 * act  # after RoPE
    if attention == "naive":
        scores = batch_size * heads * seq * seq
        if autocast and device == "cuda":
            probs = FP32 * scores + low * scores  # fp32 softmax output and its cast for P @ V
        else:
            probs = low * scores
        # The seq² bool mask; V copied contiguous for the batched matmul; the output re-laid for `out`.
        attend = q_k + seq * seq + probs + act + act
    else:
        out_copy = 0 if attention == "sdpa" and device == "cuda" else act
        # qkv output (kept whole through the V view), output, fp32 logsumexp
        attend = 3 * act + q_k + act + FP32 * batch_size * heads * seq + out_copy
    per_layer = 2 * norm + attn_in + rope_tables + attend + ffn_in + swiglu

    logits = FP32 * tokens * vocab
    # fp32 logits (amax), exp (its backward), logits minus max (gather), the max and the sum.
    loss = 3 * logits + 2 * FP32 * tokens
    head = norm + act + loss
    return Activations(per_layer=per_layer, num_layers=config.num_layers, head=head, logits=logits,
                       segment_input=residual_stream_bytes(config, batch_size, seq, precision),
                       checkpoint=config.checkpoint)


@dataclass(frozen=True)
class PeakMemory:
    """Predicted torch.cuda.max_memory_allocated, in bytes, with the model already on the device."""

    inference: int  # forward and loss under torch.no_grad
    forward: int  # forward and loss recording autograd (the benchmarks' forward phase)
    forward_backward: int  # forward, loss and backward without optimizer state (backward phases)
    train_step: int  # forward, backward and AdamW step once the optimizer state exists


def peak_memory(config: TransformerConfig, batch_size: int, seq: int, precision: Precision, *,
                attention: str | None = None, device: str = "cuda") -> PeakMemory:
    state = model_state(config, precision)
    acts = activation_memory(config, batch_size, seq, precision, attention=attention, device=device)
    low, grad = precision.compute.itemsize, precision.grad_bytes
    tokens = batch_size * seq
    d, d_ff, vocab = config.d_model, config.d_ff, config.vocab_size
    residual = residual_stream_bytes(config, batch_size, seq, precision)
    weights = state.params + state.buffers
    forward = weights + state.autocast_weights + acts.total
    copy = precision.autocast_copy_bytes
    # Under checkpointing the blocks' weight copies leave with the forward's autocast cache; the LM head's stays.
    after_forward = weights + (copy * d * vocab if config.checkpoint else state.autocast_weights) + acts.total

    # The loss's backward briefly holds one more fp32 logits-sized gradient, and the bool mask of
    # amax's gradient, than the forward kept.
    loss_backward = acts.logits + acts.logits // FP32
    # Each block's backward frees its activations and weight copies and adds its gradients; its peak is inside
    # SwiGLU's backward (w2's gradient done, the product's two gradients being made). Without checkpointing the
    # blocks' peak is in the top block or the bottom one; with it, at the top of some segment.
    layer_grads = grad * (4 * d * d + 3 * d * d_ff + 2 * d)
    layer_copies = copy * (4 * d * d + 3 * d * d_ff)
    w2_copy = copy * d * d_ff
    swiglu_backward = grad * d * d_ff - w2_copy + 2 * tokens * d_ff * low
    layers = config.num_layers
    shared = residual if precision.weights == torch.float32 else 0  # a norm saves an fp32 input as it is

    def in_block(i: int) -> int:  # blocks above i are done
        held = held_in_backward(config.checkpoint, i, acts.per_layer + layer_copies, residual, shared)
        return weights + grad * (d * vocab + d) + (layers - 1 - i) * layer_grads + held + residual + swiglu_backward

    all_grads = weights + state.grads
    forward_backward = max(after_forward + loss_backward, *map(in_block, range(layers)), all_grads + residual)
    train_step = state.optimizer + max(forward_backward, all_grads + _optimizer_transient(config, precision, device))

    # No grad: the loss's fp32 logits copies, or one block's SwiGLU working set on top of the residual stream.
    working_set = max(3 * acts.logits, 2 * residual + 3 * tokens * d_ff * low)
    inference = weights + state.autocast_weights + working_set
    return PeakMemory(inference=inference, forward=forward, forward_backward=forward_backward,
                      train_step=train_step)


def nested_checkpoint(config: TransformerConfig, batch_size: int, seq: int, precision: Precision, *,
                      attention: str | None = None, device: str = "cuda") -> tuple[int, ...]:
    """The two-level `checkpoint` sizes whose forward and backward peak least (checkpointing.py says why)."""
    def peak(levels: tuple[int, ...]) -> int:
        checkpointed = dataclasses.replace(config, checkpoint=levels)
        peak = peak_memory(checkpointed, batch_size, seq, precision, attention=attention, device=device)
        return peak.forward_backward

    return least_peak_levels(config.num_layers, peak)


def checkpoint_levels(scheme: str, config: TransformerConfig, batch_size: int, seq: int, precision: Precision, *,
                      blocks: int | None = None, attention: str | None = None, device: str = "cuda") -> tuple[int, ...]:
    """`TransformerConfig.checkpoint` for a scheme of checkpointing.SCHEMES: "blocks" takes segments of `blocks`."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown checkpointing scheme {scheme!r}; choose from {', '.join(SCHEMES)}")
    if (scheme == "blocks") != (blocks is not None):
        raise ValueError(f"segments of a number of blocks go with the scheme 'blocks' only, got {scheme!r} and "
                         f"blocks={blocks!r}")
    if scheme == "nested":
        return nested_checkpoint(config, batch_size, seq, precision, attention=attention, device=device)
    return (blocks,) if scheme == "blocks" else ()


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


def _check_shape(config: TransformerConfig, batch_size: int, seq: int) -> None:
    if batch_size < 1 or seq < 1:
        raise ValueError(f"batch_size and seq must be positive, got {batch_size} and {seq}")
    if seq > config.context_length:
        raise ValueError(f"seq={seq} exceeds context_length={config.context_length}")
