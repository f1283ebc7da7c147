"""FlashAttention-2 in Triton: `FlashAttentionTriton`, which launches the kernels of triton_forward and
triton_backward, with tiles chosen per launch, and the custom ops torch.compile sees.

Short sequences run one fixed tile; long ones on a GPU the fastest of a few, timed at a shape's first call and
remembered. Under Triton's interpreter (TRITON_INTERPRET=1 when the kernels were defined: Triton decides at
@triton.jit) small tiles, splits and caches make tests cover several tiles quickly. Measurements behind the
choices here are in docs/perf-notes.md.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
from torch.utils._python_dispatch import _get_current_dispatch_mode
from triton.compiler.errors import CompileTimeAssertionFailure
from triton.runtime.errors import PTXASError

from systems.attention.reference import check_inputs, save_for_recompute, saved_for_recompute
from systems.attention.triton_backward import bwd_dkdv_kernel, bwd_dq_kernel, bwd_preprocess_kernel
from systems.attention.triton_forward import fwd_kernel, fwd_merge_kernel

MAX_HEAD_DIM = 128
KERNELS = {"fwd": fwd_kernel, "dkdv": bwd_dkdv_kernel, "dq": bwd_dq_kernel}

Tile = tuple[int, int, int, int]  # (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages)
# The candidate tiles are the fastest few of a wider H100 sweep. Sequences shorter than TUNE_FROM_SEQ run one
# fixed tile: there, timing candidates costs more (a compile each) than it can save. The interpreter runs each
# program in Python: its small tiles keep it quick and give tests several tiles.
TUNE_FROM_SEQ = 2048
TUNED_TILES = {
    "fwd": [(64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 4), (128, 64, 8, 3), (128, 128, 8, 3), (64, 32, 4, 4)],
    "dkdv": [(64, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 4), (64, 128, 8, 3), (32, 128, 8, 3), (16, 64, 4, 3)],
    "dq": [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4), (128, 32, 4, 5), (128, 64, 8, 2), (64, 16, 4, 3)],
}
SHORT_TILES = {"fwd": (64, 32, 4, 2), "dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2)}
INTERPRETED_TILES = {"fwd": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1)}
PREPROCESS_BLOCK = 64
# Key splits: the forward aims at SPLIT_SLOTS_PER_SM query-tile programs per SM, splitting no further than
# MIN_KEYS_PER_SPLIT keys a program. The interpreter counts as one SM with small splits, so tests split too.
SPLIT_SLOTS_PER_SM = 4
MAX_SPLITS = 8
MIN_KEYS_PER_SPLIT = 512
INTERPRETED_MIN_KEYS_PER_SPLIT = 16
# Sequences interleave (see tile_head_batch) while the K and V (forward) or Q and dO (backward) of all of them
# take at most this many times the L2 cache: beyond, one sequence's tiles running together share it better. The
# interpreter counts as a small cache, so tests take both orders.
L2_MULTIPLE_TO_INTERLEAVE = {"forward": 2, "backward": 1}
INTERPRETED_L2_BYTES = 64 * 2**10


@torch.compiler.assume_constant_result  # Dynamo cannot trace isinstance on a Triton kernel; the answer is fixed
def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter, which Triton decided when it defined them."""
    return not isinstance(fwd_kernel, triton.JITFunction)


def through_dispatcher() -> bool:
    """Whether a launch must go through its custom op: under torch.compile (Dynamo cannot trace a launch), and
    under a dispatch mode (selective activation checkpointing saves an op's outputs only if it sees the op)."""
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


def _index_interpreted_scalars_of_any_rank() -> None:
    """Let the interpreter of Triton 3.6 and older take computed loop bounds under NumPy 2.4 and newer.

    The interpreter holds scalars as 1-element arrays of rank 1, and before Triton 3.7 it turns them into the
    ints of `range(lo, hi, step)` with int(array), which NumPy 2.4 refuses for rank > 0. Triton 3.7 squeezes
    the array first; so does this patch. Before 3.6 the interpreter patches tensors for good, without a scope.
    """
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_squeezing(tensor, *scope):
        patch_tensor(tensor, *scope)
        index = lambda self: int(self.handle.data.squeeze())  # noqa: E731
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    interpreter._patch_lang_tensor = patch_tensor_squeezing


if interpreted() and tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7):
    _index_interpreted_scalars_of_any_rank()


def _tiles(name: str, longest_seq: int) -> list[Tile]:
    """The tiles kernel `name` may run with at this sequence length: one, or candidates to time."""
    if interpreted():
        return [INTERPRETED_TILES[name]]
    if longest_seq < TUNE_FROM_SEQ:
        return [SHORT_TILES[name]]
    return TUNED_TILES[name]


_chosen: dict[tuple, Tile] = {}  # (kernel, dtype, shape arguments) -> the fastest tile


