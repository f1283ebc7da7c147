"""The benchmark process's timing set-up: freed host memory stays in the process between rounds."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

# Allocates and frees a 64 MiB tensor four times, and prints the page faults of the last two (the heap's layout
# settles in two): with glibc's defaults each allocation is a fresh mmap that faults all its 16,384 pages in.
ROUNDS = """
import resource, torch
from systems.bench import timing
{keep}
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(2**24).sum()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(max(faults[2:]), timing.device_info()["host_malloc"])
"""
PAGES = 2**26 // 4096
TIME_ONE_ROUND = """
class Benchmark:  # pytest-benchmark's fixture, as far as time_on_device uses it
    stats = None
    def pedantic(self, fn, setup, rounds, warmup_rounds, iterations):
        fn(*setup()[0])
timing.time_on_device(Benchmark(), lambda: None, device=torch.device("cpu"), warmup=0, rounds=1)
"""


def rounds_faults(*keeps: str) -> list[tuple[int, str]]:
    """ROUNDS with each of `keeps`, each in a process of its own (the allocator's settings last as long as the
    process), side by side: a count of page faults is each process's own, whatever runs beside it."""
    procs = [subprocess.Popen([sys.executable, "-c", ROUNDS.format(keep=keep)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for keep in keeps]
    outputs = [proc.communicate() for proc in procs]
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err
    return [(int(out.split()[0]), out.split(maxsplit=1)[1].strip()) for out, _ in outputs]


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") != "libc.so.6",
                    reason="glibc's allocator only")
def test_timed_rounds_do_not_fault_their_memory_in_again():
    (faults, settings), (kept_faults, kept_settings) = rounds_faults("", TIME_ONE_ROUND)
    assert faults > PAGES // 2 and settings == "None"  # what the setting is for: glibc's defaults fault
    assert kept_faults < PAGES // 20
    assert kept_settings == str({"mmap_threshold": 2**30, "trim_threshold": 2**31 - 1})
