"""Test tiers: the default run leaves out the items of every tier and says so, --tiers picks tiers by name (a bad
one is a usage error), under xdist an item of the timing tier runs with no other item beside it, and the covering
arrays that stand for a grid in the default tier meet every pair of values."""

import itertools
import json

import pytest

from covering import pairwise

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
    assert "--tiers default,fast: choose default, all, or from default, launch, slow, timing" in result.stderr.str()


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
    result = inner_pytest.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--tiers", "all")
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
