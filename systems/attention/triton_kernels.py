"""FlashAttention-2 in Triton: a forward kernel and a three-kernel backward, tiles autotuned per shape.

All kernels take strided (batch, heads, seq, d) views and pad the head dim to a power of two with masks.
Scores are kept in base 2 (log2(e) folded into the scale) so the softmax runs on exp2; the saved
log-sum-exp is in natural-log units, as `attention_reference` returns it.

When batch × heads is too small to fill the GPU (one long sequence), the forward splits each query tile's
keys over several programs and a second kernel merges their partial outputs by their log-sum-exps, as
flash-decoding does. The backward follows Triton's fused-attention tutorial: D = rowsum(O ∘ dO), then one
kernel owns a key tile and sums dK, dV over query tiles, another owns a query tile and sums dQ over key
tiles, so nothing needs atomics. (A FlashAttention-2 style single kernel that adds dQ with fp32 atomics
measured slower on the H100: 4.2 ms against 3.7 ms for the two kernels at (16, 16384, 64) causal.)
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from systems.attention.reference import check_inputs

MAX_HEAD_DIM = 128
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)

# Tiles as (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages), the fastest few of a wider H100 sweep; for
# (16, 16384, 64) bf16 causal the autotuner picks about (64|128, 64) forward, (64, 64, 4, 3) dK/dV and
# (128, 64, 8, 3) dQ. Sequences shorter than TUNE_FROM_SEQ run one fixed tile: there, autotuning costs
# more time (a compile per config) than it can save.
TUNE_FROM_SEQ = 2048
FWD_TILES = [(64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 4), (128, 64, 8, 3), (128, 128, 8, 3), (64, 32, 4, 4)]
DKDV_TILES = [(64, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 4), (64, 128, 8, 3), (32, 128, 8, 3), (16, 64, 4, 3)]
DQ_TILES = [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4), (128, 32, 4, 5), (128, 64, 8, 2), (64, 16, 4, 3)]
if INTERPRETING:
    # The interpreter runs each program in Python: small tiles keep it quick and give tests several tiles.
    SHORT_TILES = {"fwd": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1)}
else:
    SHORT_TILES = {"fwd": (64, 32, 4, 2), "dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2)}
PREPROCESS_BLOCK = 64
# Batch and heads only size the grid: one compiled kernel serves all of their values (Triton would otherwise
# compile apart for 1 and for multiples of 16).
GRID_ARGS = ["n_batch", "n_heads"]
# Key splits: the forward aims at SPLIT_SLOTS_PER_SM query-tile programs per SM, splitting no further than
# MIN_KEYS_PER_SPLIT keys a program. On the H100 this takes batch 1, seq 16384, d 64 causal from 0.157 to
# 0.108 ms. The interpreter counts as one SM with small splits, so tests split too.
SPLIT_SLOTS_PER_SM = 4
MAX_SPLITS = 8
MIN_KEYS_PER_SPLIT = 16 if INTERPRETING else 512
# Sequences interleave (see _tile_head_batch) while the K and V (forward) or Q and dO (backward) of all of
# them take at most this many times the L2 cache. Measured on the H100 (L2 50 MiB), bf16 causal, interleaved
# vs not: forward (16, 16384, 64) (64 MB) 1.20 vs 1.34 ms, (8, 8192, 64) 0.16 vs 0.21, but (4 x 32 heads,
# 2048, 128) (128 MB) 0.45 vs 0.36; backward (8, 8192, 128) (32 MB) 0.86 vs 0.97, but (16, 16384, 64) 3.58
# vs 3.55 and (16, 16384, 128) 6.77 vs 6.65. The interpreter counts as a small cache, so tests take both orders.
L2_MULTIPLE_TO_INTERLEAVE = {"forward": 2, "backward": 1}
INTERPRETED_L2_BYTES = 64 * 2**10


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


if INTERPRETING and tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7):
    _index_interpreted_scalars_of_any_rank()


@triton.jit
def _load_tile(ptrs, rows, n_rows, cols, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """A (rows, D_PAD) tile, zero in rows past n_rows (if CHECK_ROWS) and in the head-dim padding."""
    # Masks only where needed: a mask that varies along d would stop the loads from being vectorized.
    if CHECK_ROWS:
        mask = rows[:, None] < n_rows
        if HEAD_DIM != D_PAD:
            mask = mask & (cols[None, :] < HEAD_DIM)
        tile = tl.load(ptrs, mask=mask, other=0.0)
    elif HEAD_DIM != D_PAD:
        tile = tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _store_tile(ptrs, tile, rows, n_rows, cols, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    mask = rows[:, None] < n_rows
    if HEAD_DIM != D_PAD:
        mask = mask & (cols[None, :] < HEAD_DIM)
    tl.store(ptrs, tile.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _key_ranges(start_m, n_keys, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """For the query tile at start_m: key tiles in [0, a) need no mask, those in [a, b) do; none lie past b."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    full = n_keys // BLOCK_N * BLOCK_N
    if CAUSAL:
        # Keys before start_m are visible to every query of the tile; those past its last query to none.
        unmasked_end = tl.minimum(start_m, full)
        masked_end = tl.minimum(start_m + BLOCK_M, n_keys)
    else:
        unmasked_end = full
        masked_end = n_keys
    return unmasked_end, masked_end


