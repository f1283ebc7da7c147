"""Two runs passing a baton (systems.bench.baton), as the turns of --benchmark-gate-against run: their rounds
alternate and never overlap, neither starts before both are ready, and one goes on alone once the other ends."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from systems.bench import baton
from systems.bench.timing import time_on_device

ROOT = Path(__file__).resolve().parents[1]
RUN = """
import json, os, sys, time
from systems.bench import baton

name, rounds, ready_after = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
time.sleep(ready_after)  # start-up: imports and collection
spans = [["ready", time.monotonic()]]
baton.begin_from_env()
for i in range(rounds):
    baton.pass_on()
    start = time.monotonic()
    time.sleep(0.02)
    spans.append([f"{name}{i}", start, time.monotonic()])
print(json.dumps(spans))
"""


def test_rounds_alternate_after_both_are_ready_and_the_longer_run_ends_alone():
    ends = baton.pair()
    procs = [subprocess.Popen([sys.executable, "-c", RUN, name, str(rounds), str(ready_after)], cwd=ROOT,
                              env={"PYTHONPATH": str(ROOT), baton.ENV: baton.env_value(fds, first)},
                              pass_fds=fds, stdout=subprocess.PIPE, text=True)
             for name, rounds, ready_after, fds, first in (("a", 4, 0.0, ends[0], True), ("b", 2, 0.3, ends[1], False))]
    for fd in ends[0] + ends[1]:  # the runs hold their ends now: each sees the other's end when it exits
        os.close(fd)
    (a_ready, *a), (b_ready, *b) = (json.loads(proc.communicate(timeout=60)[0]) for proc in procs)
    assert all(proc.returncode == 0 for proc in procs)
    rounds = sorted(a + b, key=lambda span: span[1])
    assert [name for name, _, _ in rounds] == ["a0", "b0", "a1", "b1", "a2", "a3"]
    assert all(earlier[2] <= later[1] for earlier, later in zip(rounds, rounds[1:]))  # never at once
    assert rounds[0][1] >= b_ready[1]  # a's first round waited for b to be ready


class Recorder:
    def __init__(self):
        self.events = []

    def pass_on(self):
        self.events.append("pass")


class Benchmark:  # pytest-benchmark's fixture, as far as time_on_device uses it
    stats = None

    def pedantic(self, fn, setup, rounds, warmup_rounds, iterations):
        for _ in range(warmup_rounds + rounds):
            fn(*setup()[0])


def test_each_warm_up_and_timed_round_passes_the_baton_first(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(baton, "_baton", recorder)
    time_on_device(Benchmark(), lambda: recorder.events.append("round"), device=torch.device("cpu"), warmup=2,
                   rounds=3)
    assert recorder.events == ["pass", "round"] * 5


def test_a_run_lets_the_baton_go_when_its_tests_end(inner_pytest, monkeypatch):
    """Before it saves its history and exits: the other run's last rounds need not wait for those."""
    inner_pytest.makeconftest("""
from systems.bench import baton

def pytest_sessionfinish(session):
    print("holding at the end:", baton._baton is not None)
""")
    inner_pytest.makepyfile(test_one="def test_one(): pass")
    ours, theirs = baton.pair()
    for fd in theirs:  # the other run has ended already: this one goes on alone
        os.close(fd)
    monkeypatch.setenv(baton.ENV, baton.env_value(ours, first=False))
    result = inner_pytest.runpytest_inprocess("-p", "no:cacheprovider", "-s")
    assert result.ret == 0 and "holding at the end: False" in result.stdout.str(), result.stdout.str()

