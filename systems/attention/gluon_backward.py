"""FlashAttention-3-style backward for Hopper (sm90) in Gluon: preprocess, a warp-specialized main kernel, postprocess.

One program owns a 128-key tile: its K and V sit in shared memory while a producer warp streams Q_i and dO_i tiles
through a ring of stages. Two consumer warpgroups own 64 keys each and compute Sᵀ, dPᵀ, Pᵀ and dSᵀ transposed,
so dV += Pᵀ dO and dK += dSᵀ Q take Pᵀ and dSᵀ from registers; they exchange dSᵀ through shared memory for
dQ_i = dS K, half the head dim each, which is added to an fp32 dQ in global memory with atomics.
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from systems.attention.gluon_forward import (CONSUMER_REGISTERS, DTYPES, LOG2E, MAX_REGISTERS, PRODUCER_REGISTERS,
                                             as_rows)

LOG2E_: gl.constexpr = gl.constexpr(LOG2E)
KEYS_PER_CONSUMER = 64  # a wgmma's M per warpgroup: the rows of Sᵀ, dK and dV one consumer owns
BLOCK_N = 2 * KEYS_PER_CONSUMER
PREPROCESS_ROWS = 64


@gluon.jit
def bwd_preprocess_kernel(o_ptr, do_ptr, delta_ptr, dq_acc_ptr, n_rows, HEAD_DIM: gl.constexpr,
                          ROWS: gl.constexpr):
    """delta = rowsum(O ∘ dO) (it equals rowsum(P ∘ dP)), and zeros for the dQ that the main kernel adds to."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.program_id(0) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    offsets = rows.to(gl.int64)[:, None] * HEAD_DIM + cols[None, :]
    in_range = (rows < n_rows)[:, None]
    o = gl.load(o_ptr + offsets, mask=in_range, other=0.0).to(gl.float32)
    do = gl.load(do_ptr + offsets, mask=in_range, other=0.0).to(gl.float32)
    gl.store(delta_ptr + rows, gl.sum(o * do, 1), mask=rows < n_rows)
    gl.store(dq_acc_ptr + offsets, gl.zeros([ROWS, HEAD_DIM], gl.float32, layout), mask=in_range)


