"""The gate's decision for each point, from every round of every turn: a change with its interval, and a
verdict that says when the samples cannot tell.

A turn times the point in both trees back to back, so comparing rounds only within a turn leaves out the drift
between turns. The change is the shift between the two trees' rounds (log times for a percentage check, so a
slowdown compounds; seconds for a difference), estimated as the Hodges-Lehmann shift stratified by turn: the
median of every within-turn difference, each turn weighted as van Elteren's rank test weighs it. Its interval
inverts that test. As asv does, a point is slower where its change is above the threshold and significant; it
is ok where the interval lies below the threshold; anything else is undecided, with the turns (or rounds) that
would narrow the interval enough to decide.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from statistics import NormalDist

from pytest_benchmark.utils import PercentageRegressionCheck, RegressionCheck

CONFIDENCE = 0.95
MAX_SAMPLES = 100  # the most turns or rounds searched for samples that can bound an interval at all
LOCATIONS = ("min", "max", "mean", "median")  # the fields a shift moves; stddev and iqr are spreads

SLOWER, OK, UNDECIDED = "slower", "ok", "undecided"
NEW, GONE = "new, not gated", "not in the working tree"


@dataclass(frozen=True)
class Verdict:
    name: str  # pytest's node id
    baseline: float | None  # seconds: the check's field of each turn's rounds, median over turns; None if absent
    work: float | None
    changes: tuple[float, ...]  # per turn, the working tree against the baseline: percent, or seconds
    change: float | None  # over all turns: percent, or seconds
    low: float | None  # the change's interval; infinite where the samples are too few to bound it
    high: float | None
    status: str  # SLOWER, OK, UNDECIDED, NEW or GONE
    needed: int | None = None  # for an undecided point: the turns (or rounds) that would decide it, if any would
    reason: str = ""  # for an undecided point: why

    @property
    def fails(self) -> bool:
        return self.status == SLOWER

    @property
    def undecided(self) -> bool:
        return self.status == UNDECIDED


def decide(baseline_turns: list[dict[str, list[float]]], work_turns: list[dict[str, list[float]]],
           check: RegressionCheck, scale_by: str = "turns") -> list[Verdict]:
    """Each point's verdict from its rounds per turn ({node id: seconds of each round}, turn by turn, both
    trees). `scale_by` says what an undecided point is told it needs more of: "turns", or "rounds" where there
    is one turn (a saved baseline)."""
    verdicts = []
    for name in sorted(set().union(*baseline_turns, *work_turns)):
        pairs = [(base[name], work[name]) for base, work in zip(baseline_turns, work_turns)
                 if base.get(name) and work.get(name)]
        if not pairs:
            base = [_field(turn[name], check) for turn in baseline_turns if turn.get(name)]
            work = [_field(turn[name], check) for turn in work_turns if turn.get(name)]
            verdicts.append(Verdict(name, _median(base), _median(work), (), None, None, None, GONE if base else NEW))
            continue
        verdicts.append(_verdict(name, pairs, check, scale_by))
    return verdicts


def can_decide(turns: int, rounds: int) -> bool:
    """Whether `turns` turns of `rounds` rounds a tree can ever give a significant change: the most extreme
    ordering of the rounds (every working-tree round above every baseline round, in every turn) must be
    rarer than 1 - CONFIDENCE under no change."""
    return 2 / math.comb(2 * rounds, rounds) ** turns <= 1 - CONFIDENCE


def _verdict(name: str, pairs: list[tuple[list[float], list[float]]], check: RegressionCheck,
             scale_by: str) -> Verdict:
    percent = isinstance(check, PercentageRegressionCheck)
    to_scale = math.log if percent else (lambda seconds: seconds)
    back = (lambda x: 100 * math.expm1(x)) if percent else (lambda x: x)
    limit = math.log1p(check.threshold / 100) if percent else check.threshold
    strata = [([to_scale(t) for t in base], [to_scale(t) for t in work]) for base, work in pairs]
    change, low, high = shift_interval(strata)
    turn_changes = tuple(back(shift_interval([stratum])[0]) for stratum in strata)
    status, needed, reason = _status(change, low, high, limit, strata, scale_by)
    return Verdict(name, statistics.median(_field(b, check) for b, _ in pairs),
                   statistics.median(_field(w, check) for _, w in pairs), turn_changes, back(change),
                   back(low), back(high), status, needed, reason)


def shift_interval(strata: list[tuple[list[float], list[float]]],
                   confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """The shift of the second sample against the first, with its interval: the stratified Hodges-Lehmann
    estimate (the weighted median of every within-stratum difference) and the shifts that van Elteren's test
    does not reject (its normal approximation; without ties' correction, which timings rarely need)."""
    weighted, total, variance = [], 0.0, 0.0
    for base, work in strata:
        n, m = len(base), len(work)
        weight = 1 / (n + m + 1)  # van Elteren's: each stratum's rank sum on one scale
        weighted += [(w - b, weight) for b in base for w in work]
        total += weight * n * m
        variance += weight ** 2 * n * m * (n + m + 1) / 12
    weighted.sort()
    margin = NormalDist().inv_cdf((1 + confidence) / 2) * math.sqrt(variance)
    return (_weighted_quantile(weighted, total / 2), _weighted_quantile(weighted, total / 2 - margin),
            _weighted_quantile(weighted, total / 2 + margin))


def _weighted_quantile(weighted: list[tuple[float, float]], cumulative: float) -> float:
    """The first difference at which the weights, summed from the smallest, reach `cumulative`; infinite
    beyond either end (too few samples to bound the interval there)."""
    if cumulative <= 0:
        return -math.inf
    seen = 0.0
    for difference, weight in weighted:
        seen += weight
        if seen >= cumulative * (1 - 1e-12):  # sums of equal weights in another order
            return difference
    return math.inf


def _status(change: float, low: float, high: float, limit: float,
            strata: list[tuple[list[float], list[float]]], scale_by: str) -> tuple[str, int | None, str]:
    if change > limit and low > 0:
        return SLOWER, None, ""
    if high <= limit:
        return OK, None, ""
    samples = len(strata) if scale_by == "turns" else min(min(len(b), len(w)) for b, w in strata)
    if not math.isfinite(low - high):
        rounds = min(min(len(b), len(w)) for b, w in strata)
        needed = next((k for k in range(samples + 1, MAX_SAMPLES + 1)
                       if (can_decide(k, rounds) if scale_by == "turns" else can_decide(1, k))), None)
        return UNDECIDED, needed, f"too few {scale_by} to bound the interval"
    # The interval narrows as one over the square root of the samples; it must leave no change below it (for a
    # change above the threshold) or lie below the threshold (for one below).
    half, room = (change - low, change) if change > limit else (high - change, limit - change)
    if room <= 0:
        return UNDECIDED, None, "the change sits at the threshold"
    what = "above the threshold" if change > limit else "at most the threshold"
    return UNDECIDED, math.ceil(samples * (half / room) ** 2), f"the change is {what}, its interval too wide to tell"


def _field(rounds: list[float], check: RegressionCheck) -> float:
    return {"min": min, "max": max, "mean": statistics.fmean, "median": statistics.median}[check.field](rounds)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
