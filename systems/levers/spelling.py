"""How options spell values: the text parsers every entry point shares (the benchmarks' pytest options, torchrun's
command line, TrainSpec given text). Each returns its value or raises ValueError saying what is wrong;
`as_option_type` turns that into argparse's usage error naming the option."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(kind: type, text: str):
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a valid {kind.__name__}") from None


def positive(kind: type) -> Callable[[str], float]:
    """A parser of positive, finite `kind`s (int or float)."""
    def parse(text: str):
        value = number(kind, text)
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{value!r} is not positive")
        return value
    parse.__name__ = kind.__name__
    parse.__annotations__["return"] = kind
    return parse


def at_least_zero(text: str) -> int:
    value = number(int, text)
    if value < 0:
        raise ValueError(f"{value} is not zero or more")
    return value


def integer(text: str) -> int:
    return number(int, text)


def one_of(names, what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in names:
            raise ValueError(f"unknown {what} {text!r}; choose from {', '.join(names)}")
        return text
    return parse


def name(text: str) -> str:
    """A name (a preset's): whether it exists is checked where its table is known."""
    if not text:
        raise ValueError("empty name")
    return text


def chunk(text: str) -> int | None:
    """Tokens per chunk of the cross-entropy, or the whole logits at once: full (or none)."""
    return None if text in ("full", "none") else positive(int)(text)


def as_option_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """argparse's type: the parser's ValueError becomes argparse's usage error, naming the option."""
    def typed(text: str):
        try:
            return parse(text.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return typed
