"""Two benchmark runs that take turns, round by round: the runs of one turn of `--benchmark-gate-against`.

A machine drifts over seconds (a neighbour's job, clocks, a host's other work): two runs one after the other see
different machines, and a gate cannot tell their difference from a change in the code. Run together and passing a
baton, the two trees' rounds alternate a few milliseconds apart and see the same machine. Only the holder works:
after start-up (imports and collection, untimed) each run waits for the baton before its first test, and passes it
on before each round (time_on_device's setup), so the other run's round comes next. A run that ends closes its
pipe, and the other goes on alone.
"""

from __future__ import annotations

import os

ENV = "SYSTEMS_LAB_BATON"  # "read fd,write fd,first" for a run the gate starts; the run takes it out of its env

_baton: Baton | None = None  # this process's, while its run passes one


class Baton:
    """One run's end: it reads the baton from `read_fd` and passes it through `write_fd`."""

    def __init__(self, read_fd: int, write_fd: int, first: bool):
        self.read_fd, self.write_fd = read_fd, write_fd
        self.first, self.alone = first, False

    def start(self) -> None:
        """Before the run's first test: both runs ready, then the first one holds the baton."""
        self._send(b"r")
        self.alone = self._receive() is None
        if not self.first:
            self._take()

    def pass_on(self) -> None:
        """Before a round: the other run's round, then this one's."""
        if self.alone:
            return
        self._send(b"b")
        self._take()

    def _take(self) -> None:
        self.alone = self.alone or self._receive() is None

    def _send(self, byte: bytes) -> None:
        try:
            os.write(self.write_fd, byte)
        except BrokenPipeError:  # the other run has ended
            self.alone = True

    def _receive(self) -> bytes | None:
        return os.read(self.read_fd, 1) or None  # b"" at the end: the other run has ended

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            os.close(fd)


def pair() -> tuple[tuple[int, int], tuple[int, int]]:
    """Two pipes' ends as (read, write) for each of two runs."""
    a_to_b, b_to_a = os.pipe(), os.pipe()
    return (b_to_a[0], a_to_b[1]), (a_to_b[0], b_to_a[1])


def env_value(fds: tuple[int, int], first: bool) -> str:
    return f"{fds[0]},{fds[1]},{int(first)}"


def begin(baton: Baton) -> None:
    global _baton
    _baton = baton
    baton.start()


def begin_from_env() -> None:
    """In a run the gate started with a baton: take it out of the environment (the run's own children are not
    runs), and wait for it before the first test."""
    value = os.environ.pop(ENV, None)
    if value is not None:
        read_fd, write_fd, first = map(int, value.split(","))
        begin(Baton(read_fd, write_fd, bool(first)))


def pass_on() -> None:
    """Before each timed or warm-up round: the other run's round first, where a run passes a baton."""
    if _baton is not None:
        _baton.pass_on()


def end() -> None:
    """The in-process run's end: the other run goes on alone."""
    global _baton
    if _baton is not None:
        _baton.close()
        _baton = None
