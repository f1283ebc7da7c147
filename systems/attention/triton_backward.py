"""FlashAttention-2 backward in Triton, as in Triton's fused-attention tutorial.

First D = rowsum(O ∘ dO); then one kernel owns a key tile and sums dK and dV over query tiles, another owns a
query tile and sums dQ over key tiles, so nothing needs atomics. (A FlashAttention-2 style single kernel that
adds dQ with fp32 atomics measured slower on the H100: docs/perf-notes.md.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from systems.attention.triton_tiles import (GRID_ARGS, LOG2E, at_head, key_ranges, load_tile, store_tile,
                                            tile_head_batch, tile_ptrs)


@triton.jit
def bwd_preprocess_kernel(O, DO, DELTA, o_strides, do_strides, n_heads, n_queries,
                          HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """DELTA = rowsum(O ∘ dO), which equals rowsum(P ∘ dP) of the softmax gradient."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    o = load_tile(at_head(O, o_strides, b, h), o_strides, offs_m, n_queries, HEAD_DIM, D_PAD, True)
    do = load_tile(at_head(DO, do_strides, b, h), do_strides, offs_m, n_queries, HEAD_DIM, D_PAD, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + (b * n_heads + h) * n_queries + offs_m, delta, mask=offs_m < n_queries)


@triton.jit
def _tile_pair(X, x_strides, Y, y_strides, rows, n_rows, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
               CHECK_ROWS: tl.constexpr):
    """Two tensors' tiles at the same rows, as the backward kernels take them: a key tile's k and v, a query
    tile's q and dO."""
    x = load_tile(X, x_strides, rows, n_rows, HEAD_DIM, D_PAD, CHECK_ROWS)
    y = load_tile(Y, y_strides, rows, n_rows, HEAD_DIM, D_PAD, CHECK_ROWS)
    return x, y


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, q_strides, do_strides, offs_n, n_queries, qk_scale, lo, hi,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                    INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        # Query rows past n_queries load as zeros (q, dO, L and D alike) and so add exactly zero to dK and dV.
        q, do = _tile_pair(Q, q_strides, DO, do_strides, offs_m, n_queries, HEAD_DIM, D_PAD, MASKED)
        if MASKED:
            lse = tl.load(LSE + offs_m, mask=offs_m < n_queries, other=0.0)
            delta = tl.load(DELTA + offs_m, mask=offs_m < n_queries, other=0.0)
        else:
            lse = tl.load(LSE + offs_m)
            delta = tl.load(DELTA + offs_m)
        # Transposed (keys, queries) blocks, so dV and dK accumulate without transposing P or dS. dP goes to the
        # tensor cores before the softmax, which then runs beside it (faster on the H100: docs/perf-notes.md).
        qk_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :] * LOG2E)
        if MASKED and CAUSAL:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def _operands_at_head(Q, K, V, DO, LSE, DELTA, q_strides, k_strides, v_strides, do_strides, b, h, n_heads,
                      n_queries):
    """The operands both backward kernels read, moved to batch b, head h (LSE and DELTA: (batch, heads, queries))."""
    rows = (b * n_heads + h) * n_queries
    return (at_head(Q, q_strides, b, h), at_head(K, k_strides, b, h), at_head(V, v_strides, b, h),
            at_head(DO, do_strides, b, h), LSE + rows, DELTA + rows)


