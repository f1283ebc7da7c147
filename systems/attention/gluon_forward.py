"""FlashAttention-3-style forward for Hopper (sm90) in Gluon: a warp-specialized kernel and its launcher.

One producer warp streams K and V tiles by TMA into a ring of shared-memory stages; two consumer warpgroups of
64 query rows each (a 128-row Q tile) run async wgmmas and an fp32 online softmax in base 2. Each consumer
issues the next QKᵀ before waiting for the previous PV, so the softmax runs under a wgmma. O and the
natural-log L follow triton_forward: (batch, heads, seq, d) inputs, scale 1/√d.
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from systems.attention.reference import check_inputs

HEAD_DIMS = (64, 128)
DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
LOG2E = 1.4426950408889634
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)
CONSUMER_ROWS = 64  # query rows of one consumer warpgroup: a wgmma's M is 64 per warpgroup
BLOCK_M = 2 * CONSUMER_ROWS
# setmaxnreg budget: 12 warps (the producer's one warp is padded to a warpgroup) share 64K registers. 168 a
# thread at launch (12 × 32 × 168 <= 65536), then the producer gives back all but 24 for two consumers of 240.
MAX_REGISTERS = 168
CONSUMER_REGISTERS: gl.constexpr = gl.constexpr(240)
PRODUCER_REGISTERS: gl.constexpr = gl.constexpr(24)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, q_row, kv_row, n_tiles,
              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """One warp: both halves of the Q tile, then K_j and V_j into stage j % NUM_STAGES once consumers freed it."""
    q_bar, k_ready, k_empty, v_ready, v_empty = bars
    rows: gl.constexpr = q_desc.block_type.shape[0]
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + rows, 0], q_bar, q_smem.index(1))
    for j in range(n_tiles):
        stage = j % NUM_STAGES
        # A fresh mbarrier counts as having completed the phase before phase 0: the first lap does not wait.
        empty_phase = (j // NUM_STAGES & 1) ^ 1
        mbarrier.wait(k_empty.index(stage), empty_phase)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), empty_phase)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, 0], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _masked(s, j, m0, n_keys, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Scores s of key tile j with -inf at keys past n_keys and, if CAUSAL, past each query row."""
    cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
    visible = cols[None, :] < n_keys
    if CAUSAL:
        rows = m0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s.type.layout))
        visible = visible & (cols[None, :] <= rows[:, None])
    return gl.where(visible, s, float("-inf"))


