"""What every attention kernel shares: tile loads and stores, which key tiles need a mask, which tile a program
owns.

The kernels take strided (batch, heads, seq, d) views, each with its strides as one tuple (`q.stride()`: Triton
specializes each element as it would a scalar argument, so a head dim of stride 1 compiles to vector loads), and
pad the head dim to a power of two with masks.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
# Batch and heads only size the grid: one compiled kernel serves all of their values (Triton would otherwise
# compile apart for 1 and for multiples of 16).
GRID_ARGS = ["n_batch", "n_heads"]


@triton.jit
def at_head(X, strides, b, h):
    """X, a (batch, heads, seq, d) tensor with these strides, moved to its (seq, d) matrix of batch b, head h."""
    return X + b * strides[0] + h * strides[1]


@triton.jit
def tile_ptrs(X, strides, rows, D_PAD: tl.constexpr):
    """Pointers to the (rows, D_PAD) tile of X's (seq, d) matrix (see at_head)."""
    cols = tl.arange(0, D_PAD)
    return X + rows[:, None] * strides[2] + cols[None, :] * strides[3]


@triton.jit
def load_tile(X, strides, rows, n_rows, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """The (rows, D_PAD) tile of X's (seq, d) matrix, zero in rows past n_rows (if CHECK_ROWS) and in the head-dim
    padding."""
    ptrs = tile_ptrs(X, strides, rows, D_PAD)
    cols = tl.arange(0, D_PAD)
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
def store_tile(ptrs, tile, rows, n_rows, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """Stores a tile at tile_ptrs(X, strides, rows, D_PAD), leaving out rows past n_rows and the head-dim padding."""
    # Pointers rather than X and strides, so that a call computes them before the tile's last arithmetic (acc / l,
    # dk * scale): computed after it, they reorder the epilogue's instructions and ptxas schedules it differently.
    cols = tl.arange(0, D_PAD)
    mask = rows[:, None] < n_rows
    if HEAD_DIM != D_PAD:
        mask = mask & (cols[None, :] < HEAD_DIM)
    tl.store(ptrs, tile.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def key_ranges(start_m, n_keys, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
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
def tile_head_batch(INTERLEAVE: tl.constexpr):
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
