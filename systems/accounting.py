"""Executable arithmetic: parameters, FLOPs and memory of the Transformer LM, and parallelism at scale.

The memory model follows what this repository's model makes autograd save (systems/model.py):
RMSNorm works in fp32, so the residual stream and both norms' saved tensors stay fp32 under
autocast (with bf16 weights the residual stream is bf16, and the norms save fp32 copies of it);
RoPE saves only its cos/sin tables; SwiGLU saves w1's and w3's outputs, the SiLU and
the product; cross_entropy upcasts the logits and keeps three (batch, seq, vocab) fp32 tensors.
tests/test_accounting.py checks it against the tensors autograd actually saves (CPU) and against
torch.cuda.max_memory_allocated (GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from systems.model import ATTENTION_BACKENDS, TransformerConfig
from systems.precision import FP32, Precision

GB = 10**9
H100_BYTES = 80 * GB
TPU_V5P_BYTES = 95 * GB
# The handout's TPU v5p figures for the scaling-book arithmetic.
TPU_V5P_ICI_BANDWIDTH = 2 * 9e10  # bytes/s
TPU_V5P_FLOPS = 4.6e14  # bf16 FLOP/s


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


def flops(config: TransformerConfig, batch_size: int, seq: int) -> Flops:
    _check_shape(config, batch_size, seq)
    d, d_ff, layers = config.d_model, config.d_ff, config.num_layers
    tokens = batch_size * seq
    return Flops(
        projections=layers * 2 * tokens * (4 * d * d + 3 * d * d_ff),
        attention=layers * 2 * 2 * batch_size * seq * seq * d // 2,
        lm_head=2 * tokens * d * config.vocab_size,
    )


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

    @property
    def total(self) -> int:
        return self.num_layers * self.per_layer + self.head


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
    return Activations(per_layer=per_layer, num_layers=config.num_layers, head=head, logits=logits)


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

    # The loss's backward briefly holds one more fp32 logits-sized gradient, and the bool mask of
    # amax's gradient, than the forward kept.
    loss_backward = acts.logits + acts.logits // FP32
    # Each block's backward frees its activations and weight copies and adds its gradients, so the
    # blocks' peak, inside SwiGLU's backward (w2's gradient done, the product's two gradients being
    # made), is in the top block or the bottom one.
    copy = precision.autocast_copy_bytes
    layer_grads = grad * (4 * d * d + 3 * d * d_ff + 2 * d)
    layer_copies = copy * (4 * d * d + 3 * d * d_ff)
    w2_copy = copy * d * d_ff
    swiglu_backward = grad * d * d_ff - w2_copy + 2 * tokens * d_ff * low
    layers = config.num_layers

    def in_block(i: int) -> int:  # blocks above i are done
        return (weights + grad * (d * vocab + d) + (layers - 1 - i) * layer_grads
                + (i + 1) * (acts.per_layer + layer_copies) + residual + swiglu_backward)

    all_grads = weights + state.grads
    forward_backward = max(forward + loss_backward, in_block(layers - 1), in_block(0), all_grads + residual)
    train_step = state.optimizer + max(forward_backward, all_grads + _optimizer_transient(config, precision, device))

    # No grad: the loss's fp32 logits copies, or one block's SwiGLU working set on top of the residual stream.
    working_set = max(3 * acts.logits, 2 * residual + 3 * tokens * d_ff * low)
    inference = weights + state.autocast_weights + working_set
    return PeakMemory(inference=inference, forward=forward, forward_backward=forward_backward,
                      train_step=train_step)


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


# ---------------------------------------------------------------------------------------------
# Parallelism arithmetic (CS336 assignment 2, after the scaling book's training chapter)


@dataclass(frozen=True)
class FFNStack:
    """A model reduced to its feed-forward matmuls: `num_blocks` blocks of d_model -> d_ff -> d_model."""

    d_model: int
    d_ff: int
    num_blocks: int

    @property
    def num_parameters(self) -> int:
        return self.num_blocks * 2 * self.d_model * self.d_ff

    def state_bytes(self) -> int:
        """fp32 master weights, accumulated gradients and AdamW's two moments: 16 bytes per parameter."""
        return 4 * FP32 * self.num_parameters

    def activation_bytes(self, tokens: int) -> int:
        """bf16 activations saved for backward: each linear layer's input, for every token."""
        return 2 * tokens * self.num_blocks * (self.d_model + self.d_ff)

    def fsdp_bytes_per_device(self, tokens: int, devices: int) -> float:
        """Weights, optimizer state, gradients and half the activations sharded N ways."""
        if devices < 1:
            raise ValueError(f"devices must be positive, got {devices}")
        acts = self.activation_bytes(tokens)
        return self.state_bytes() / devices + acts / 2 + acts / (2 * devices)

    def min_fsdp_devices(self, tokens: int, device_bytes: float = TPU_V5P_BYTES) -> int:
        """The smallest N whose per-device memory fits in `device_bytes`."""
        acts = self.activation_bytes(tokens)
        if acts / 2 >= device_bytes:
            raise ValueError(f"the unsharded half of the activations, {acts / 2 / GB:.1f} GB, "
                             f"alone exceeds {device_bytes / GB:.1f} GB")
        return math.ceil((self.state_bytes() + acts / 2) / (device_bytes - acts / 2))