@gluon.jit
def _softmax_step(s, m_i, l_i, j, first_masked, m0, n_keys, QK_SCALE: gl.constexpr, ROWS: gl.constexpr,
                  BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """P = exp2(s·scale - m_new), the rescale alpha of what was summed under m_i, and the new m and l."""
    if j >= first_masked:  # a runtime branch: only the diagonal and ragged tail tiles pay for the mask
        s = _masked(s, j, m0, n_keys, ROWS, BLOCK_N, CAUSAL)
    # Tile 0 comes first and holds key 0, which every row sees: m_new is finite from then on, so a row that a
    # later tile masks whole gets p = 0 and alpha = 1, never inf - inf.
    m_new = gl.maximum(m_i, gl.max(s, 1) * QK_SCALE)
    p = gl.exp2(gl.fma(s, QK_SCALE, -m_new[:, None]))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _consumer(o_ptr, lse_ptr, q_smem, k_smem, v_smem, p_smem, bars, start_m, bh, n_queries, n_keys, n_tiles,
              WARPGROUP: gl.constexpr, QK_SCALE: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, P_IN_SMEM: gl.constexpr):
    """One warpgroup: rows [m0, m0 + 64) of the Q tile against every key tile, then their O and L."""
    q_bar, k_ready, k_empty, v_ready, v_empty = bars
    ROWS: gl.constexpr = q_smem.type.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    m0 = start_m + WARPGROUP * ROWS
    # Key tiles before first_masked lie wholly before n_keys and, if causal, before this warpgroup's first row.
    first_masked = n_keys // BLOCK_N
    if CAUSAL:
        first_masked = gl.minimum(first_masked, (m0 + 1) // BLOCK_N)
    q = q_smem.index(WARPGROUP)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)

    # Prologue: S_0 and P_0.
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, 0, first_masked, m0, n_keys, QK_SCALE, ROWS, BLOCK_N, CAUSAL)
    p = p.to(dtype)
    if P_IN_SMEM:
        p_smem.store(p)
        fence_async_shared()  # the generic-proxy store, before the async-proxy wgmma reads it
        gl.thread_barrier()  # all four warps' rows
    else:
        p = gl.convert_layout(p, p_layout)

    # Steady state: S_j = Q K_jᵀ is issued ahead of O += P_{j-1} V_{j-1}; the softmax of S_j runs while the PV
    # is in flight, and O is rescaled by alpha_j once the PV has landed.
    for j in range(1, n_tiles):
        stage = j % NUM_STAGES
        prev = (j - 1) % NUM_STAGES
        mbarrier.wait(k_ready.index(stage), j // NUM_STAGES & 1)
        s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), (j - 1) // NUM_STAGES & 1)
        if P_IN_SMEM:
            acc = warpgroup_mma(p_smem, v_smem.index(prev), acc, is_async=True)
        else:
            acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s, ))  # groups retire in order: S_j is done, the PV may not be
        mbarrier.arrive(k_empty.index(stage), count=1)
        p_next, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, j, first_masked, m0, n_keys, QK_SCALE, ROWS,
                                                BLOCK_N, CAUSAL)
        p_next = p_next.to(dtype)
        if P_IN_SMEM:
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(v_empty.index(prev), count=1)
            p_smem.store(p_next)
            fence_async_shared()
            gl.thread_barrier()
        else:
            p_next = gl.convert_layout(p_next, p_layout)
            # P_{j-1} passes through the wait, so that its registers stay the PV wgmma's until it retires.
            acc, p = warpgroup_mma_wait(0, deps=(acc, p))
            mbarrier.arrive(v_empty.index(prev), count=1)
            p = p_next
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]

    # Epilogue: the last PV, then O = acc / l and L = (m + log2 l) ln 2 for the rows that exist.
    last = (n_tiles - 1) % NUM_STAGES
    mbarrier.wait(v_ready.index(last), (n_tiles - 1) // NUM_STAGES & 1)
    if P_IN_SMEM:
        acc = warpgroup_mma(p_smem, v_smem.index(last), acc, is_async=True)
    else:
        acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(last), count=1)

    rows = m0 + gl.arange(0, ROWS, layout=o_rows)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    in_range = rows < n_queries
    row_index = bh.to(gl.int64) * n_queries + rows
    o = acc / gl.convert_layout(l_i, o_rows)[:, None]
    gl.store(o_ptr + row_index[:, None] * HEAD_DIM + cols[None, :], o.to(dtype), mask=in_range[:, None])
    lse = (m_i + gl.log2(l_i)) * LN2
    lse_rows = m0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    gl.store(lse_ptr + bh.to(gl.int64) * n_queries + lse_rows, lse, mask=lse_rows < n_queries)


