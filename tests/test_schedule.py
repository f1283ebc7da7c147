"""Work under `pytest -n`: units (xdist groups, else modules) whole to one worker, longest first by the seconds
earlier runs recorded (this checkout's cache, else the committed file), and the wall time a number of workers would
take."""

import json
import re
import shutil
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from systems.bench import schedule
from systems.bench.schedule import (CACHE_KEY, EVERY_GPU, committed, longest_first, predict, read_groups,
                                     seconds_by_item, unit_of)
from systems.bench.workers import Worker

ROOT = Path(__file__).parents[1]


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


def cache_of(entries: dict | None):
    """A config whose pytest cache holds `entries` as recorded durations; None: run under -p no:cacheprovider."""
    if entries is None:
        return SimpleNamespace()
    return SimpleNamespace(cache=SimpleNamespace(get=lambda key, default: entries if key == CACHE_KEY else default))


def test_the_committed_durations_fill_in_what_the_cache_lacks(tmp_path, monkeypatch):
    monkeypatch.setattr(schedule, "COMMITTED", tmp_path / "durations.json")
    (tmp_path / "durations.json").write_text(json.dumps({"a.py::x": [3.0, "a.py::x"], "b.py::y": [2.0, "g"]}))
    cache = {"a.py::x": [1.0, "a.py::x"], "c.py::z": [4.0, "c.py::z"]}
    assert seconds_by_item(cache_of(cache)) == {"a.py::x": 1.0, "b.py::y": 2.0, "c.py::z": 4.0}  # this host's first
    assert seconds_by_item(cache_of(None)) == {"a.py::x": 3.0, "b.py::y": 2.0}  # the GPU jobs' grids: no cache
    assert seconds_by_item(cache_of({})) == {"a.py::x": 3.0, "b.py::y": 2.0}  # a fresh clone


def test_save_copies_the_cached_seconds_of_the_items_under_the_paths(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(schedule, "COMMITTED", tmp_path / "durations.json")
    old = {"benches/b.py::old": [9.0, "u"], "benches/b.py::p": [9.0, "u"]}
    (tmp_path / "durations.json").write_text(json.dumps(old))
    cache = tmp_path / "cache" / "v" / CACHE_KEY
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"benches/b.py::p": [1.234, "g"], "benches/b.py::q": [2.0, "g"],
                                 "tests/t.py::t": [5.0, "tests/t.py::t"]}))
    assert schedule.main(["--save", "benches/b.py", "--cache", str(tmp_path / "cache")]) == 0
    # The old item kept, the cached ones over what the file held, none from elsewhere; seconds to 10 ms.
    assert committed() == {"benches/b.py::old": [9.0, "u"], "benches/b.py::p": [1.23, "g"],
                           "benches/b.py::q": [2.0, "g"]}
    assert schedule.main(["-n", "2", "--cache", str(tmp_path / "none")]) == 0  # predicted from the committed file
    assert "2 units, 12 s of items: predicted wall time on 2 workers 9 s" in capsys.readouterr().out
    assert schedule.main(["-n", "2", "--cache", str(tmp_path / "none"), "benches/b.py::q", "benches/b.py::o"]) == 0
    assert "2 units, 11 s of items: predicted wall time on 2 workers 9 s" in capsys.readouterr().out  # q, old
    assert schedule.main(["-n", "2", "--cache", str(tmp_path / "none"), "tests/"]) == 2


def job_grid() -> list[str]:
    """The selection and grid of jobs/common.sh's model_grid, as pytest's arguments."""
    text = (ROOT / "jobs" / "common.sh").read_text()
    options = [part for flag in ("--presets", "--contexts", "--precisions")
               for part in (flag, re.search(rf"{flag} (\S+)", text).group(1))]
    return ["-k", re.search(r'-k "([^"]+)"', text).group(1), *options]