@triton.jit
def _tile_head_batch(INTERLEAVE: tl.constexpr):
    """This program's tile index, the number of tiles, and its head and batch.

    The GPU launches programs with grid axis 0 varying fastest. INTERLEAVE (grid (heads, batch, tiles)) launches
    every sequence's tile k before any sequence's tile k + 1: with tiles numbered longest-first, the longest
    causal tiles of all sequences run first and the last wave holds short ones. Otherwise (grid (tiles, heads,
    batch)) the tiles of one sequence run together and share its K and V (or Q and dO) in L2, but the last
    sequence's longest tiles start last and run alone.
    """
    if INTERLEAVE:
        tile, n_tiles, h, b = tl.program_id(2), tl.num_programs(2), tl.program_id(0), tl.program_id(1)
    else:
        tile, n_tiles, h, b = tl.program_id(0), tl.num_programs(0), tl.program_id(1), tl.program_id(2)
    return tile, n_tiles, h.to(tl.int64), b.to(tl.int64)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd, offs_m, n_keys, qk_scale,
               lo, hi, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
               INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    offs_d = tl.arange(0, D_PAD)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(K + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                       offs_n, n_keys, offs_d, HEAD_DIM, D_PAD, MASKED)
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
        v = _load_tile(V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                       offs_n, n_keys, offs_d, HEAD_DIM, D_PAD, MASKED)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=GRID_ARGS)
def _fwd_kernel(Q, K, V, O, LSE, O_PART, LSE_PART,
                stride_qb, stride_qh, stride_qm, stride_qd,
                stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd,
                stride_ob, stride_oh, stride_om, stride_od,
                n_batch, n_heads, n_queries, n_keys,
                SM_SCALE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                INPUT_PRECISION: tl.constexpr, N_SPLITS: tl.constexpr, INTERLEAVE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """O and L of one query tile; with N_SPLITS > 1, of one split of its keys, into O_PART and LSE_PART."""
    qk_scale = SM_SCALE * LOG2E  # scores in base 2
    # Causal query tiles late in the sequence see the most keys: launch them first, shorten the tail.
    tile, n_tiles, h, b = _tile_head_batch(INTERLEAVE)
    pid = n_tiles - 1 - tile
    start_m, split = pid // N_SPLITS * BLOCK_M, pid % N_SPLITS
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    O += b * stride_ob + h * stride_oh
    LSE += (b * n_heads + h) * n_queries

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    q = _load_tile(Q + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                   offs_m, n_queries, offs_d, HEAD_DIM, D_PAD, True)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max, base 2
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    unmasked_end, masked_end = _key_ranges(start_m, n_keys, BLOCK_M, BLOCK_N, CAUSAL)
    # This program's keys: [lo, hi). Splits are whole query tiles long, so tile boundaries stay aligned.
    split_keys = tl.cdiv(tl.cdiv(n_keys, N_SPLITS), BLOCK_M) * BLOCK_M
    lo = split * split_keys
    hi = tl.minimum(lo + split_keys, masked_end)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd, offs_m, n_keys,
                               qk_scale, lo, tl.minimum(unmasked_end, hi), HEAD_DIM, D_PAD, CAUSAL, INPUT_PRECISION,
                               BLOCK_N, False)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd, offs_m, n_keys,
                               qk_scale, tl.maximum(unmasked_end, lo), hi, HEAD_DIM, D_PAD, CAUSAL, INPUT_PRECISION,
                               BLOCK_N, True)
    if N_SPLITS == 1:
        _store_tile(O + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, acc / l_i[:, None],
                    offs_m, n_queries, offs_d, HEAD_DIM, D_PAD)
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
def _fwd_merge_kernel(O_PART, LSE_PART, O, LSE,
                      stride_ob, stride_oh, stride_om, stride_od,
                      n_batch, n_heads, n_queries, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, N_SPLITS: tl.constexpr,
                      BLOCK_M: tl.constexpr):
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
    O += b * stride_ob + h * stride_oh
    _store_tile(O + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, acc / total[:, None],
                offs_m, n_queries, offs_d, HEAD_DIM, D_PAD)
    tl.store(LSE + (b * n_heads + h) * n_queries + offs_m, (lse_max + tl.math.log2(total)) * LN2, mask=in_range)


