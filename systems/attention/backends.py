"""Attention by name: the one table that the model, the benchmarks and the command-line options choose from.

Every backend is a function (q, k, v, is_causal) -> o of q: (batch, [heads,] n_queries, d) and k, v:
(batch, [heads,] n_keys, d).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from systems.attention.pytorch import FlashAttentionPytorch
from systems.attention.reference import naive_attention

GLUON_MIN_KEYS = 4096  # "flash" runs the Gluon forward from this many keys (see _gluon_is_faster)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def sdpa_backend_attention(backend: SDPBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           is_causal: bool = False) -> torch.Tensor:
    """SDPA held to one of torch's kernels (RuntimeError "No available kernel" where that one cannot run)."""
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """torch's FlexAttention through torch.compile (a graph per shape), causal by a block mask that skips the
    tiles above the diagonal; (batch, seq, d) inputs run as one head."""
    one_head = q.dim() == 3
    if one_head:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    block_mask = _causal_block_mask(q.shape[-2], k.shape[-2], q.device) if is_causal else None
    o = _compiled_flex_attention()(q, k, v, block_mask=block_mask)
    return o.squeeze(1) if one_head else o


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention as flex  # made on first use, as Dynamo is

    return torch.compile(flex, dynamic=False)


def _causal(batch, head, q_index, kv_index):
    return q_index >= kv_index  # query i sees keys j <= i, as naive_attention's mask


@functools.lru_cache(maxsize=16)
def _causal_block_mask(n_queries: int, n_keys: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_causal, None, None, n_queries, n_keys, device=device)


def compiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """naive_attention through torch.compile, a graph per shape."""
    return _compiled_naive_attention()(q, k, v, is_causal)


@functools.cache
def _compiled_naive_attention():
    return torch.compile(naive_attention, dynamic=False)  # made on first use: importing Dynamo takes seconds


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    # Imported on first use, so that this package imports where Triton is not installed (pyproject installs it
    # on x86-64 Linux only).
    from systems.attention.triton_launch import FlashAttentionTriton

    return FlashAttentionTriton.apply(q, k, v, is_causal)


def gluon_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """The Gluon FlashAttention-3-style forward (Hopper only), with the Triton FlashAttention-2 backward."""
    # Imported on first use, as triton_attention is.
    from systems.attention.gluon_launch import FlashAttentionGluon

    return FlashAttentionGluon.apply(q, k, v, is_causal)


def flash_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> str:
    """The BACKENDS name that "flash" runs for these inputs, decided on the host from their metadata alone.

    "gluon" (the FlashAttention-3-style forward) where its own input check takes them: CUDA on Hopper (sm90),
    bf16 or fp16, head dim 64 or 128; where it is the faster forward (`_gluon_is_faster`); and only in eager
    code: under torch.compile, or a dispatch mode (selective checkpointing), the Triton FlashAttention-2 custom
    ops, which Dynamo sees as opaque ops and selective checkpointing as saveable, neither of which holds for the
    Gluon launch. "triton" on every other CUDA input, "pytorch" off CUDA (where Triton would be its interpreter).
    """
    if q.device.type != "cuda":
        return "pytorch"
    from systems.attention.triton_launch import through_dispatcher  # Triton: imported on CUDA only

    if through_dispatcher():
        return "triton"
    return "gluon" if _gluon_is_faster(q, k) and _gluon_takes(q, k, v, is_causal) else "triton"


def _gluon_is_faster(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Where the Gluon forward beats FlashAttention-2's: GLUON_MIN_KEYS keys or more (shorter, its launch's host
    work outweighs the faster kernel), and query tiles enough to fill the GPU without FlashAttention-2's key
    split (one long sequence alone: FlashAttention-2 spreads its keys over the idle SMs; the Gluon forward
    cannot). Measured on an H100: docs/perf-notes.md."""
    from systems.attention.triton_launch import key_splits

    n_queries, n_keys, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if n_keys < GLUON_MIN_KEYS or q.numel() == 0:
        return False
    return key_splits(q.numel() // (n_queries * d), 1, n_queries, n_keys, q.device) == 1


def _gluon_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> bool:
    """Whether the Gluon forward's own check (the one rule of what it runs) accepts q, k, v; False where this
    Triton has no Gluon. Input that breaks the shared contract is refused here too, and FlashAttention-2 then
    raises the contract's error."""
    try:
        from systems.attention.gluon_forward import check_gluon_inputs
    except ImportError:
        return False
    try:
        check_gluon_inputs(q, k, v, is_causal)
    except (TypeError, ValueError, RuntimeError):
        return False
    return True


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """Differentiable FlashAttention: on Hopper the Gluon forward (with the Triton backward) where it runs,
    the Triton FlashAttention-2 kernels on every other GPU, input and under torch.compile, the tiled PyTorch
    version off CUDA (flash_kernel says which)."""
    kernel = flash_kernel(q, k, v, is_causal)
    if kernel == "gluon":
        return gluon_attention(q, k, v, is_causal)
    if kernel == "triton":
        return triton_attention(q, k, v, is_causal)
    return FlashAttentionPytorch.apply(q, k, v, is_causal)


BACKENDS = {
    "naive": naive_attention,
    "compiled": compiled_attention,
    "pytorch": FlashAttentionPytorch.apply,
    "triton": triton_attention,
    "gluon": gluon_attention,
    "flash": flash_attention,
    "sdpa": sdpa_attention,
    "flex": flex_attention,
    "sdpa-flash": functools.partial(sdpa_backend_attention, SDPBackend.FLASH_ATTENTION),
    "sdpa-cudnn": functools.partial(sdpa_backend_attention, SDPBackend.CUDNN_ATTENTION),
}
# torch's registered flash attention implementations (torch.nn.attention.list_flash_attention_impls), which the
# attention benchmarks time as "sdpa-flash" with the implementation activated, where the image has its package.
SDPA_FLASH_IMPLS = {"sdpa-fa3": "FA3", "sdpa-fa4": "FA4"}
# What the attention benchmarks time: "flash" is "gluon", "triton" or "pytorch", timed under those names.
BENCHED_BACKENDS = ("naive", "compiled", "pytorch", "triton", "gluon", "sdpa", "sdpa-flash", "sdpa-cudnn",
                    *SDPA_FLASH_IMPLS, "flex")