def test_the_gpu_jobs_model_grid_spreads_evenly_over_four_workers_by_the_committed_seconds(inner_pytest):
    """The -n 4 grid reads no cache: the committed file holds every point's seconds, and each unit is one model at
    one context, so that the units, longest first, keep four workers busy alike (one unit a model would leave three
    waiting for the largest model, a third of the grid's seconds; one a point would build a model for each)."""
    inner_pytest.mkdir("benches")
    shutil.copy(ROOT / "benches" / "bench_model.py", inner_pytest.path / "benches")
    _, calls = inner_pytest.inline_genitems("benches/bench_model.py", "-o", "python_files=bench_*.py", *job_grid())
    items = calls.getcall("pytest_collection_finish").session.items  # those -k selects
    seconds = committed()
    assert len(items) == 100 and all(item.nodeid in seconds for item in items)
    models = [item.callspec.params["point"] for item in items if "point" in item.callspec.params]
    units = {unit_of(item) for item in items if "point" in item.callspec.params}
    assert len(units) == len({(point.preset, point.context) for point in models})
    work = defaultdict(float)
    for item in items:
        work[unit_of(item)] += seconds[item.nodeid][0]
    # Within 10% of an even share: these units give 1.01 of it; one a model, 1.27 (the largest model alone).
    assert predict(sorted(work.values(), reverse=True), workers=4) <= 1.1 * sum(work.values()) / 4


@pytest.mark.parametrize("gpus", [4, 0])
def test_items_that_hold_every_gpu_are_one_unit(inner_pytest, tmp_path, gpus):
    """What a worker tells the controller on a host of 4 GPUs: the items holding all four are one unit, also one of
    a spawned group of its own; an item holding two, one, or none keeps its unit. Without GPUs, nothing changes."""
    items = inner_pytest.getitems("""
import pytest

@pytest.mark.multigpu(4)
@pytest.mark.parametrize("group", [pytest.param(1, marks=pytest.mark.xdist_group("ranks:nccl-4")), 2])
def test_four(group): pass

@pytest.mark.multigpu(2)
def test_two(): pass

@pytest.mark.gpu
def test_one(): pass

def test_none(): pass
""")
    config = SimpleNamespace(option=SimpleNamespace(basetemp=str(tmp_path / "gw0")), workerinput={"workerid": "gw0"})
    worker = Worker(config, gpus)
    worker.pytest_collection_modifyitems(items)
    groups = {nodeid.split("::")[-1]: group for nodeid, group in read_groups(worker.shared).items()}
    assert groups == ({"test_four[1]": EVERY_GPU, "test_four[2]": EVERY_GPU} if gpus else
                      {"test_four[1]": "ranks:nccl-4"})
    module = items[0].nodeid.split("::")[0]
    assert {item.name: unit_of(item) for item in items if item.name not in groups} == dict.fromkeys(
        ["test_two", "test_one", "test_none"] + ([] if gpus else ["test_four[2]"]), module)


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
        result = inner_pytest.runpytest_inprocess(*args)
        result.assert_outcomes(passed=8)
        recorded.append(json.loads((inner_pytest.path / ".pytest_cache" / "v" / CACHE_KEY).read_text()))
        assert {nodeid: unit for nodeid, (_, unit) in recorded[-1].items()} == UNITS
    assert recorded[0]["test_units.py::test_long"][0] >= 1.5
    assert all(recorded[1][nodeid][0] != recorded[0][nodeid][0] for nodeid in UNITS)  # every item recorded anew
    ran = {path.name: json.loads(path.read_text()) for path in (tmp_path / "xdist").iterdir()}
    assert len({ran[f"many-{i}"][0] for i in range(3)}) == 1  # one worker ran the group
    assert ran["long"][1] - min(start for _, start, _ in ran.values()) == pytest.approx(0, abs=0.3)
    # The summary's line for each worker: its items, their seconds, and its span.
    line = r"^(gw\d): (\d+) items, ([\d.]+) s busy, from ([\d.]+) s to ([\d.]+) s$"
    workers = {worker: (int(items), float(busy), float(begin), float(end))
               for worker, items, busy, begin, end in re.findall(line, str(result.stdout), re.MULTILINE)}
    assert sum(items for items, *_ in workers.values()) == 8
    long = workers[ran["long"][0]]
    # The span holds the items' seconds, less the rounding of three figures printed to 0.1 s.
    assert long[1] >= 1.5 and long[3] - long[2] >= long[1] - 3 * 0.05 - 1e-9
