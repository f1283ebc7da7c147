"""The gate's decision from every round of every turn: a slowdown that every turn shows fails however much the
turns drift, unchanged code passes, a point whose samples cannot tell is undecided with the turns that would
tell, the shift and its interval are the stratified rank test's, and samples too few to ever decide are named."""

import itertools
import math
import random
from statistics import NormalDist

import pytest
from pytest_benchmark.utils import parse_compare_fail

from systems.bench.verdicts import NEW, GONE, OK, SLOWER, UNDECIDED, can_decide, decide, shift_interval

PERCENT, SECONDS = parse_compare_fail("median:5%"), parse_compare_fail("median:0.001")


def runs(turns: int, rounds: int, factor: float, *, noise: float, drift: float, seed: int) -> tuple[list, list]:
    """Per turn, `rounds` rounds of either tree: the machine's speed drifts by up to `drift` (a log factor)
    between turns, each round jitters by `noise`, and the working tree takes `factor` times as long."""
    rng = random.Random(seed)
    base, work = [], []
    for _ in range(turns):
        speed = 0.05 * math.exp(rng.uniform(-drift, drift))
        base.append({"p": [speed * math.exp(rng.gauss(0, noise)) for _ in range(rounds)]})
        work.append({"p": [speed * factor * math.exp(rng.gauss(0, noise)) for _ in range(rounds)]})
    return base, work


def test_a_slowdown_every_turn_shows_fails_however_much_the_turns_drift():
    """The issue's gate: per-turn changes of +128%, +961% and +732% (the machine's load moving the baseline from
    turn to turn) read "too noisy" from one median a turn; the rounds show the change plainly."""
    base = [{"p": [0.131, 0.140, 0.128]}, {"p": [0.029, 0.031, 0.028]}, {"p": [0.037, 0.041, 0.036]}]
    work = [{"p": [0.30, 0.32, 0.29]}, {"p": [0.31, 0.33, 0.30]}, {"p": [0.32, 0.34, 0.31]}]
    for turns in (2, 3):
        [verdict] = decide(base[:turns], work[:turns], PERCENT)
        assert verdict.status == SLOWER and verdict.fails, verdict
        assert verdict.low > 100  # all of the interval far above the threshold


@pytest.mark.parametrize("turns", [2, 3, 5])
@pytest.mark.parametrize("seed", range(5))
def test_a_2x_slowdown_with_drift_and_jitter_fails(turns, seed):
    [verdict] = decide(*runs(turns, 3, 2.0, noise=0.15, drift=1.0, seed=seed), PERCENT)
    assert verdict.status == SLOWER, verdict


@pytest.mark.parametrize("factor, status", [(1.10, SLOWER), (1.0, OK), (1.02, OK), (0.9, OK)],
                         ids=["10%", "unchanged", "2%", "faster"])
def test_a_point_fails_only_when_its_slowdown_is_above_the_threshold_and_significant(factor, status):
    [verdict] = decide(*runs(3, 20, factor, noise=0.01, drift=0.3, seed=1), PERCENT)
    assert verdict.status == status, verdict
    assert verdict.fails is (status == SLOWER)
    assert verdict.low <= verdict.change <= verdict.high
    assert len(verdict.changes) == 3
    assert verdict.change == pytest.approx(100 * (factor - 1), abs=1.5)


def test_an_undecided_point_is_told_the_turns_that_would_decide_it():
    base, work = runs(3, 5, 1.0, noise=0.3, drift=0.3, seed=2)
    [verdict] = decide(base, work, PERCENT)
    assert verdict.status == UNDECIDED and verdict.undecided and not verdict.fails
    assert verdict.needed > 3 and "interval too wide" in verdict.reason
    copies = math.ceil(verdict.needed / 3)  # the same noise, as many turns as it asked for
    [more] = decide(base * copies, work * copies, PERCENT)
    assert more.status == OK, more


def test_samples_too_few_to_bound_the_interval_are_undecided_with_what_would_bound_it():
    [verdict] = decide([{"p": [0.01, 0.011]}], [{"p": [0.03, 0.031]}], PERCENT, scale_by="rounds")
    assert verdict.status == UNDECIDED and verdict.high == math.inf
    assert verdict.needed == 4 and "too few rounds" in verdict.reason


def rank_test_z(strata: list[tuple[list[float], list[float]]], shift: float) -> float:
    """van Elteren's statistic for `shift`, from the ranks of each stratum's pooled sample."""
    total, variance = 0.0, 0.0
    for base, work in strata:
        pooled = sorted([(x, 0) for x in base] + [(y - shift, 1) for y in work])
        rank_sum = sum(rank for rank, (_, side) in enumerate(pooled, 1) if side == 1)
        n, m = len(base), len(work)
        weight = 1 / (n + m + 1)
        total += weight * (rank_sum - m * (m + 1) / 2 - n * m / 2)
        variance += weight ** 2 * n * m * (n + m + 1) / 12
    return total / math.sqrt(variance)


def test_the_shift_and_its_interval_invert_van_elterens_rank_test():
    """Reference: the shifts at which the rank statistic, computed from ranks, crosses 0 and +-1.96."""
    rng = random.Random(3)
    strata = [([rng.gauss(0, 1) for _ in range(n)], [rng.gauss(1.5, 1) + 5 * s for _ in range(m)])
              for s, (n, m) in enumerate([(4, 6), (7, 5), (5, 5)])]
    for s, (base, _) in enumerate(strata):
        strata[s] = ([x + 5 * s for x in base], strata[s][1])  # each stratum at its own level: drift
    change, low, high = shift_interval(strata)
    z = NormalDist().inv_cdf(0.975)
    candidates = sorted(w - b for base, work in strata for b in base for w in work)
    above = [d for d in candidates if rank_test_z(strata, d - 1e-9) >= z]
    below = [d for d in candidates if rank_test_z(strata, d + 1e-9) <= -z]
    assert low == max(above) and high == min(below)
    assert rank_test_z(strata, change - 1e-9) >= 0 >= rank_test_z(strata, change + 1e-9)
    assert 0 < low < change < high


@pytest.mark.parametrize("turns, rounds", [(1, 3), (1, 4), (2, 2), (2, 3), (3, 2), (5, 1), (6, 1)])
def test_samples_that_can_never_decide_are_known_by_counting_orderings(turns, rounds):
    """Each turn's most extreme ordering (every working-tree round above every baseline round), counted among
    all equally likely orderings under no change; both tails."""
    orderings = list(itertools.permutations(range(2 * rounds)))
    extreme = sum(all(o[i] < o[j] for i in range(rounds) for j in range(rounds, 2 * rounds)) for o in orderings)
    assert can_decide(turns, rounds) is (2 * (extreme / len(orderings)) ** turns <= 0.05)


def test_a_difference_check_decides_in_seconds():
    base, work = runs(3, 10, 1.0, noise=0.01, drift=0.0, seed=4)
    work = [{"p": [t + 0.003 for t in turn["p"]]} for turn in work]
    [verdict] = decide(base, work, SECONDS)
    assert verdict.status == SLOWER and verdict.change == pytest.approx(0.003, abs=5e-4)


def test_points_in_one_tree_only_are_named_not_gated():
    base, work = [{"old": [1.0, 1.1]}], [{"new": [1.0, 1.1]}]
    assert {v.name: v.status for v in decide(base, work, PERCENT)} == {"new": NEW, "old": GONE}
