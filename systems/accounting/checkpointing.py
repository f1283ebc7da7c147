"""Activation checkpointing's arithmetic: what autograd keeps of the blocks, what one block's backward holds, and
what the backward recomputes, for `TransformerConfig.checkpoint`'s segment sizes (outermost first).

torch.utils.checkpoint (non-reentrant, as systems.model runs it) keeps a segment's input and none of what its
blocks save. The backward recomputes a segment when it first needs one of those tensors, and stops recomputing
at the last tensor it must save again (torch's early stop): an innermost segment's last matmul (w2) is not run
again, and an outer segment's recomputation ends on saving its last inner segment's input. Recomputed tensors
are freed block by block as the backward consumes them.

The two-level scheme with the least peak. With L blocks of A bytes each and segment inputs of r bytes (one
residual-stream tensor), one level of k-block segments holds at most L/k inputs plus one segment's k blocks, so
its activation peak is about (L/k) r + k A, least at k = sqrt(L r / A). Two levels, K-block segments each
recomputed as k-block ones, hold L/K outer inputs, K/k inner ones and k blocks: (L/K + K/k) r + k A, least at
k = (L r^2 / A^2)^(1/3) and K = sqrt(L k). For the presets A is tens of r (written-out attention's seq^2
scores make it more), so k = 1 and K is near sqrt(L): the peak falls from L r + A to 2 sqrt(L) r + A, paid for
with a second recomputation of the blocks. Sizes are integers, segments at the ends are shorter and gradients
accumulate during the backward, so `least_peak_levels` evaluates every (K, k) on the exact model instead of
rounding the continuous optimum. Where the gradients outgrow the kept inputs (fp32 weights of the large presets)
the peak is in the bottom block's backward, where every scheme with k = 1 holds one block and nearly all the
gradients: nesting cannot lower it there, and ties go to the scheme that recomputes least.

Selective checkpointing (systems.recompute). Leaving the top `keep` blocks out keeps their activations from the
forward on, but their backward runs first and frees them before the checkpointed blocks' backward begins: the
peak grows only where it was at the top of the backward or at the end of the forward, and the recomputation
shrinks by keep / L. Op-level selection keeps, of each one-block segment, its attention kernel's outputs, or
those and its matmuls', which the recomputation then takes instead of running them (the matmuls' FLOPs leave it;
the last matmul's output is kept but never taken, the recomputation stopping before it).
"""

from __future__ import annotations

from collections.abc import Callable


def kept_inputs(num_layers: int, levels: tuple[int, ...]) -> int:
    """How many segment inputs autograd keeps through the forward: one per outermost segment."""
    return -(-num_layers // levels[0]) if levels else 0


def held_in_backward(levels: tuple[int, ...], block: int, per_block: int, segment_input: int, shared: int, *,
                     checkpointed: int, selected: int = 0, untaken: int = 0) -> int:
    """Bytes of activations held while `block`'s backward runs: the inputs, at every level, of the segments
    from the first up to `block`'s (an inner segment that starts its parent shares the parent's input), and
    the blocks of `block`'s innermost segment up to `block`, recomputed. `shared`: bytes of the first
    recomputed block's activations that are its segment's input itself (an fp32 residual stream, which the
    block's norm saves as it is). Without checkpointing, blocks 0 to `block`.

    Selective checkpointing: only the first `checkpointed` blocks are; the blocks above keep
    `per_block` each, and in their backward every checkpointed segment's input is held. Under op-level selection
    each checkpointed block below `block` keeps `selected` bytes too, and a recomputed block holds, beside its
    recomputed activations (which include what it selected), the `untaken` bytes of its selection that the
    recomputation does not take."""
    if not levels:
        return (block + 1) * per_block
    if block >= checkpointed:
        above = block - checkpointed + 1
        return kept_inputs(checkpointed, levels) * segment_input + checkpointed * selected + above * per_block
    held, start = 0, 0
    for depth, (size, inner_start) in enumerate(zip(levels, segment_starts(levels, block))):
        held += ((block - start) // size + (depth == 0)) * segment_input
        start = inner_start
    return held + (block - start + 1) * per_block - shared + block * selected + untaken


def inputs_in_forward(levels: tuple[int, ...], block: int) -> int:
    """How many segment inputs are alive while `block`'s forward runs: every outermost segment's so far, kept for
    the backward; the input of `block`'s segment at each inner level, which the caller running that segment
    holds; and `block`'s own. Tensors saved inside a segment are dropped as it runs."""
    outermost = range(0, block + 1, levels[0])
    return len({*outermost, *segment_starts(levels, block), block})


def segment_starts(levels: tuple[int, ...], block: int) -> list[int]:
    """The first block of each segment `block` lies in, outermost first: the last is where the recomputation
    that `block`'s backward holds began."""
    starts, start = [], 0
    for size in levels:
        start += (block - start) // size * size
        starts.append(start)
    return starts


def recomputed_blocks(num_layers: int, levels: tuple[int, ...]) -> tuple[int, int]:
    """(blocks whose forward the backward runs again, innermost segments, each of which skips its last w2)."""
    return _recomputed(0, num_layers, levels) if levels else (0, 0)


def _recomputed(start: int, stop: int, levels: tuple[int, ...]) -> tuple[int, int]:
    size, inner = levels[0], levels[1:]
    blocks = segments = 0
    for first in range(start, stop, size):
        last = min(first + size, stop)
        if not inner:
            blocks, segments = blocks + last - first, segments + 1
            continue
        # The recomputation runs every inner segment but the last, then the inner segments recompute themselves.
        inner_blocks, inner_segments = _recomputed(first, last, inner)
        blocks += (last - first - 1) // inner[0] * inner[0] + inner_blocks
        segments += inner_segments
    return blocks, segments


def least_peak_levels(num_layers: int, peak: Callable[[tuple[int, ...]], int]) -> tuple[int, ...]:
    """The two-level sizes (K, k), k < K <= num_layers (the checkpointed blocks), of least `peak`; ties go to fewer
    recomputed blocks. One block is one level of single blocks: no two-level scheme exists."""
    if num_layers == 1:
        return (1,)
    candidates = [(outer, inner) for outer in range(2, num_layers + 1) for inner in range(1, outer)]
    return min(candidates, key=lambda levels: (peak(levels), recomputed_blocks(num_layers, levels)))
