"""Covering arrays for the default tier: a few cases of a parameter grid in which every pair of values of any two
parameters meets at least once, so a bug that shows with one value, or with two together, is still caught; the
rest of the grid runs in the slow tier (systems.bench.tiers)."""

from __future__ import annotations

import itertools

import pytest


def pairwise(*dimensions: tuple) -> list[tuple]:
    """Cases of the grid covering every pair of values of any two dimensions, chosen greedily (each the case that
    covers the most pairs still uncovered, the first such in the grid's order), in the grid's order."""
    grid = list(itertools.product(*dimensions))
    uncovered = {pair for case in grid for pair in _pairs(case)}
    chosen = []
    while uncovered:
        best = max(grid, key=lambda case: len(_pairs(case) & uncovered))
        chosen.append(best)
        uncovered -= _pairs(best)
    return sorted(chosen, key=grid.index)


def tiered(*dimensions: tuple) -> list[tuple[tuple, list]]:
    """Every case of the grid, in its order, with its marks: none in the covering array (the default tier), the
    slow tier's otherwise."""
    covering = pairwise(*dimensions)
    return [(case, [] if case in covering else [pytest.mark.slow]) for case in itertools.product(*dimensions)]


def tiered_as(grid: list[tuple], default: list[tuple]) -> list[tuple[tuple, list]]:
    """As `tiered`, with the default tier's cases picked by hand (e.g. so that they share compiles) from `grid`:
    checked here to meet every pair of values that two dimensions take together in the grid."""
    missed = {pair for case in grid for pair in _pairs(case)} - {pair for case in default for pair in _pairs(case)}
    assert set(default) <= set(grid) and not missed, f"the default cases miss {sorted(missed, key=str)}"
    return [(case, [] if case in default else [pytest.mark.slow]) for case in grid]


def _pairs(case: tuple) -> frozenset:
    return frozenset(((i, case[i]), (j, case[j])) for i, j in itertools.combinations(range(len(case)), 2))
