"""Test tiers. The default `pytest tests/` runs every feature's cheapest checks, in minutes on a laptop; heavier
checks carry a tier's marker and run where asked (`--tiers`), so CI and the GPU hosts run every tier while a
change gets its first answer fast. A tier is a marker: `-m` still selects within what `--tiers` leaves.
"""

from __future__ import annotations

from collections import Counter

import pytest

DEFAULT = "default"  # the tests that carry no tier's marker
LEFT_OUT = pytest.StashKey[dict]()  # {tier: items not run}, for the summary
TIERS = {
    "launch": "more real launches of a feature than its default check: torchrun nodes, every variant across nodes",
    "slow": "long checks: compile on ranks, full world-size matrices, many Hypothesis examples",
    "timing": "checks of timings (the gate's on a GPU): run alone, off the critical path of -n",
    "browser": "the HTML report in headless Chromium (where it is installed): what a person sees, how fast, alone",
}
ALONE = frozenset({"timing", "browser"})  # tiers whose items time something: under -n each holds the host alone


def add_options(parser) -> None:
    group = parser.getgroup("test tiers", "which tiers of the tests run (README: Tests)")
    group.addoption("--tiers", metavar="TIERS", default=DEFAULT,
                    help=f"{DEFAULT} (the tests without a tier's marker), all, or some of {DEFAULT}, "
                         f"{', '.join(TIERS)}, comma-separated; default: {DEFAULT}")


def configure(config) -> None:
    for name, what in TIERS.items():
        config.addinivalue_line("markers", f"{name}: tier {name}, {what} (runs with --tiers {name} or all)")
    chosen(config)  # a bad name is a usage error at start-up


def chosen(config) -> frozenset[str]:
    text = config.getoption("tiers")
    names = {DEFAULT, *TIERS} if text == "all" else {name.strip() for name in text.split(",") if name.strip()}
    unknown = names - {DEFAULT, *TIERS}
    if unknown or not names:
        raise pytest.UsageError(f"--tiers {text}: choose {DEFAULT}, all, or from {DEFAULT}, {', '.join(TIERS)}")
    return frozenset(names)


def tier_of(item) -> str:
    return next((name for name in TIERS if item.get_closest_marker(name)), DEFAULT)


def select(config, items: list) -> list:
    """The items of the chosen tiers; the others are reported deselected."""
    names = chosen(config)
    tier = {item: tier_of(item) for item in items}
    left = [item for item in items if tier[item] not in names]
    if left:
        config.hook.pytest_deselected(items=left)
    config.stash[LEFT_OUT] = dict(Counter(tier[item] for item in left))
    return [item for item in items if tier[item] in names]


def summary_line(config) -> str | None:
    left = config.stash.get(LEFT_OUT, {})
    if not left:
        return None
    return (f"tiers run: {', '.join(sorted(chosen(config)))}; not run: "
            f"{', '.join(f'{name} ({count})' for name, count in left.items())}; --tiers all runs every tier")
