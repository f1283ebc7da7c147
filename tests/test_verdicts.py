"""The same-job gate's decision from paired turns: a slowdown fails only when it is both larger than the threshold
and significant, a point too noisy to tell is said to be, with the turns that would tell, and Student's t is
Student's t."""

import math
import random

import pytest
from pytest_benchmark.utils import parse_compare_fail

from systems.bench.verdicts import decide, t_quantile, turns_needed

PERCENT, SECONDS = parse_compare_fail("median:5%"), parse_compare_fail("median:0.001")


def turns(base: float, changes: list[float], name: str = "p") -> tuple[list[dict], list[dict]]:
    """Per turn, the baseline at `base` (jittered a little) and the working tree `change` (a ratio) above it."""
    rng = random.Random(len(changes))
    bases = [base * (1 + rng.uniform(-0.02, 0.02)) for _ in changes]
    return [{name: b} for b in bases], [{name: b * change} for b, change in zip(bases, changes)]


@pytest.mark.parametrize("df, quantile", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (29, 2.0452)])
def test_t_quantiles_are_students(df, quantile):
    assert t_quantile(df) == pytest.approx(quantile, abs=1e-4)


@pytest.mark.parametrize("changes, status", [
    ([1.10, 1.11, 1.09, 1.10, 1.10], "slower"),  # 10% with 1% noise: above 5% and significant
    ([1.00, 1.004, 0.997, 1.001, 0.998], "ok"),  # unchanged
    ([1.03, 1.031, 1.029, 1.030, 1.030], "ok"),  # significant, but below the threshold
    ([0.90, 0.91, 0.89, 0.90, 0.90], "ok"),  # faster
    ([1.10, 0.80, 1.40, 0.95, 1.30], "too noisy"),  # ±25%: cannot tell 5% at 5 turns
    ([1.08], "too noisy"),  # one turn has no interval
], ids=["slower", "unchanged", "small-but-significant", "faster", "noisy", "one-turn"])
def test_a_point_fails_only_when_its_slowdown_is_above_the_threshold_and_significant(changes, status):
    [verdict] = decide(*turns(0.02, changes), PERCENT)
    assert verdict.status == status
    assert verdict.slower is (status == "slower")
    assert len(verdict.changes) == len(changes)
    if status != "too noisy":
        assert verdict.low <= verdict.change <= verdict.high


def test_the_change_is_the_geometric_mean_of_the_turns_with_students_interval():
    changes = [1.10, 1.12, 1.08]
    [verdict] = decide(*turns(0.02, changes), PERCENT)
    logs = [math.log(c) for c in changes]
    mean = sum(logs) / 3
    spread = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    half = 4.3027 * spread / math.sqrt(3)
    assert verdict.change == pytest.approx(100 * math.expm1(mean))
    assert (verdict.low, verdict.high) == pytest.approx((100 * math.expm1(mean - half), 100 * math.expm1(mean + half)),
                                                        rel=1e-4)


def test_a_noisy_point_is_told_the_turns_that_would_gate_it():
    """With per-turn noise s (log ratio) a 5% threshold needs t(K-1) s / sqrt(K) <= log 1.05."""
    rng = random.Random(1)
    changes = [math.exp(rng.gauss(0, 0.04)) for _ in range(3)]
    [verdict] = decide(*turns(0.02, changes), PERCENT)
    assert verdict.status == "too noisy"
    logs = [math.log(c) for c in changes]
    spread = math.sqrt(sum((x - sum(logs) / 3) ** 2 for x in logs) / 2)
    needed = verdict.turns_needed
    assert t_quantile(needed - 1) * spread / math.sqrt(needed) <= math.log(1.05)
    assert t_quantile(needed - 2) * spread / math.sqrt(needed - 1) > math.log(1.05)
    assert turns_needed(spread, math.log(1.05)) == needed


def test_a_difference_check_decides_in_seconds():
    base, work = [{"p": 0.0100}, {"p": 0.0101}, {"p": 0.0099}], [{"p": 0.0115}, {"p": 0.0116}, {"p": 0.0114}]
    [verdict] = decide(base, work, SECONDS)
    assert verdict.status == "slower" and verdict.change == pytest.approx(0.0015)


def test_points_in_one_tree_only_are_named_not_gated():
    base, work = [{"old": 1.0}], [{"new": 1.0}]
    assert {v.name: v.status for v in decide(base, work, PERCENT)} == {"new": "new, not gated",
                                                                        "old": "not in the working tree"}