def _launch(name: str, grid, *args, dtype: torch.dtype, **shape) -> None:
    """Run kernel `name` with its tile for this shape; a shape's first call times the candidates, if several.

    Remembering the choice here, rather than in triton.autotune, skips the autotuner's per-call bookkeeping (it
    rebuilds its key from every argument), much of the host time of a launch.
    """
    kernel = KERNELS[name]

    def run(tile: Tile) -> None:
        block_m, block_n, warps, stages = tile
        kernel[grid](*args, **shape, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)

    tiles = _tiles(name, max(shape["n_queries"], shape["n_keys"]))
    if len(tiles) > 1:
        key = (name, dtype, *shape.values())
        if key not in _chosen:
            _chosen[key] = min(tiles, key=functools.partial(_median_ms, run))
        tiles = [_chosen[key]]
    run(tiles[0])


def _median_ms(run, tile: Tile) -> float:
    """run(tile)'s median milliseconds, timed as triton.autotune times a config; inf, as there, for a tile that
    does not fit (more shared memory than the GPU has) or that ptxas fails on."""
    try:
        return triton.testing.do_bench(lambda: run(tile), return_mode="median")
    except (triton.OutOfResources, CompileTimeAssertionFailure, PTXASError):
        return math.inf


def _shape_args(q: torch.Tensor, k: torch.Tensor, pass_: str) -> dict:
    """The scalar and compile-time arguments every attention kernel of `pass_` (forward, backward) shares."""
    d = q.shape[-1]
    precision = "ieee"  # what 16-bit dots do anyway
    if q.dtype == torch.float32:
        # 3xTF32 keeps about fp32's accuracy on the tensor cores (plain fp32 dots spill badly); one TF32
        # pass where torch allows TF32 matmuls.
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "tf32x3"
    streamed = k if pass_ == "forward" else q  # K and V stream through the forward, Q and dO the backward
    streamed_bytes = 2 * streamed.numel() * streamed.element_size()
    interleave = streamed_bytes <= L2_MULTIPLE_TO_INTERLEAVE[pass_] * _l2_bytes(q.device)
    # The scale is a compile-time constant (one per head dim anyway): a float argument would arrive as fp64
    # under torch.compile and promote the softmax math.
    return dict(n_batch=q.shape[0], n_heads=q.shape[1], n_queries=q.shape[2], n_keys=k.shape[2],
                SM_SCALE=1 / math.sqrt(d), HEAD_DIM=d, D_PAD=max(16, triton.next_power_of_2(d)),
                INPUT_PRECISION=precision, INTERLEAVE=interleave)


def _grid(shape: dict, tiles):
    """The launch grid for `tiles(meta)` tiles per sequence, in the order tile_head_batch reads it."""
    heads, batch = shape["n_heads"], shape["n_batch"]
    if shape["INTERLEAVE"]:
        return lambda meta: (heads, batch, tiles(meta))
    return lambda meta: (tiles(meta), heads, batch)