@gluon.jit
def bwd_postprocess_kernel(dq_acc_ptr, dq_ptr, n_rows, SCALE: gl.constexpr, HEAD_DIM: gl.constexpr,
                           ROWS: gl.constexpr):
    """dQ = SCALE · the fp32 sum of dS K, in dQ's dtype."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    rows = gl.program_id(0) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    offsets = rows.to(gl.int64)[:, None] * HEAD_DIM + cols[None, :]
    in_range = (rows < n_rows)[:, None]
    dq = gl.load(dq_acc_ptr + offsets, mask=in_range, other=0.0) * SCALE
    gl.store(dq_ptr + offsets, dq.to(dq_ptr.dtype.element_ty), mask=in_range)


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, kh_desc, q_smem, do_smem, k_smem, v_smem, kh_smem, bars, q_row,
              kv_row, n_iters, NUM_STAGES: gl.constexpr):
    """One warp: K, V (per consumer) and K's two column halves once, then Q_i and dO_i into stage i % NUM_STAGES
    once both consumers have freed it."""
    kv_bar, q_ready, do_ready, qdo_empty = bars[0], bars[1], bars[2], bars[3]
    keys: gl.constexpr = k_desc.block_type.shape[0]
    half: gl.constexpr = kh_desc.block_type.shape[1]
    rows: gl.constexpr = q_desc.block_type.shape[0]
    mbarrier.expect(kv_bar, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes + kh_desc.block_type.nbytes))
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [kv_row + w * keys, 0], kv_bar, k_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [kv_row + w * keys, 0], kv_bar, v_smem.index(w))
        tma.async_copy_global_to_shared(kh_desc, [kv_row, w * half], kv_bar, kh_smem.index(w))
    for i in range(n_iters):
        stage = i % NUM_STAGES
        # A fresh mbarrier counts as having completed the phase before phase 0: the first lap does not wait.
        mbarrier.wait(qdo_empty.index(stage), (i // NUM_STAGES & 1) ^ 1)
        mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + i * rows, 0], q_ready.index(stage), q_smem.index(stage))
        mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [q_row + i * rows, 0], do_ready.index(stage), do_smem.index(stage))


@gluon.jit
def _probabilities(s, lse, key0, m0, n_queries, n_keys, masked, QK_SCALE: gl.constexpr, CAUSAL: gl.constexpr):
    """Pᵀ = exp2(Sᵀ·scale - L·log2 e) of keys [key0, key0 + rows) and queries [m0, m0 + cols), with 0 at queries
    past n_queries, keys past n_keys (both read another head's rows) and, if CAUSAL, keys after the query."""
    p = gl.exp2(gl.fma(s, QK_SCALE, -lse[None, :] * LOG2E_))
    if masked:  # a runtime branch: only diagonal and ragged tiles pay for the mask
        keys = key0 + gl.arange(0, s.type.shape[0], layout=gl.SliceLayout(1, s.type.layout))
        queries = m0 + gl.arange(0, s.type.shape[1], layout=gl.SliceLayout(0, s.type.layout))
        visible = (keys[:, None] < n_keys) & (queries[None, :] < n_queries)
        if CAUSAL:
            visible = visible & (keys[:, None] <= queries[None, :])
        # where, not a product: a masked score can be anything, and its exp2 inf.
        p = gl.where(visible, p, 0.0)
    return p


@gluon.jit
def _fetch_row_stats(stats_smem, lse_ptr, delta_ptr, m0, n_queries):
    """Start copying L and delta of queries [m0, m0 + BLOCK_M) into stats_smem (0 past n_queries): in shared
    memory rather than registers until the softmax needs them, as 16 registers each in the wgmma layout."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    queries = m0 + gl.arange(0, stats_smem.type.shape[1], layout=layout)
    async_copy.async_copy_global_to_shared(stats_smem.index(0), lse_ptr + queries, mask=queries < n_queries)
    async_copy.async_copy_global_to_shared(stats_smem.index(1), delta_ptr + queries, mask=queries < n_queries)
    async_copy.commit_group()


@gluon.jit
def _exchange_ds(ds, ds_smem, ds_ready, ds_empty, i, WARPGROUP: gl.constexpr):
    """Store this consumer's dSᵀ rows into buffer i % 2 of ds_smem (once both consumers' dQ wgmmas of iteration
    i - 2 have read it), then wait until the other consumer's rows are there too."""
    buf = i % 2
    rows: gl.constexpr = ds.type.shape[0]
    mbarrier.wait(ds_empty.index(buf), (i // 2 & 1) ^ 1)
    ds_smem.index(buf).slice(WARPGROUP * rows, rows, dim=0).store(ds)
    fence_async_shared()  # the generic-proxy store, before the async-proxy wgmma reads it
    gl.thread_barrier()  # all four warps' rows, before the one arrive that stands for them
    mbarrier.arrive(ds_ready.index(buf), count=1)
    mbarrier.wait(ds_ready.index(buf), i // 2 & 1)
    return ds_smem.index(buf)


@gluon.jit
def _add_dq(dq_head_ptr, dq, m0, n_queries, WARPGROUP: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Add this consumer's half of dQ_i (fp32, unscaled) to the head's global dQ sum: relaxed atomics, which
    compile to reductions that return nothing, so the consumer does not wait for them. 32-bit offsets from the
    head's base keep the addresses at one register an element."""
    half: gl.constexpr = dq.type.shape[1]
    rows = m0 + gl.arange(0, dq.type.shape[0], layout=gl.SliceLayout(1, dq.type.layout))
    cols = WARPGROUP * half + gl.arange(0, half, layout=gl.SliceLayout(0, dq.type.layout))
    offsets = rows[:, None] * HEAD_DIM + cols[None, :]
    if m0 + dq.type.shape[0] > n_queries:  # only the ragged last tile pays for a predicate on each reduction
        gl.atomic_add(dq_head_ptr + offsets, dq, mask=(rows < n_queries)[:, None], sem="relaxed", scope="gpu")
    else:
        gl.atomic_add(dq_head_ptr + offsets, dq, sem="relaxed", scope="gpu")


@gluon.jit
def _store_keys(ptr, acc, bh, key0, n_keys, HEAD_DIM: gl.constexpr):
    """acc's rows, keys [key0, key0 + rows), into ptr: (batch × heads × n_keys, HEAD_DIM), those that exist."""
    keys = key0 + gl.arange(0, acc.type.shape[0], layout=gl.SliceLayout(1, acc.type.layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc.type.layout))
    offsets = (bh.to(gl.int64) * n_keys + keys)[:, None] * HEAD_DIM + cols[None, :]
    gl.store(ptr + offsets, acc.to(ptr.dtype.element_ty), mask=(keys < n_keys)[:, None])


@gluon.jit
def _consumer(dk_ptr, dv_ptr, dq_acc_ptr, lse_ptr, delta_ptr, q_smem, do_smem, k_smem, v_smem, kh_smem, ds_smem,
              bars, bh, start_n, m_begin, n_iters, n_queries, n_keys, WARPGROUP: gl.constexpr,
              QK_SCALE: gl.constexpr, SM_SCALE: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
              CAUSAL: gl.constexpr):
    """One warpgroup: dK and dV of keys [key0, key0 + 64) over every query tile, and its half of each dQ_i."""
    kv_bar, q_ready, do_ready, qdo_empty, ds_ready, ds_empty = bars
    KEYS: gl.constexpr = k_smem.type.shape[1]
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM // 2, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    query_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    key0 = start_n + WARPGROUP * KEYS
    k = k_smem.index(WARPGROUP)
    v = v_smem.index(WARPGROUP)
    s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout)
    dq_zero = gl.zeros([BLOCK_M, HEAD_DIM // 2], gl.float32, dq_layout)
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, kv_layout)
    ragged_keys = key0 + KEYS > n_keys
    row0 = bh.to(gl.int64) * n_queries
    stats_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    mbarrier.wait(kv_bar, 0)
    for i in range(n_iters):
        stage = i % NUM_STAGES
        phase = i // NUM_STAGES & 1
        m0 = (m_begin + i) * BLOCK_M
        q = q_smem.index(stage)
        do = do_smem.index(stage)
        _fetch_row_stats(stats_smem, lse_ptr + row0, delta_ptr + row0, m0, n_queries)
        mbarrier.wait(q_ready.index(stage), phase)
        s = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(stage), phase)
        dp = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)

        s = warpgroup_mma_wait(1, deps=(s, ))  # groups retire in order: Sᵀ is done, dPᵀ may not be
        async_copy.wait_group(0)
        gl.thread_barrier()  # every thread's part of L and delta has landed
        lse = stats_smem.index(0).load(query_layout)
        masked = ragged_keys | (m0 + BLOCK_M > n_queries)
        if CAUSAL:
            masked = masked | (m0 < key0 + KEYS)
        p = _probabilities(s, lse, key0, m0, n_queries, n_keys, masked, QK_SCALE, CAUSAL)
        p_op = gl.convert_layout(p.to(dtype), op_layout)
        dv = warpgroup_mma(p_op, do, dv, is_async=True)
        dp = warpgroup_mma_wait(1, deps=(dp, ))
        # Read before _exchange_ds's barrier, after which the next iteration may overwrite stats_smem.
        delta = stats_smem.index(1).load(query_layout)
        ds = (p * (dp - delta[None, :])).to(dtype)
        ds_op = gl.convert_layout(ds, op_layout)
        dk = warpgroup_mma(ds_op, q, dk, is_async=True)

        ds_all = _exchange_ds(ds, ds_smem, ds_ready, ds_empty, i, WARPGROUP)
        dq = warpgroup_mma(ds_all.permute((1, 0)), kh_smem.index(WARPGROUP), dq_zero, use_acc=False, is_async=True)
        # Pᵀ and dSᵀ pass through the wait, so that their registers stay the wgmmas' until those retire.
        dv, dk, dq, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, dq, p_op, ds_op))
        mbarrier.arrive(qdo_empty.index(stage), count=1)
        mbarrier.arrive(ds_empty.index(i % 2), count=1)
        _add_dq(dq_acc_ptr + row0 * HEAD_DIM, dq, m0, n_queries, WARPGROUP, HEAD_DIM)

    _store_keys(dk_ptr, dk * SM_SCALE, bh, key0, n_keys, HEAD_DIM)
    _store_keys(dv_ptr, dv, bh, key0, n_keys, HEAD_DIM)


