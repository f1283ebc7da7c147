"""Work under `pytest -n`: units (xdist groups, else modules) whole to one worker, longest first by the seconds
earlier runs recorded, and the wall time a number of workers would take."""

import json
from types import SimpleNamespace

import pytest

from systems.bench.schedule import CACHE_KEY, longest_first, predict


def item(nodeid: str, group: str | None = None, slow: bool = False):
    marks = {"xdist_group": SimpleNamespace(args=(group,), kwargs={}) if group else None,
             "slow": SimpleNamespace() if slow else None}
    return SimpleNamespace(nodeid=nodeid, get_closest_marker=marks.get)


def test_units_come_whole_and_longest_first():
    items = [item("a.py::x"), item("b.py::p[1]", "pool"), item("a.py::y"), item("c.py::z"),
             item("b.py::p[2]", "pool"), item("d.py::s", slow=True)]
    seconds = {"a.py::x": 1.0, "a.py::y": 1.5, "b.py::p[1]": 1.0, "b.py::p[2]": 2.0, "c.py::z": 0.5}
    order = [i.nodeid for i in longest_first(items, seconds)]
    # pool 3 s, a.py 2.5 s, c.py 0.5 s; d.py never recorded: after every recorded unit
    assert order == ["b.py::p[1]", "b.py::p[2]", "a.py::x", "a.py::y", "c.py::z", "d.py::s"]
    # Nothing recorded (a fresh clone): units holding a slow test first, the others in their order.
    assert [i.nodeid for i in longest_first(items, {})] == [
        "d.py::s", "a.py::x", "a.py::y", "b.py::p[1]", "b.py::p[2]", "c.py::z"]


def test_predicted_wall_time_gives_each_unit_to_the_first_free_worker():
    assert predict([5, 4, 3, 3, 3], workers=2) == 10  # 5+3 | 4+3+3, as the rule assigns them (the best is 9)
    assert predict([5, 4, 3, 3, 3], workers=8) == 5
    assert predict([2] * 8, workers=4) == 4


PROJECT = """
import json, os, time
from pathlib import Path

import pytest

def run(name, seconds):
    start = time.monotonic()
    time.sleep(seconds)
    record = [os.environ.get("PYTEST_XDIST_WORKER"), start, time.monotonic()]
    Path(os.environ["SPANS"], name).write_text(json.dumps(record))

@pytest.mark.parametrize("i", range(3))
@pytest.mark.xdist_group("many")
def test_many(i):
    run(f"many-{i}", 0.3)

@pytest.mark.parametrize("i", range(4))
def test_single(i):
    run(f"single-{i}", 0.15)

@pytest.mark.xdist_group("long")
def test_long():
    run("long", 1.5)
"""
# Each item's unit as a run records it: its xdist group, else the item itself. By their seconds the long test comes
# first (1.5 s), then the group of three (0.9 s), then the single tests (0.6 s as their module): handed out item by
# item, the group would be split between the two workers.
UNITS = {**{f"test_units.py::test_many[{i}]": "many" for i in range(3)},
         **{f"test_units.py::test_single[{i}]": f"test_units.py::test_single[{i}]" for i in range(4)},
         "test_units.py::test_long": "long"}


def test_under_xdist_a_group_shares_a_worker_and_the_longest_unit_starts_first(inner_pytest, tmp_path, monkeypatch):
    """A run records each item's seconds and unit; the run under xdist after it starts the long test first, by
    those seconds: not by the number of tests (xdist's own order for groups, which starts the group of three), nor
    in the file's order. The first run is serial, sparing two workers' starts of torch: it records the units of its
    own items, the xdist run's controller those of its workers' groups."""
    inner_pytest.makepyfile(test_units=PROJECT)
    recorded = []
    for run, args in ("serial", []), ("xdist", ["-n", "2"]):
        spans = tmp_path / run
        spans.mkdir()
        monkeypatch.setenv("SPANS", str(spans))
        # The controller in this process, sparing a start of torch: the workers are processes of their own anyway.
        inner_pytest.runpytest_inprocess(*args).assert_outcomes(passed=8)
        recorded.append(json.loads((inner_pytest.path / ".pytest_cache" / "v" / CACHE_KEY).read_text()))
        assert {nodeid: unit for nodeid, (_, unit) in recorded[-1].items()} == UNITS
    assert recorded[0]["test_units.py::test_long"][0] >= 1.5
    assert all(recorded[1][nodeid][0] != recorded[0][nodeid][0] for nodeid in UNITS)  # every item recorded anew
    ran = {path.name: json.loads(path.read_text()) for path in (tmp_path / "xdist").iterdir()}
    assert len({ran[f"many-{i}"][0] for i in range(3)}) == 1  # one worker ran the group
    assert ran["long"][1] - min(start for _, start, _ in ran.values()) == pytest.approx(0, abs=0.3)
