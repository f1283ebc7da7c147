"""Test tiers: the default run leaves out the items of every tier and says so, --tiers picks tiers by name (a bad
one is a usage error), under xdist an item of the timing tier runs with no other item beside it, and the covering
arrays that stand for a grid in the default tier meet every pair of values; CI runs every tier once."""

import itertools
import json
import shlex
from pathlib import Path

import pytest

from covering import pairwise
from systems.bench.tiers import DEFAULT, TIERS

ROOT = Path(__file__).resolve().parent.parent

TIERED = """
import pytest

def test_plain():
    pass

@pytest.mark.launch
def test_launched():
    pass

@pytest.mark.slow
def test_long():
    pass

@pytest.mark.timing
def test_timed():
    pass
"""


@pytest.mark.parametrize("tiers, ran", [
    (None, ["test_plain"]),
    ("all", ["test_plain", "test_launched", "test_long", "test_timed"]),
    ("slow,timing", ["test_long", "test_timed"]),
    ("default,launch", ["test_plain", "test_launched"]),
])
def test_the_default_run_leaves_out_every_tier_and_tiers_are_picked_by_name(inner_pytest, tiers, ran):
    inner_pytest.makepyfile(test_tiered=TIERED)
    result = inner_pytest.runpytest_inprocess("-p", "no:cacheprovider", "-v", *(["--tiers", tiers] if tiers else []))
    assert [r.nodeid.split("::")[1] for r in result.reprec.getreports("pytest_runtest_logreport")
            if r.when == "call"] == ran
    left = 4 - len(ran)
    assert result.parseoutcomes().get("deselected", 0) == left
    if left:
        assert "--tiers all runs every tier" in result.stdout.str()


def test_an_unknown_tier_is_a_usage_error(inner_pytest):
    inner_pytest.makepyfile(test_tiered=TIERED)
    result = inner_pytest.runpytest_inprocess("-p", "no:cacheprovider", "--tiers", "default,fast")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert ("--tiers default,fast: choose default, all, or from default, launch, slow, timing, browser"
            in result.stderr.str())


SPANS = """
import json, os, time
from pathlib import Path

import pytest

def span(name):
    start = time.monotonic()
    time.sleep(0.3)
    Path(os.environ["SPANS"], name).write_text(json.dumps([start, time.monotonic()]))

@pytest.mark.timing
def test_timed():
    span("timed")

@pytest.mark.parametrize("i", range(10))
def test_plain(i):
    span(f"plain-{i}")
"""


def test_under_xdist_a_timing_item_runs_alone(inner_pytest, tmp_path, monkeypatch):
    spans = tmp_path / "spans"
    spans.mkdir()
    monkeypatch.setenv("SPANS", str(spans))
    inner_pytest.makepyfile(test_spans=SPANS)
    # The controller in this process, sparing a start of torch: the workers are processes of their own anyway.
    result = inner_pytest.runpytest_inprocess("-p", "no:cacheprovider", "-n", "2", "--tiers", "all")
    result.assert_outcomes(passed=11)
    timed = json.loads((spans / "timed").read_text())
    others = [json.loads(path.read_text()) for path in spans.glob("plain-*")]
    assert len(others) == 10
    assert all(end <= timed[0] or start >= timed[1] for start, end in others)


def test_the_covering_array_meets_every_pair_of_values_and_is_small():
    """The default tier's sibling of a grid: every two values of any two dimensions in one case, checked against
    the grid's pairs counted apart from the generator."""
    dimensions = (("naive", "sdpa", "flash"), ("fp32", "bf16", "bf16-weights"), (1, 3), ("none", "a", "b", "c"))
    cases = pairwise(*dimensions)
    for (i, first), (j, second) in itertools.combinations(enumerate(dimensions), 2):
        for a, b in itertools.product(first, second):
            assert any(case[i] == a and case[j] == b for case in cases), (i, a, j, b)
    assert len(cases) <= 14 < len(list(itertools.product(*dimensions)))


SELECTED_CASES = """
import pytest
from spawned_ranks import selected_values

@pytest.fixture(scope="module")
def ranks(request):
    return selected_values(request, "ranks", "case")

@pytest.mark.parametrize("case", ["a", "b", pytest.param("c", marks=pytest.mark.slow)])
def test_case(ranks, case):
    assert ranks == {"a"}

def test_other(ranks):
    assert ranks == {"a"}
"""


def test_a_spawned_job_runs_the_cases_that_are_selected_only(inner_pytest):
    """results_by_rank(selects=...) hands the job the cases left after -k and the tiers, so neither is paid for."""
    inner_pytest.makepyfile(test_cases=SELECTED_CASES)
    inner_pytest.runpytest_inprocess("-p", "no:cacheprovider", "-k", "not b").assert_outcomes(passed=2, deselected=2)


def test_ci_runs_every_tier_exactly_once():
    """.ci/run's pytest commands over tests/: together every tier, none twice (the default tier is README's)."""
    runs = []
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        words = shlex.split(line) if line.startswith("pytest ") else []
        if "tests/" in words:
            given = words[words.index("--tiers") + 1] if "--tiers" in words else DEFAULT
            runs.append({DEFAULT, *TIERS} if given == "all" else set(given.split(",")))
    assert sorted(tier for run in runs for tier in run) == sorted({DEFAULT, *TIERS})