# Lengths are not specialized: a length of 1 would be a constant, and the pipeline fails to compile that variant.
@gluon.jit(do_not_specialize=["n_queries", "n_keys"])
def attention_backward_kernel(q_desc, do_desc, k_desc, v_desc, kh_desc, dk_ptr, dv_ptr, dq_acc_ptr, lse_ptr,
                              delta_ptr, n_queries, n_keys, QK_SCALE: gl.constexpr, SM_SCALE: gl.constexpr,
                              HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """dK, dV of one 128-key tile of one (batch, head), and its terms of dQ: grid (key tiles, batch × heads).

    The descriptors are over (batch × heads × seq, d): a tile that runs past its sequence reads the next head's
    rows (or zeros past the tensor), which the masks and the masked stores leave out.
    """
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    KEYS: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    # Causal: early key tiles are seen by the most queries, and program 0 launches first.
    start_n = gl.program_id(0) * (2 * KEYS)
    bh = gl.program_id(1)
    m_begin = 0
    if CAUSAL:
        m_begin = start_n // BLOCK_M  # earlier query tiles see none of these keys
    n_iters = gl.maximum(gl.cdiv(n_queries, BLOCK_M) - m_begin, 0)

    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, KEYS, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, KEYS, HEAD_DIM], v_desc.layout)
    kh_smem = gl.allocate_shared_memory(dtype, [2, 2 * KEYS, HEAD_DIM // 2], kh_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * KEYS, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, 2 * KEYS, BLOCK_M], ds_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(qdo_empty.index(i), count=2)  # free once both consumers' wgmmas that read it retired
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)
        mbarrier.init(ds_empty.index(i), count=2)
    bars = (kv_bar, q_ready, do_ready, qdo_empty, ds_ready, ds_empty)
    gl.warp_specialize([
        (_consumer, (dk_ptr, dv_ptr, dq_acc_ptr, lse_ptr, delta_ptr, q_smem, do_smem, k_smem, v_smem, kh_smem,
                     ds_smem, bars, bh, start_n, m_begin, n_iters, n_queries, n_keys, 0, QK_SCALE, SM_SCALE,
                     HEAD_DIM, NUM_STAGES, CAUSAL)),
        (_consumer, (dk_ptr, dv_ptr, dq_acc_ptr, lse_ptr, delta_ptr, q_smem, do_smem, k_smem, v_smem, kh_smem,
                     ds_smem, bars, bh, start_n, m_begin, n_iters, n_queries, n_keys, 1, QK_SCALE, SM_SCALE,
                     HEAD_DIM, NUM_STAGES, CAUSAL)),
        (_producer, (q_desc, do_desc, k_desc, v_desc, kh_desc, q_smem, do_smem, k_smem, v_smem, kh_smem,
                     (kv_bar, q_ready, do_ready, qdo_empty), bh * n_queries + m_begin * BLOCK_M,
                     bh * n_keys + start_n, n_iters, NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


def default_stages(head_dim: int, block_m: int) -> int:
    """Q/dO stages that fit the 227 KiB of shared memory beside K, V, K's halves and two dSᵀ buffers (with
    d 128, a 128-query tile does not fit at all)."""
    return 2 if head_dim * block_m > 64 * 128 else 3


def gluon_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
                             lse: torch.Tensor, is_causal: bool, *, block_m: int = 64,
                             num_stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (contiguous, in the inputs' shapes and dtype) from q, k, v, the output o, its gradient do and
    the forward's fp32 natural-log L (q's shape without d), as gluon_attention_forward takes and gives them.

    block_m queries a tile (64 or 128), num_stages Q/dO stages (default_stages).
    """
    if block_m not in (64, 128) or block_m * q.shape[-1] > 64 * 128:
        raise ValueError(f"block_m must be 64, or 128 with head dim 64, got {block_m} with {q.shape[-1]}")
    d, n_queries, n_keys = q.shape[-1], q.shape[-2], k.shape[-2]
    batch_heads = q.numel() // (n_queries * d)
    num_stages = num_stages or default_stages(d, block_m)
    q2, k2, v2, o2, do2 = (as_rows(t) for t in (q, k, v, o, do))
    lse = lse.contiguous()
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    dq_acc = torch.empty(q2.shape, dtype=torch.float32, device=q.device)
    rows = batch_heads * n_queries
    bwd_preprocess_kernel[(triton.cdiv(rows, PREPROCESS_ROWS), )](o2, do2, delta, dq_acc, rows, HEAD_DIM=d,
                                                                   ROWS=PREPROCESS_ROWS, num_warps=4)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    gl_dtype = DTYPES[q.dtype]

    def descriptor(t, block):
        return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl_dtype))

    grid = (triton.cdiv(n_keys, BLOCK_N), batch_heads)
    attention_backward_kernel[grid](
        descriptor(q2, [block_m, d]), descriptor(do2, [block_m, d]), descriptor(k2, [KEYS_PER_CONSUMER, d]),
        descriptor(v2, [KEYS_PER_CONSUMER, d]), descriptor(k2, [BLOCK_N, d // 2]), dk, dv, dq_acc, lse, delta,
        n_queries, n_keys, QK_SCALE=LOG2E / math.sqrt(d), SM_SCALE=1 / math.sqrt(d), HEAD_DIM=d,
        NUM_STAGES=num_stages, CAUSAL=is_causal, num_warps=4, maxnreg=MAX_REGISTERS)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    bwd_postprocess_kernel[(triton.cdiv(rows, PREPROCESS_ROWS), )](dq_acc, dq, rows, SCALE=1 / math.sqrt(d),
                                                                    HEAD_DIM=d, ROWS=PREPROCESS_ROWS, num_warps=4)
    return dq, dk, dv