@triton.jit
def _bwd_preprocess_kernel(O, DO, DELTA,
                           stride_ob, stride_oh, stride_om, stride_od,
                           stride_dob, stride_doh, stride_dom, stride_dod,
                           n_heads, n_queries,
                           HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """DELTA = rowsum(O ∘ dO), which equals rowsum(P ∘ dP) of the softmax gradient."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    o = _load_tile(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                   offs_m, n_queries, offs_d, HEAD_DIM, D_PAD, True)
    do = _load_tile(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
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
        q = _load_tile(Q + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                       offs_m, n_queries, offs_d, HEAD_DIM, D_PAD, MASKED)
        do = _load_tile(DO + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                        offs_m, n_queries, offs_d, HEAD_DIM, D_PAD, MASKED)
        if MASKED:
            lse = tl.load(LSE + offs_m, mask=offs_m < n_queries, other=0.0)
            delta = tl.load(DELTA + offs_m, mask=offs_m < n_queries, other=0.0)
        else:
            lse = tl.load(LSE + offs_m)
            delta = tl.load(DELTA + offs_m)
        # Transposed (keys, queries) blocks, so dV and dK accumulate without transposing P or dS. dP goes to the
        # tensor cores before the softmax, which then runs beside it: 1.7-4.4% off this kernel's best tile (H100).
        qk_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :] * LOG2E)
        if MASKED and CAUSAL:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=GRID_ARGS)
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA,
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
    tile, _, h, b = _tile_head_batch(INTERLEAVE)
    start_n = tile * BLOCK_N
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_dob + h * stride_doh
    DK += b * stride_dkb + h * stride_dkh
    DV += b * stride_dvb + h * stride_dvh
    LSE += (b * n_heads + h) * n_queries
    DELTA += (b * n_heads + h) * n_queries

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    k = _load_tile(K + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                   offs_n, n_keys, offs_d, HEAD_DIM, D_PAD, True)
    v = _load_tile(V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
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
    _store_tile(DK + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd, dk * SM_SCALE,
                offs_n, n_keys, offs_d, HEAD_DIM, D_PAD)
    _store_tile(DV + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd, dv,
                offs_n, n_keys, offs_d, HEAD_DIM, D_PAD)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd, offs_m, n_keys,
                  qk_scale, lo, hi, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    offs_d = tl.arange(0, D_PAD)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(K + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                       offs_n, n_keys, offs_d, HEAD_DIM, D_PAD, MASKED)
        v = _load_tile(V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
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
        # dP after the softmax: issued before it, as in the dK/dV kernel, it measured up to 25% slower at d 64.
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit(do_not_specialize=GRID_ARGS)
def _bwd_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA,
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
    tile, n_tiles, h, b = _tile_head_batch(INTERLEAVE)
    start_m = (n_tiles - 1 - tile) * BLOCK_M  # longest causal tiles first
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_dob + h * stride_doh
    DQ += b * stride_dqb + h * stride_dqh
    LSE += (b * n_heads + h) * n_queries
    DELTA += (b * n_heads + h) * n_queries

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    q = _load_tile(Q + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                   offs_m, n_queries, offs_d, HEAD_DIM, D_PAD, True)
    do = _load_tile(DO + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                    offs_m, n_queries, offs_d, HEAD_DIM, D_PAD, True)
    lse = tl.load(LSE + offs_m, mask=offs_m < n_queries, other=0.0) * LOG2E
    delta = tl.load(DELTA + offs_m, mask=offs_m < n_queries, other=0.0)
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    unmasked_end, masked_end = _key_ranges(start_m, n_keys, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd, offs_m, n_keys,
                       qk_scale, 0, unmasked_end, HEAD_DIM, D_PAD, CAUSAL, INPUT_PRECISION, BLOCK_N, False)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd, offs_m, n_keys,
                       qk_scale, unmasked_end, masked_end, HEAD_DIM, D_PAD, CAUSAL, INPUT_PRECISION, BLOCK_N, True)
    _store_tile(DQ + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd, dq * SM_SCALE,
                offs_m, n_queries, offs_d, HEAD_DIM, D_PAD)


def _autotuned(kernel, tiles):
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in tiles]
    # Batch and heads set the grid, on which the best tile depends as much as on the sequence lengths.
    key = ["n_batch", "n_heads", "n_queries", "n_keys", "HEAD_DIM", "CAUSAL", "INPUT_PRECISION", "INTERLEAVE"]
    if "N_SPLITS" in kernel.arg_names:
        key.append("N_SPLITS")
    return triton.autotune(configs, key=key)(kernel)


# name: (fixed tile for short sequences, autotuned over the tiles for long ones)
_KERNELS = {
    "fwd": (_autotuned(_fwd_kernel, [SHORT_TILES["fwd"]]), _autotuned(_fwd_kernel, FWD_TILES)),
    "dkdv": (_autotuned(_bwd_dkdv_kernel, [SHORT_TILES["dkdv"]]), _autotuned(_bwd_dkdv_kernel, DKDV_TILES)),
    "dq": (_autotuned(_bwd_dq_kernel, [SHORT_TILES["dq"]]), _autotuned(_bwd_dq_kernel, DQ_TILES)),
}
_chosen: dict[tuple, triton.Config] = {}  # (kernel, dtype, shape arguments) -> the autotuner's pick


def _launch(name: str, grid, *args, dtype: torch.dtype, **shape) -> None:
    """Run kernel `name`: a shape's first call through the autotuner, later calls straight to its choice.

    Skipping the autotuner's per-call bookkeeping (it rebuilds its key from every argument) saves tens of
    microseconds a launch, which is most of the host time of short sequences.
    """
    short, tuned = _KERNELS[name]
    kernel = tuned if max(shape["n_queries"], shape["n_keys"]) >= TUNE_FROM_SEQ and not INTERPRETING else short
    key = (name, dtype, *shape.values())
    config = _chosen.get(key)
    if config is None:
        kernel[grid](*args, **shape)
        _chosen[key] = kernel.best_config
    else:
        kernel.fn[grid](*args, **shape, **config.all_kwargs())


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
    """The launch grid for `tiles(meta)` tiles per sequence, in the order _tile_head_batch reads it."""
    heads, batch = shape["n_heads"], shape["n_batch"]
    if shape["INTERLEAVE"]:
        return lambda meta: (heads, batch, tiles(meta))
    return lambda meta: (tiles(meta), heads, batch)


@functools.cache
def _sm_count(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else INTERPRETED_L2_BYTES


def _key_splits(batch: int, heads: int, n_queries: int, n_keys: int, device: torch.device) -> int:
    """How many programs share each query tile's keys, so that a grid too small for the GPU fills it.

    With one long sequence the grid has fewer query tiles than the GPU can run at once, and the forward takes
    as long as its longest row: splitting the keys shortens that row, for the price of a merge pass.
    """
    sms = _sm_count(device.index) if device.type == "cuda" else 1
    tiles = batch * heads * triton.cdiv(n_queries, 128)
    return max(1, min(MAX_SPLITS, SPLIT_SLOTS_PER_SM * sms // tiles, n_keys // MIN_KEYS_PER_SPLIT))


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # q: (batch, heads, n_queries, d), k and v: (batch, heads, n_keys, d)
    batch, heads, n_queries, _ = q.shape
    shape = _shape_args(q, k, "forward")
    splits = _key_splits(batch, heads, n_queries, k.shape[2], q.device)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, n_queries), dtype=torch.float32, device=q.device)
    o_part, lse_part = o, lse  # unused by an unsplit forward
    if splits > 1:
        o_part = torch.empty((splits, batch, heads, n_queries, shape["D_PAD"]), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((splits, batch, heads, n_queries), dtype=torch.float32, device=q.device)
    grid = _grid(shape, lambda meta: triton.cdiv(n_queries, meta["BLOCK_M"]) * splits)
    _launch("fwd", grid, q, k, v, o, lse, o_part, lse_part, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
            dtype=q.dtype, CAUSAL=is_causal, N_SPLITS=splits, **shape)
    if splits > 1:
        _fwd_merge_kernel[(triton.cdiv(n_queries, PREPROCESS_BLOCK), heads, batch)](
            o_part, lse_part, o, lse, *o.stride(), batch, heads, n_queries,
            HEAD_DIM=shape["HEAD_DIM"], D_PAD=shape["D_PAD"], N_SPLITS=splits, BLOCK_M=PREPROCESS_BLOCK)
    return o, lse


def _backward(q, k, v, o, do, lse, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, heads, n_queries, d = q.shape
    n_keys = k.shape[2]
    if do.stride(-1) != 1:
        do = do.contiguous()  # e.g. the stride-0 gradient of o.sum(): scalar loads would starve the kernels
    shape = _shape_args(q, k, "backward")
    delta = torch.empty_like(lse)
    _bwd_preprocess_kernel[(triton.cdiv(n_queries, PREPROCESS_BLOCK), heads, batch)](
        o, do, delta, *o.stride(), *do.stride(), heads, n_queries,
        HEAD_DIM=d, D_PAD=shape["D_PAD"], BLOCK_M=PREPROCESS_BLOCK)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    grid = _grid(shape, lambda meta: triton.cdiv(n_keys, meta["BLOCK_N"]))
    _launch("dkdv", grid, q, k, v, do, dk, dv, lse, delta, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
            *dk.stride(), *dv.stride(), dtype=q.dtype, CAUSAL=is_causal, **shape)
    grid = _grid(shape, lambda meta: triton.cdiv(n_queries, meta["BLOCK_M"]))
    _launch("dq", grid, q, k, v, do, dq, lse, delta, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
            *dq.stride(), dtype=q.dtype, CAUSAL=is_causal, **shape)
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
# host-side decisions (tiles, key splits, launch order, the launch cache) never meet symbolic sizes, and a
# compiled caller neither breaks its graph nor recompiles for each new sequence length.
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

    Eager calls run the launches directly: the custom ops' dispatch costs tens of microseconds a call, much of
    the host time of a short sequence.
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        check_inputs(q, k, v, is_causal, max_head_dim=MAX_HEAD_DIM)
        if q.device.type != "cuda" and not INTERPRETING:
            raise ValueError(f"FlashAttentionTriton needs CUDA tensors (or TRITON_INTERPRET=1), got {q.device}")
        if INTERPRETING and q.dtype == torch.bfloat16:
            raise TypeError("FlashAttentionTriton cannot run bfloat16 under TRITON_INTERPRET=1: the interpreter's "
                            "bf16 tl.dot gives wrong results; use float16 or float32 there, bfloat16 on a GPU")
        attend = flash_attention_forward if torch.compiler.is_compiling() else _attention_forward
        o, lse = attend(q, k, v, is_causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        gradients = flash_attention_backward if torch.compiler.is_compiling() else _attention_backward
        dq, dk, dv = gradients(q, k, v, o, do, lse, ctx.is_causal)
        return dq, dk, dv, None
