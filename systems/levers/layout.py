"""`Layout(replicate, shard, tensor)`: how a world of ranks is split, as torchtitan's ParallelDims splits it
(rank = (r * shard + s) * tensor + t), and its groups along each axis. systems.parallel.mesh makes its process
groups; systems.accounting predicts what each axis sends."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

AXES = ("replicate", "shard", "tensor")  # outermost first


@dataclass(frozen=True)
class Layout:
    replicate: int = 1
    shard: int = 1
    tensor: int = 1

    def __post_init__(self):
        for axis in AXES:
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"Layout's {axis} must be a positive int, got {size!r}")

    @classmethod
    def parse(cls, text: Layout | str) -> Layout:
        """A layout as `--layout` spells it: "RxS" (replicas x shards, "2x2") or "RxSxT" (x tensor, "1x2x2"); a
        Layout is itself."""
        if isinstance(text, Layout):
            return text
        if not isinstance(text, str):
            raise TypeError(f"a layout is a Layout or its text (2x2), got {text!r}")
        parts = text.strip().lower().split("x")
        if len(parts) not in (2, 3) or not all(part.isdigit() for part in parts):
            raise ValueError(f"a layout is replicate x shard (e.g. 2x2) or replicate x shard x tensor (e.g. 1x2x2), "
                             f"got {text!r}")
        return cls(*map(int, parts))

    def __str__(self) -> str:
        """As `parse` reads it: the tensor axis only where it has more than one rank."""
        return f"{self.replicate}x{self.shard}" + (f"x{self.tensor}" if self.tensor > 1 else "")

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard * self.tensor

    def coordinates(self, rank: int) -> dict[str, int]:
        """{axis: index} of `rank`: rank = (replicate * shard + shard index) * tensor + tensor index."""
        rest, t = divmod(rank, self.tensor)
        r, s = divmod(rest, self.shard)
        return {"replicate": r, "shard": s, "tensor": t}

    def rank(self, replicate: int, shard: int, tensor: int) -> int:
        return (replicate * self.shard + shard) * self.tensor + tensor

    def groups(self, axes: tuple[str, ...]) -> list[tuple[int, ...]]:
        """Every group of ranks that differ only along `axes`, each in rank order, ordered by their first rank."""
        sizes = {axis: range(getattr(self, axis)) for axis in AXES}
        fixed = [axis for axis in AXES if axis not in axes]
        groups = []
        for held in itertools.product(*(sizes[axis] for axis in fixed)):
            base = dict(zip(fixed, held))
            ranks = sorted(self.rank(**base, **dict(zip(axes, moving)))
                           for moving in itertools.product(*(sizes[axis] for axis in axes)))
            groups.append(tuple(ranks))
        return sorted(groups)
