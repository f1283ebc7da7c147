"""FlashAttention-2 backward in Triton, as in Triton's fused-attention tutorial.

First D = rowsum(O ∘ dO); then one kernel owns a key tile and sums dK and dV over query tiles, another owns a
query tile and sums dQ over key tiles, so nothing needs atomics. (A FlashAttention-2 style single kernel that
adds dQ with fp32 atomics measured slower on the H100: docs/perf-notes.md.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from systems.attention.triton_tiles import GRID_ARGS, LOG2E, key_ranges, load_tile, store_tile, tile_head_batch


@triton.jit
def bwd_preprocess_kernel(O, DO, DELTA,
                          stride_ob, stride_oh, stride_om, stride_od,
                          stride_dob, stride_doh, stride_dom, stride_dod,
                          n_heads, n_queries,
                          HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """DELTA = rowsum(O ∘ dO), which equals rowsum(P ∘ dP) of the softmax gradient."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    o = load_tile(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                  offs_m, n_queries, offs_d, HEAD_DIM, D_PAD, True)
    do = load_tile(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                   offs_m, n_queries, offs_d, HEAD_DIM, D_PAD, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + (b * n_heads + h) * n_queries + offs_m, delta, mask=offs_m < n_queries)


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, stride_qm, stride_qd, stride_dom, stride_dod, offs_n,
                    n_queries, qk_scale, lo, hi, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                    MASKED: tl.constexpr):
    # Query rows past n_queries load as zeros (q, dO, L and D alike) and so add exactly zero to dK and dV.
    offs_d = tl.arange(0, D_PAD)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = load_tile(Q + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                      offs_m, n_queries, offs_d, HEAD_DIM, D_PAD, MASKED)
        do = load_tile(DO + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                       offs_m, n_queries, offs_d, HEAD_DIM, D_PAD, MASKED)
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
def _at_head(Q, K, V, DO, LSE, DELTA, b, h, n_heads, n_queries, stride_qb, stride_qh, stride_kb, stride_kh,
             stride_vb, stride_vh, stride_dob, stride_doh):
    """The operands both backward kernels read, moved to batch b, head h (LSE and DELTA: (batch, heads, queries))."""
    rows = (b * n_heads + h) * n_queries
    return (Q + b * stride_qb + h * stride_qh, K + b * stride_kb + h * stride_kh, V + b * stride_vb + h * stride_vh,
            DO + b * stride_dob + h * stride_doh, LSE + rows, DELTA + rows)


@triton.jit(do_not_specialize=GRID_ARGS)
def bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA,
                    stride_qb, stride_qh, stride_qm, stride_qd,
                    stride_kb, stride_kh, stride_kn, stride_kd,
                    stride_vb, stride_vh, stride_vn, stride_vd,
                    stride_dob, stride_doh, stride_dom, stride_dod,
                    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                    n_batch, n_heads, n_queries, n_keys,
                    SM_SCALE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                    INPUT_PRECISION: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    tl.static_assert(BLOCK_N % BLOCK_M == 0)
    qk_scale = SM_SCALE * LOG2E
    # Causal: early key tiles are seen by the most queries, and program 0 launches first.
    tile, _, h, b = tile_head_batch(INTERLEAVE)
    start_n = tile * BLOCK_N
    Q, K, V, DO, LSE, DELTA = _at_head(Q, K, V, DO, LSE, DELTA, b, h, n_heads, n_queries, stride_qb, stride_qh,
                                       stride_kb, stride_kh, stride_vb, stride_vh, stride_dob, stride_doh)
    DK += b * stride_dkb + h * stride_dkh
    DV += b * stride_dvb + h * stride_dvh

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    k = load_tile(K + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                  offs_n, n_keys, offs_d, HEAD_DIM, D_PAD, True)
    v = load_tile(V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                  offs_n, n_keys, offs_d, HEAD_DIM, D_PAD, True)
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    full = n_queries // BLOCK_M * BLOCK_M
    if CAUSAL:
        # Queries before start_n see none of these keys; those in the tile's own span need the mask.
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, stride_qm, stride_qd, stride_dom, stride_dod,
                                 offs_n, n_queries, qk_scale, start_n, tl.minimum(start_n + BLOCK_N, n_queries),
                                 HEAD_DIM, D_PAD, CAUSAL, INPUT_PRECISION, BLOCK_M, True)
        lo = start_n + BLOCK_N
    else:
        lo = 0
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, stride_qm, stride_qd, stride_dom, stride_dod,
                             offs_n, n_queries, qk_scale, lo, full,
                             HEAD_DIM, D_PAD, CAUSAL, INPUT_PRECISION, BLOCK_M, False)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, stride_qm, stride_qd, stride_dom, stride_dod,
                             offs_n, n_queries, qk_scale, tl.maximum(lo, full), n_queries,
                             HEAD_DIM, D_PAD, CAUSAL, INPUT_PRECISION, BLOCK_M, True)
    store_tile(DK + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd, dk * SM_SCALE,
               offs_n, n_keys, offs_d, HEAD_DIM, D_PAD)
    store_tile(DV + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd, dv,
               offs_n, n_keys, offs_d, HEAD_DIM, D_PAD)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd, offs_m, n_keys,
                  qk_scale, lo, hi, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    offs_d = tl.arange(0, D_PAD)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_tile(K + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                      offs_n, n_keys, offs_d, HEAD_DIM, D_PAD, MASKED)
        v = load_tile(V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                      offs_n, n_keys, offs_d, HEAD_DIM, D_PAD, MASKED)
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
def bwd_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA,
                  stride_qb, stride_qh, stride_qm, stride_qd,
                  stride_kb, stride_kh, stride_kn, stride_kd,
                  stride_vb, stride_vh, stride_vn, stride_vd,
                  stride_dob, stride_doh, stride_dom, stride_dod,
                  stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                  n_batch, n_heads, n_queries, n_keys,
                  SM_SCALE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    qk_scale = SM_SCALE * LOG2E
    tile, n_tiles, h, b = tile_head_batch(INTERLEAVE)
    start_m = (n_tiles - 1 - tile) * BLOCK_M  # longest causal tiles first
    Q, K, V, DO, LSE, DELTA = _at_head(Q, K, V, DO, LSE, DELTA, b, h, n_heads, n_queries, stride_qb, stride_qh,
                                       stride_kb, stride_kh, stride_vb, stride_vh, stride_dob, stride_doh)
    DQ += b * stride_dqb + h * stride_dqh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    q = load_tile(Q + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                  offs_m, n_queries, offs_d, HEAD_DIM, D_PAD, True)
    do = load_tile(DO + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                   offs_m, n_queries, offs_d, HEAD_DIM, D_PAD, True)
    lse = tl.load(LSE + offs_m, mask=offs_m < n_queries, other=0.0) * LOG2E
    delta = tl.load(DELTA + offs_m, mask=offs_m < n_queries, other=0.0)
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    unmasked_end, masked_end = key_ranges(start_m, n_keys, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd, offs_m, n_keys,
                       qk_scale, 0, unmasked_end, HEAD_DIM, D_PAD, CAUSAL, INPUT_PRECISION, BLOCK_N, False)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd, offs_m, n_keys,
                       qk_scale, unmasked_end, masked_end, HEAD_DIM, D_PAD, CAUSAL, INPUT_PRECISION, BLOCK_N, True)
    store_tile(DQ + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd, dq * SM_SCALE,
               offs_m, n_queries, offs_d, HEAD_DIM, D_PAD)