@functools.cache
def sm_count(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else INTERPRETED_L2_BYTES


def key_splits(batch: int, heads: int, n_queries: int, n_keys: int, device: torch.device) -> int:
    """How many programs share each query tile's keys, so that a grid too small for the GPU fills it.

    With one long sequence the grid has fewer query tiles than the GPU can run at once, and the forward takes
    as long as its longest row: splitting the keys shortens that row, for the price of a merge pass.
    """
    sms = sm_count(device.index) if device.type == "cuda" else 1
    min_keys = INTERPRETED_MIN_KEYS_PER_SPLIT if interpreted() else MIN_KEYS_PER_SPLIT
    tiles = batch * heads * triton.cdiv(n_queries, 128)
    return max(1, min(MAX_SPLITS, SPLIT_SLOTS_PER_SM * sms // tiles, n_keys // min_keys))


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # q: (batch, heads, n_queries, d), k and v: (batch, heads, n_keys, d)
    batch, heads, n_queries, _ = q.shape
    shape = _shape_args(q, k, "forward")
    splits = key_splits(batch, heads, n_queries, k.shape[2], q.device)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, n_queries), dtype=torch.float32, device=q.device)
    o_part, lse_part = o, lse  # unused by an unsplit forward
    if splits > 1:
        o_part = torch.empty((splits, batch, heads, n_queries, shape["D_PAD"]), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((splits, batch, heads, n_queries), dtype=torch.float32, device=q.device)
    grid = _grid(shape, lambda meta: triton.cdiv(n_queries, meta["BLOCK_M"]) * splits)
    _launch("fwd", grid, q, k, v, o, lse, o_part, lse_part, q.stride(), k.stride(), v.stride(), o.stride(),
            dtype=q.dtype, CAUSAL=is_causal, N_SPLITS=splits, **shape)
    if splits > 1:
        fwd_merge_kernel[(triton.cdiv(n_queries, PREPROCESS_BLOCK), heads, batch)](
            o_part, lse_part, o, lse, o.stride(), batch, heads, n_queries,
            HEAD_DIM=shape["HEAD_DIM"], D_PAD=shape["D_PAD"], N_SPLITS=splits, BLOCK_M=PREPROCESS_BLOCK)
    return o, lse


def _backward(q, k, v, o, do, lse, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, heads, n_queries, d = q.shape
    n_keys = k.shape[2]
    if do.stride(-1) != 1:
        do = do.contiguous()  # e.g. the stride-0 gradient of o.sum(): scalar loads would starve the kernels
    shape = _shape_args(q, k, "backward")
    delta = torch.empty_like(lse)
    bwd_preprocess_kernel[(triton.cdiv(n_queries, PREPROCESS_BLOCK), heads, batch)](
        o, do, delta, o.stride(), do.stride(), heads, n_queries,
        HEAD_DIM=d, D_PAD=shape["D_PAD"], BLOCK_M=PREPROCESS_BLOCK)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    grid = _grid(shape, lambda meta: triton.cdiv(n_keys, meta["BLOCK_N"]))
    _launch("dkdv", grid, q, k, v, do, dk, dv, lse, delta, q.stride(), k.stride(), v.stride(), do.stride(),
            dk.stride(), dv.stride(), dtype=q.dtype, CAUSAL=is_causal, **shape)
    grid = _grid(shape, lambda meta: triton.cdiv(n_queries, meta["BLOCK_M"]))
    _launch("dq", grid, q, k, v, do, dq, lse, delta, q.stride(), k.stride(), v.stride(), do.stride(),
            dq.stride(), dtype=q.dtype, CAUSAL=is_causal, **shape)
    return dq, dk, dv


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 4 else t.unsqueeze(1)  # (batch, seq, d) -> (batch, 1, seq, d)


def _attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """O (q's shape and dtype) and the fp32 log-sum-exp L (q's shape without d) of q, k, v."""
    o, lse = _forward(_as_4d(q), _as_4d(k), _as_4d(v), is_causal)
    return o.view(q.shape), lse.view(q.shape[:-1])


def _attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
                        lse: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV from the inputs, the output, its gradient and its log-sum-exp."""
    q4 = _as_4d(q)
    lse = lse.contiguous().view(q4.shape[:-1])  # the kernels index L by row
    dq, dk, dv = _backward(q4, _as_4d(k), _as_4d(v), _as_4d(o), _as_4d(do), lse, is_causal)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


# Under torch.compile the launches are custom ops, opaque to it: inside them sizes are plain ints, so the
# host-side decisions (tiles, key splits, launch order, the tile cache) never meet symbolic sizes, and a
# compiled caller neither breaks its graph nor recompiles for each new sequence length. Under a dispatch mode
# too (through_dispatcher), so that selective checkpointing can keep the forward's outputs.
flash_attention_forward = torch.library.custom_op("systems::flash_attention_forward", _attention_forward,
                                                  mutates_args=())
flash_attention_backward = torch.library.custom_op("systems::flash_attention_backward", _attention_backward,
                                                   mutates_args=())


@flash_attention_forward.register_fake
def _(q, k, v, is_causal):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:-1], dtype=torch.float32)


@flash_attention_backward.register_fake
def _(q, k, v, o, do, lse, is_causal):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


class FlashAttentionTriton(torch.autograd.Function):
    """`FlashAttentionTriton.apply(q, k, v, is_causal=False)`: q (batch, [heads,] n_queries, d), d <= 128.

    Eager calls run the launches directly, outside any dispatch mode: the custom ops' dispatch costs tens of
    microseconds a call, much of the host time of a short sequence.
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        check_inputs(q, k, v, is_causal, max_head_dim=MAX_HEAD_DIM)
        if q.device.type != "cuda" and not interpreted():
            raise ValueError(f"FlashAttentionTriton needs CUDA tensors, got {q.device}; on a CPU, TRITON_INTERPRET=1 "
                             "must be set before the kernels are imported (Triton reads it when it defines them)")
        if interpreted() and q.dtype == torch.bfloat16:
            raise TypeError("FlashAttentionTriton cannot run bfloat16 under TRITON_INTERPRET=1: the interpreter's "
                            "bf16 tl.dot gives wrong results; use float16 or float32 there, bfloat16 on a GPU")
        attend = flash_attention_forward if through_dispatcher() else _attention_forward
        o, lse = attend(q, k, v, is_causal)
        return save_for_recompute(ctx, q, k, v, o, lse, is_causal)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, is_causal = saved_for_recompute(ctx)
        gradients = flash_attention_backward if through_dispatcher() else _attention_backward
        dq, dk, dv = gradients(q, k, v, o, do, lse, is_causal)
        return dq, dk, dv, None