@triton.jit(do_not_specialize=GRID_ARGS)
def bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, q_strides, k_strides, v_strides, do_strides, dk_strides,
                    dv_strides, n_batch, n_heads, n_queries, n_keys,
                    SM_SCALE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                    INPUT_PRECISION: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    tl.static_assert(BLOCK_N % BLOCK_M == 0)
    qk_scale = SM_SCALE * LOG2E
    # Causal: early key tiles are seen by the most queries, and program 0 launches first.
    tile, _, h, b = tile_head_batch(INTERLEAVE)
    start_n = tile * BLOCK_N
    Q, K, V, DO, LSE, DELTA = _operands_at_head(Q, K, V, DO, LSE, DELTA, q_strides, k_strides, v_strides,
                                                do_strides, b, h, n_heads, n_queries)
    DK, DV = at_head(DK, dk_strides, b, h), at_head(DV, dv_strides, b, h)

    offs_n = start_n + tl.arange(0, BLOCK_N)
    k, v = _tile_pair(K, k_strides, V, v_strides, offs_n, n_keys, HEAD_DIM, D_PAD, True)
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    full = n_queries // BLOCK_M * BLOCK_M
    if CAUSAL:
        # Queries before start_n see none of these keys; those in the tile's own span need the mask.
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, q_strides, do_strides, offs_n, n_queries, qk_scale,
                                 start_n, tl.minimum(start_n + BLOCK_N, n_queries),
                                 HEAD_DIM, D_PAD, CAUSAL, INPUT_PRECISION, BLOCK_M, True)
        lo = start_n + BLOCK_N
    else:
        lo = 0
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, q_strides, do_strides, offs_n, n_queries, qk_scale,
                             lo, full, HEAD_DIM, D_PAD, CAUSAL, INPUT_PRECISION, BLOCK_M, False)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, q_strides, do_strides, offs_n, n_queries, qk_scale,
                             tl.maximum(lo, full), n_queries, HEAD_DIM, D_PAD, CAUSAL, INPUT_PRECISION, BLOCK_M, True)
    store_tile(tile_ptrs(DK, dk_strides, offs_n, D_PAD), dk * SM_SCALE, offs_n, n_keys, HEAD_DIM, D_PAD)
    store_tile(tile_ptrs(DV, dv_strides, offs_n, D_PAD), dv, offs_n, n_keys, HEAD_DIM, D_PAD)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, K, V, k_strides, v_strides, offs_m, n_keys, qk_scale, lo, hi,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _tile_pair(K, k_strides, V, v_strides, offs_n, n_keys, HEAD_DIM, D_PAD, MASKED)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if MASKED:
            # Key rows past n_keys load as zeros, so their scores are 0: where a row's real scores are all far
            # below 0, exp2(0 - L) overflows to inf, and inf times their zero k would make dQ NaN.
            visible = offs_n[None, :] < n_keys
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(visible, p, 0.0)
        # dP after the softmax: issued before it, as in the dK/dV kernel, it measured slower (docs/perf-notes.md).
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit(do_not_specialize=GRID_ARGS)
def bwd_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, q_strides, k_strides, v_strides, do_strides, dq_strides,
                  n_batch, n_heads, n_queries, n_keys,
                  SM_SCALE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    qk_scale = SM_SCALE * LOG2E
    tile, n_tiles, h, b = tile_head_batch(INTERLEAVE)
    start_m = (n_tiles - 1 - tile) * BLOCK_M  # longest causal tiles first
    Q, K, V, DO, LSE, DELTA = _operands_at_head(Q, K, V, DO, LSE, DELTA, q_strides, k_strides, v_strides,
                                                do_strides, b, h, n_heads, n_queries)
    DQ = at_head(DQ, dq_strides, b, h)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    q, do = _tile_pair(Q, q_strides, DO, do_strides, offs_m, n_queries, HEAD_DIM, D_PAD, True)
    lse = tl.load(LSE + offs_m, mask=offs_m < n_queries, other=0.0) * LOG2E
    delta = tl.load(DELTA + offs_m, mask=offs_m < n_queries, other=0.0)
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    unmasked_end, masked_end = key_ranges(start_m, n_keys, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, k_strides, v_strides, offs_m, n_keys, qk_scale, 0, unmasked_end,
                       HEAD_DIM, D_PAD, CAUSAL, INPUT_PRECISION, BLOCK_N, False)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, k_strides, v_strides, offs_m, n_keys, qk_scale, unmasked_end,
                       masked_end, HEAD_DIM, D_PAD, CAUSAL, INPUT_PRECISION, BLOCK_N, True)
    store_tile(tile_ptrs(DQ, dq_strides, offs_m, D_PAD), dq * SM_SCALE, offs_m, n_queries, HEAD_DIM, D_PAD)