XXL = FFNStack(d_model=16384, d_ff=53248, num_blocks=126)


def devices_to_hold(nbytes: float, device_bytes: float = H100_BYTES) -> int:
    return math.ceil(nbytes / device_bytes)


@dataclass(frozen=True)
class ComputeBoundBatch:
    per_device: float  # tokens per device
    total: float  # global batch, tokens


def fsdp_tp_compute_bound_batch(stack: FFNStack, *, ici_bandwidth: float, flops_per_s: float,
                                fsdp_axes: int, tp_axes: int, fsdp: int, tp: int) -> ComputeBoundBatch:
    """Smallest batch at which a forward pass with X-way FSDP and Y-way tensor parallelism is compute-bound.

    The scaling book's model: the forward's matmuls take 4·B·D·F / (N·C); FSDP all-gathers weights,
    4·D·F / (Y·W·M_X), and TP moves activations, 4·B·D / (X·W·M_Y); communication overlaps compute,
    so the batch must make the math at least as long as both together. D cancels out.
    """
    f, n = stack.d_ff, fsdp * tp
    math_per_token = f / flops_per_s  # per-device time per token of per-device batch, over 4·D
    tp_per_token = tp / (ici_bandwidth * tp_axes)
    if math_per_token <= tp_per_token:
        return ComputeBoundBatch(per_device=math.inf, total=math.inf)
    per_device = (f / (tp * ici_bandwidth * fsdp_axes)) / (math_per_token - tp_per_token)
    return ComputeBoundBatch(per_device=per_device, total=per_device * n)


@dataclass(frozen=True)
class BucketedAllReduce:
    """DDP's time after backward when gradients are all-reduced in equal buckets as they become ready.

    Backward produces `param_bytes` of gradients at a constant rate over `backward_seconds`. Buckets
    all-reduce one at a time, each as soon as its gradients exist and the previous one is done; a
    ring all-reduce of b bytes takes latency + 2·(n-1)/n · b / bandwidth, where bandwidth is the bus
    bandwidth per rank (nccl-tests' busbw).
    """

    backward_seconds: float
    param_bytes: float
    world_size: int
    bandwidth: float  # bytes/s
    latency: float  # seconds per all-reduce call

    def __post_init__(self):
        if self.world_size < 2 or self.bandwidth <= 0 or self.param_bytes <= 0:
            raise ValueError("need world_size >= 2 and positive bandwidth and param_bytes")
        if self.latency < 0 or self.backward_seconds < 0:
            raise ValueError("latency and backward_seconds must be non-negative")

    @property
    def transfer_seconds(self) -> float:
        """Moving all the gradients once through the ring, without latency."""
        return 2 * (self.world_size - 1) / self.world_size * self.param_bytes / self.bandwidth

    def allreduce_seconds(self, nbytes: float) -> float:
        return self.latency + self.transfer_seconds * nbytes / self.param_bytes

    def overhead(self, num_buckets: int) -> float:
        """Seconds from the end of backward to the end of the last all-reduce."""
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be positive, got {num_buckets}")
        interval = self.backward_seconds / num_buckets
        each = self.allreduce_seconds(self.param_bytes / num_buckets)
        # The last bucket waits for backward to end, or the queue of all-reduces outlasts it.
        return max(each, interval + num_buckets * each - self.backward_seconds)

    def optimal_num_buckets(self) -> float:
        """Where the overhead is least: with transfers hidden, buckets small enough that each one's
        all-reduce takes as long as backward takes to fill the next (the handout's assumption);
        when latency dominates, sqrt(backward / latency)."""
        if self.latency == 0:
            return math.inf
        hidden = (self.backward_seconds - self.transfer_seconds) / self.latency
        return max(1.0, hidden, math.sqrt(self.backward_seconds / self.latency))

    def optimal_bucket_bytes(self) -> float:
        return self.param_bytes / self.optimal_num_buckets()


def fit_bucketed_allreduce(*, backward_seconds: float, param_bytes: float, world_size: int,
                           allreduces: list[tuple[float, float]]) -> BucketedAllReduce | None:
    """The bucket model with the latency and bus bandwidth of measured all-reduces, (bytes, seconds) on
    `world_size` ranks: time = latency + ring bytes / busbw, a least-squares line through (ring bytes, time).
    None without two sizes to fit, or where the times do not grow with size."""
    ring = 2 * (world_size - 1) / world_size
    xs, ys = [ring * nbytes for nbytes, _ in allreduces], [seconds for _, seconds in allreduces]
    if len(set(xs)) < 2:
        return None
    x_mean, y_mean = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys)) / sum((x - x_mean) ** 2 for x in xs)
    if slope <= 0:
        return None
    return BucketedAllReduce(backward_seconds=backward_seconds, param_bytes=param_bytes, world_size=world_size,
                             bandwidth=1 / slope, latency=max(0.0, y_mean - slope * x_mean))
