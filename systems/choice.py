"""`Choice`: the base of every lever that is one of a few names (an attention backend, a variant, a gather):
`Kind("name")` is its one parser, and any other name a clear error listing the choices. `on_off` parses a
switch."""

from __future__ import annotations

import enum


class Choice(enum.StrEnum):
    """A name among a few; it compares, hashes and serializes as its text."""

    @classmethod
    def noun(cls) -> str:
        """What the choice is called in errors."""
        return cls.__name__.lower()

    @classmethod
    def _missing_(cls, value):
        raise ValueError(f"unknown {cls.noun()} {value!r}; choose from {', '.join(cls)}")


def on_off(text: str) -> bool:
    """A switch as options spell it: off or on."""
    switches = {"off": False, "on": True}
    if text not in switches:
        raise ValueError(f"unknown switch {text!r}; choose from off, on")
    return switches[text]
