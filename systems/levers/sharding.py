"""Our FSDP's levers (systems.parallel.fsdp): what one collective covers (`Gather`) and how many all-gathers run
ahead of the computing group (prefetch), with their defaults; and how many reduce-scatters it keeps in flight,
a fixed policy that its memory accounting (systems.accounting.sharding) reads too."""

from __future__ import annotations

from systems.choice import Choice
from systems.levers.spelling import number


class Gather(Choice):
    """What one all-gather (and one reduce-scatter) covers: a layer's weight (the handout's), or every layer's of
    a block (FSDP2's unit: one host call per block, see FSDP)."""

    LAYER = "layer"
    BLOCK = "block"


DEFAULT_GATHER = Gather.BLOCK
DEFAULT_PREFETCH = 1  # the next group's all-gather in flight while a group computes


def check_prefetch(prefetch: int) -> int:
    """Gathers in flight ahead of the computing layer: a whole number, at least the next layer's."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int):
        raise TypeError(f"prefetch must be an int, got {prefetch!r}")
    if prefetch < 1:
        raise ValueError(f"prefetch must be at least 1, got {prefetch}")
    return prefetch


def parse_prefetch(text: str) -> int:
    return check_prefetch(number(int, text))


REDUCE_SCATTERS_IN_FLIGHT = 2  # a waited reduce-scatter frees its full-size gradients
