"""The same-job gate's decision for each point: from its paired turns, a change with its interval, and a verdict
that says when the turns cannot tell.

Each turn times the point once in either tree, back to back, so a turn's change (the working tree against the
baseline, as the --benchmark-gate check measures it) carries little of the drift between turns. Over K turns the
changes scatter by the point's run-to-run noise; their mean estimates the change and Student's t gives its 95%
interval, on log ratios for a percentage check (a slowdown compounds) and on seconds for a difference check.
As asv does, a point fails only where its slowdown is both larger than the threshold and significant (the
interval lies above no change). A point whose interval is wider than the threshold on either side cannot be
told from noise at K turns: it is reported as too noisy, with the turns that would narrow the interval to the
threshold, never passed in silence; it does not fail the gate, which fails only for a measured slowdown.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

from pytest_benchmark.utils import PercentageRegressionCheck, RegressionCheck

CONFIDENCE = 0.95
MAX_TURNS = 100  # the most turns a noisy point is said to need; beyond that it is not gateable


@dataclass(frozen=True)
class Verdict:
    name: str  # pytest's node id
    baseline: float | None  # seconds: the check's statistic of the rounds, median over turns; None if absent
    work: float | None
    changes: tuple[float, ...]  # per turn, the working tree against the baseline: percent, or seconds
    change: float | None  # their mean (geometric for percent)
    low: float | None  # the change's interval
    high: float | None
    status: str  # "slower", "ok", "too noisy", "new, not gated", "not in the working tree"
    turns_needed: int | None = None  # for a point too noisy: the turns that would gate it

    @property
    def slower(self) -> bool:
        return self.status == "slower"


def decide(baseline_turns: list[dict[str, float]], work_turns: list[dict[str, float]],
           check: RegressionCheck) -> list[Verdict]:
    """Each point's verdict from its timings per turn ({node id: seconds}, turn by turn, both trees)."""
    verdicts = []
    for name in sorted(set().union(*baseline_turns, *work_turns)):
        pairs = [(base[name], work[name]) for base, work in zip(baseline_turns, work_turns)
                 if name in base and name in work]
        if not pairs:
            base = [turn[name] for turn in baseline_turns if name in turn]
            work = [turn[name] for turn in work_turns if name in turn]
            status = "new, not gated" if not base else "not in the working tree"
            verdicts.append(Verdict(name, _median(base), _median(work), (), None, None, None, status))
            continue
        verdicts.append(_verdict(name, pairs, check))
    return verdicts


def _verdict(name: str, pairs: list[tuple[float, float]], check: RegressionCheck) -> Verdict:
    percent = isinstance(check, PercentageRegressionCheck)
    # The scale the interval is symmetric on: log ratios for a percentage, seconds for a difference.
    xs = [math.log(work / base) if percent else work - base for base, work in pairs]
    limit = math.log1p(check.threshold / 100) if percent else check.threshold
    back = (lambda x: 100 * math.expm1(x)) if percent else (lambda x: x)
    mean = statistics.fmean(xs)
    spread = statistics.stdev(xs) if len(xs) > 1 else math.inf
    half = t_quantile(len(xs) - 1) * spread / math.sqrt(len(xs)) if len(xs) > 1 else math.inf
    if half > limit:
        status, needed = "too noisy", turns_needed(spread, limit)
    else:
        status, needed = ("slower" if mean - half > 0 and mean > limit else "ok"), None
    return Verdict(name, statistics.median(b for b, _ in pairs), statistics.median(w for _, w in pairs),
                   tuple(back(x) for x in xs), back(mean), back(mean - half), back(mean + half), status, needed)


def turns_needed(spread: float, limit: float) -> int | None:
    """The fewest turns whose interval, at this spread, is no wider than the threshold on either side."""
    if not math.isfinite(spread):
        return None  # one turn: no spread to go by
    for turns in range(2, MAX_TURNS + 1):
        if t_quantile(turns - 1) * spread / math.sqrt(turns) <= limit:
            return turns
    return None


@functools.cache
def t_quantile(df: int, confidence: float = CONFIDENCE) -> float:
    """Student's t at the two-sided `confidence`, by bisection on its distribution function."""
    target = (1 + confidence) / 2
    low, high = 0.0, 1000.0
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if _t_cdf(middle, df) < target else (low, middle)
    return (low + high) / 2


def _t_cdf(x: float, df: int) -> float:
    """P(T <= x) for x >= 0: a half plus the density's integral from 0 to x (Simpson's rule; the density is smooth
    there, so 400 panels give far more digits than a verdict needs)."""
    scale = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def density(t: float) -> float:
        return scale * (1 + t * t / df) ** (-(df + 1) / 2)

    panels = 400
    step = x / panels
    total = density(0) + density(x) + sum((4 if i % 2 else 2) * density(i * step) for i in range(1, panels))
    return 0.5 + total * step / 3


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
