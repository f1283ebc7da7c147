"""`Checkpointing`: which blocks the backward recomputes and what a recomputed block keeps, as options, ids and
tables spell it. systems.model runs a scheme; systems.accounting predicts its memory and FLOPs."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from systems.model import TransformerConfig
from systems.recompute import Saves

_SCHEME = re.compile(r"(?P<base>none|nested|ops|attn|every\d+|\d+(?:x\d+)+)(?:-keep(?P<keep>\d+))?")
# Op-level schemes by spelling: one-block segments keeping what `Saves` names.
_SELECTIVE = {"attn": Saves.ATTENTION, "ops": Saves.MATMULS}


@dataclass(frozen=True)
class Checkpointing:
    """A checkpointing scheme, as options, ids and tables spell it: `none` (every activation kept), `every4`
    (segments of 4 blocks), `6x1` (segments of 6 blocks, each recomputed as segments of 1), `nested` (the
    two-level sizes of least peak memory for the model and batch: systems.accounting.checkpointed resolves it), `attn`
    (one-block segments that keep their attention kernel's outputs), `ops` (one-block segments that keep their
    matmuls' and attention's outputs: only elementwise ops recomputed); any but none with `-keepN`, the top N
    blocks left out (`every1-keep8`). `levels` holds the blocks per segment, outermost first; None for nested."""

    levels: tuple[int, ...] | None
    keep: int = 0
    saves: Saves = Saves.INPUTS

    @classmethod
    def parse(cls, text: Checkpointing | str) -> Checkpointing:
        """A scheme from its spelling (or the scheme itself, as a `Choice` takes its member)."""
        if isinstance(text, Checkpointing):
            return text
        match = _SCHEME.fullmatch(text)
        if match is None or (match["base"] == "none" and match["keep"]):
            raise ValueError(f"unknown checkpointing {text!r}; write none, nested, everyK (segments of K blocks), "
                             f"KxK (segments of K blocks recomputed as segments of k), attn or ops (one-block "
                             f"segments keeping attention's outputs, or those and the matmuls'), any but none "
                             f"followed by -keepN (the top N blocks not checkpointed)")
        base, keep = match["base"], int(match["keep"] or 0)
        if match["keep"] is not None and keep < 1:
            raise ValueError(f"checkpointing {text!r}: -keepN keeps at least one block (no suffix keeps none)")
        if base in ("none", "nested"):
            return cls(() if base == "none" else None, keep)
        if base in _SELECTIVE:
            return cls((1,), keep, _SELECTIVE[base])
        levels = tuple(int(k) for k in base.removeprefix("every").split("x"))
        if any(k < 1 for k in levels) or any(inner >= outer for outer, inner in zip(levels, levels[1:])):
            raise ValueError(f"checkpointing {text!r}: segment sizes must be positive and shrink level by level")
        return cls(levels, keep)

    def configure(self, config: TransformerConfig, levels: tuple[int, ...] | None = None) -> TransformerConfig:
        """`config` checkpointed as this scheme says, which the config checks: its levels, the blocks it leaves
        out and what its segments keep. Nested's levels are `levels`, which the accounting works out for a model
        and batch (systems.accounting.checkpointed); one-block segments stand in until then."""
        if self.levels is not None:
            levels = self.levels
        elif levels is None:
            levels = (1,)
        return dataclasses.replace(config, checkpoint=levels, checkpoint_keep=self.keep, checkpoint_saves=self.saves)

    def __str__(self) -> str:
        keep = f"-keep{self.keep}" if self.keep else ""
        if self.saves != Saves.INPUTS:
            return next(name for name, saves in _SELECTIVE.items() if saves == self.saves) + keep
        if self.levels is None:
            return "nested" + keep
        if not self.levels:
            return "none"
        return (f"every{self.levels[0]}" if len(self.levels) == 1 else "x".join(map(str, self.levels))) + keep
