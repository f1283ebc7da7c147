"""Activation checkpointing's arithmetic: what autograd keeps of the blocks, what one block's backward holds, and
what the backward recomputes, for `TransformerConfig.checkpoint`'s segment sizes (outermost first).

It follows torch.utils.checkpoint (non-reentrant, as systems.model runs it) and its early stop. `kept_inputs`,
`inputs_in_forward` and `segment_starts` count the segment inputs alive, `held_in_backward` the activations a
block's backward holds (selective checkpointing's too), `recomputed_blocks` what the backward runs again, and
`least_peak_levels` the two-level sizes (K, k) of least peak, evaluating every pair on the exact model.
docs/design-notes.md has the derivation of the two-level optimum and of selective checkpointing's cost.
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
