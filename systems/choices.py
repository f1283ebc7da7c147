"""Levers whose values are names: a StrEnum per lever, so that a name is checked once where it arrives and the
value records as its text; an unknown name is a ValueError listing the known ones."""

from __future__ import annotations

import enum


class Choice(enum.StrEnum):
    """`class Attention(Choice, lever="attention backend")`: the lever's name goes into its errors."""

    def __init_subclass__(cls, lever: str, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._lever = lever

    @classmethod
    def _missing_(cls, value):
        raise ValueError(f"unknown {cls._lever} {value!r}; choose from {', '.join(cls)}")
