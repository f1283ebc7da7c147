"""FlashAttention-2 forward in Triton: one query tile per program, an online softmax over its key tiles.

Scores are kept in base 2 (log2(e) folded into the scale) so the softmax runs on exp2; the saved log-sum-exp
is in natural-log units, as `attention_reference` returns it. When batch × heads is too small to fill the GPU
(one long sequence), each query tile's keys are split over several programs and a second kernel merges their
partial outputs by their log-sum-exps, as flash-decoding does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from systems.attention.triton_tiles import (GRID_ARGS, LN2, LOG2E, at_head, key_ranges, load_tile, store_tile,
                                            tile_head_batch, tile_ptrs)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K, V, k_strides, v_strides, offs_m, n_keys, qk_scale, lo, hi,
               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
               INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_tile(K, k_strides, offs_n, n_keys, HEAD_DIM, D_PAD, MASKED)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)  # (BLOCK_M, BLOCK_N)
        if MASKED:
            visible = offs_n[None, :] < n_keys
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None])
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_tile(V, v_strides, offs_n, n_keys, HEAD_DIM, D_PAD, MASKED)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=GRID_ARGS)
def fwd_kernel(Q, K, V, O, LSE, O_PART, LSE_PART, q_strides, k_strides, v_strides, o_strides,
               n_batch, n_heads, n_queries, n_keys,
               SM_SCALE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
               INPUT_PRECISION: tl.constexpr, N_SPLITS: tl.constexpr, INTERLEAVE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """O and L of one query tile; with N_SPLITS > 1, of one split of its keys, into O_PART and LSE_PART."""
    qk_scale = SM_SCALE * LOG2E  # scores in base 2
    # Causal query tiles late in the sequence see the most keys: launch them first, shorten the tail.
    tile, n_tiles, h, b = tile_head_batch(INTERLEAVE)
    pid = n_tiles - 1 - tile
    start_m, split = pid // N_SPLITS * BLOCK_M, pid % N_SPLITS
    Q, K, V = at_head(Q, q_strides, b, h), at_head(K, k_strides, b, h), at_head(V, v_strides, b, h)
    O = at_head(O, o_strides, b, h)
    LSE += (b * n_heads + h) * n_queries

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    q = load_tile(Q, q_strides, offs_m, n_queries, HEAD_DIM, D_PAD, True)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max, base 2
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    unmasked_end, masked_end = key_ranges(start_m, n_keys, BLOCK_M, BLOCK_N, CAUSAL)
    # This program's keys: [lo, hi). Splits are whole query tiles long, so tile boundaries stay aligned.
    split_keys = tl.cdiv(tl.cdiv(n_keys, N_SPLITS), BLOCK_M) * BLOCK_M
    lo = split * split_keys
    hi = tl.minimum(lo + split_keys, masked_end)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, k_strides, v_strides, offs_m, n_keys, qk_scale,
                               lo, tl.minimum(unmasked_end, hi), HEAD_DIM, D_PAD, CAUSAL, INPUT_PRECISION, BLOCK_N,
                               False)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, k_strides, v_strides, offs_m, n_keys, qk_scale,
                               tl.maximum(unmasked_end, lo), hi, HEAD_DIM, D_PAD, CAUSAL, INPUT_PRECISION, BLOCK_N,
                               True)
    if N_SPLITS == 1:
        store_tile(tile_ptrs(O, o_strides, offs_m, D_PAD), acc / l_i[:, None], offs_m, n_queries, HEAD_DIM, D_PAD)
        tl.store(LSE + offs_m, (m_i + tl.math.log2(l_i)) * LN2, mask=offs_m < n_queries)
    else:
        # Partials in fp32, (splits, batch, heads, n_queries, D_PAD) and (splits, batch, heads, n_queries); a
        # causal tile's late splits can be empty (l = 0): they store O = 0 and L = -inf, which weighs nothing.
        row = ((split * n_batch + b) * n_heads + h) * n_queries + offs_m
        l_i = tl.where(l_i > 0, l_i, 1.0)
        tl.store(O_PART + row[:, None] * D_PAD + offs_d[None, :], acc / l_i[:, None],
                 mask=offs_m[:, None] < n_queries)
        tl.store(LSE_PART + row, m_i + tl.math.log2(l_i), mask=offs_m < n_queries)


@triton.jit
def fwd_merge_kernel(O_PART, LSE_PART, O, LSE, o_strides, n_batch, n_heads, n_queries,
                     HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, N_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr):
    """O and L of a query tile from its splits' partials: each weighs exp(its L - the tile's L)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    rows_per_split = n_batch * n_heads * n_queries
    row = (b * n_heads + h) * n_queries + offs_m
    in_range = offs_m < n_queries
    lse_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for split in tl.static_range(N_SPLITS):
        lse_max = tl.maximum(lse_max, tl.load(LSE_PART + split * rows_per_split + row, mask=in_range, other=0.0))
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    for split in tl.static_range(N_SPLITS):
        part = split * rows_per_split + row
        weight = tl.math.exp2(tl.load(LSE_PART + part, mask=in_range, other=0.0) - lse_max)
        o = tl.load(O_PART + part[:, None] * D_PAD + offs_d[None, :], mask=in_range[:, None], other=0.0)
        acc += weight[:, None] * o
        total += weight
    O = at_head(O, o_strides, b, h)
    store_tile(tile_ptrs(O, o_strides, offs_m, D_PAD), acc / total[:, None], offs_m, n_queries, HEAD_DIM, D_PAD)
    tl.store(LSE + (b * n_heads + h) * n_queries + offs_m, (lse_max + tl.math.log2(total)) * LN2, mask=in_range)