@gluon.jit
def attention_forward_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr, n_queries, n_keys,
                             QK_SCALE: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                             NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, P_IN_SMEM: gl.constexpr):
    """O and L of one 128-row query tile of one (batch, head): grid (query tiles, batch × heads).

    q_desc, k_desc, v_desc are TMA descriptors over (batch × heads × seq, d): a tile that runs past its
    sequence reads the next head's rows (or zeros past the tensor), which the masks and the masked stores
    leave out.
    """
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    # Causal query tiles late in the sequence see the most keys: launch them first, to shorten the tail.
    start_m = (gl.num_programs(0) - 1 - gl.program_id(0)) * (2 * ROWS)
    bh = gl.program_id(1)
    hi = n_keys
    if CAUSAL:
        hi = gl.minimum(start_m + 2 * ROWS, n_keys)
    n_tiles = gl.cdiv(hi, BLOCK_N)

    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_N], dtype)
    # Without P_IN_SMEM a token buffer stands in, so that both consumers keep one signature.
    p_smem = gl.allocate_shared_memory(dtype, [2, ROWS, BLOCK_N] if P_IN_SMEM else [2, 8, 8],
                                       p_layout if P_IN_SMEM else gl.NVMMASharedLayout.get_default_for([8, 8], dtype))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # A stage is free again once both consumers have waited on the wgmma that read it.
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    bars = (q_bar, k_ready, k_empty, v_ready, v_empty)

    gl.warp_specialize([
        (_consumer, (o_ptr, lse_ptr, q_smem, k_smem, v_smem, p_smem.index(0), bars, start_m, bh, n_queries, n_keys,
                     n_tiles, 0, QK_SCALE, HEAD_DIM, BLOCK_N, NUM_STAGES, CAUSAL, P_IN_SMEM)),
        (_consumer, (o_ptr, lse_ptr, q_smem, k_smem, v_smem, p_smem.index(1), bars, start_m, bh, n_queries, n_keys,
                     n_tiles, 1, QK_SCALE, HEAD_DIM, BLOCK_N, NUM_STAGES, CAUSAL, P_IN_SMEM)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, bh * n_queries + start_m, bh * n_keys,
                     n_tiles, BLOCK_N, NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


def default_stages(head_dim: int, block_n: int) -> int:
    """K/V stages that fit the 227 KiB of shared memory beside the Q tile (and P, with p_in_smem)."""
    return 2 if head_dim * block_n >= 128 * 128 else 3


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t as a (batch × heads × seq, d) matrix, copied where TMA cannot read it in place (strided rows, or a base
    address off 16 bytes)."""
    t = t if t.dim() == 4 else t.unsqueeze(1)
    if not t.is_contiguous() or t.data_ptr() % 16:
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(-1, t.shape[-1])


def check_gluon_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> None:
    """Raise unless this kernel can run q, k, v: the shared contract, then its dtypes, head dims and GPU."""
    check_inputs(q, k, v, is_causal)
    if q.dtype not in DTYPES:
        raise TypeError(f"the Gluon attention forward takes {[str(t) for t in DTYPES]}, got {q.dtype}")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"the Gluon attention forward takes head dims {HEAD_DIMS}, got {q.shape[-1]}")
    if q.device.type != "cuda":
        raise ValueError(f"the Gluon attention forward needs CUDA tensors, got {q.device}")
    capability = torch.cuda.get_device_capability(q.device)
    if capability != (9, 0):
        raise RuntimeError(f"the Gluon attention forward is written for Hopper (sm90: wgmma, TMA, setmaxnreg); "
                           f"{torch.cuda.get_device_name(q.device)} is sm{capability[0]}{capability[1]}")


def gluon_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *,
                            block_n: int = 128, num_stages: int | None = None,
                            p_in_smem: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """O (q's shape and dtype, contiguous) and the fp32 natural-log L (q's shape without d) of q, k, v:
    (batch, [heads,] seq, d), d 64 or 128, bf16 or fp16, on an sm90 GPU.

    block_n keys a tile (64 or 128), num_stages K/V stages (default_stages), p_in_smem feeds P to the PV wgmma
    from shared memory rather than registers.
    """
    check_gluon_inputs(q, k, v, is_causal)
    if block_n not in (64, 128):
        raise ValueError(f"block_n must be 64 or 128, got {block_n}")
    d, n_queries, n_keys = q.shape[-1], q.shape[-2], k.shape[-2]
    batch_heads = q.numel() // (n_queries * d)
    num_stages = num_stages or default_stages(d, block_n)
    q2, k2, v2 = as_rows(q), as_rows(k), as_rows(v)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    gl_dtype = DTYPES[q.dtype]
    q_layout = gl.NVMMASharedLayout.get_default_for([CONSUMER_ROWS, d], gl_dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gl_dtype)
    q_desc = TensorDescriptor.from_tensor(q2, [CONSUMER_ROWS, d], q_layout)
    k_desc = TensorDescriptor.from_tensor(k2, [block_n, d], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v2, [block_n, d], kv_layout)
    grid = (triton.cdiv(n_queries, BLOCK_M), batch_heads)
    # The scale is a compile-time constant (one per head dim anyway), as in triton_forward.
    attention_forward_kernel[grid](q_desc, k_desc, v_desc, o, lse, n_queries, n_keys,
                                   QK_SCALE=LOG2E / math.sqrt(d), HEAD_DIM=d, BLOCK_N=block_n,
                                   NUM_STAGES=num_stages, CAUSAL=is_causal, P_IN_SMEM=p_in_smem,
                                   num_warps=4, maxnreg=MAX_REGISTERS)
    return o, lse
