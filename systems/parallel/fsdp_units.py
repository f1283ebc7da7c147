"""What our FSDP (systems.parallel.fsdp) shards and gathers together: the compute dtype (its other levers are
systems.levers.sharding's), the policy picking the sharded modules, a sharded weight (`Unit`)
and the weights one collective moves (`Group`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from systems.levers.sharding import Gather

SHARDED_CLASS_NAMES = ("Linear", "Embedding")


def check_compute_dtype(compute_dtype: torch.dtype | None) -> torch.dtype | None:
    """What sharded modules compute in: None (their weights' dtype) or a floating-point torch.dtype. Checked
    here: a name ("bf16") or an integer dtype would fail only inside the first forward or backward."""
    if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise TypeError(f"compute_dtype must be None or a floating-point torch.dtype such as torch.bfloat16, "
                        f"got {compute_dtype!r}")
    return compute_dtype


def linear_or_embedding(module: nn.Module) -> bool:
    """The default shard policy: a class named Linear or Embedding (or derived from one) with a `weight` parameter."""
    return (any(cls.__name__ in SHARDED_CLASS_NAMES for cls in type(module).__mro__)
            and isinstance(module._parameters.get("weight"), nn.Parameter))


class Unit:
    """One sharded weight: this rank's flat shard, and while gathered the full (shards * chunk,) buffer."""

    def __init__(self, name: str, weight: nn.Parameter, compute_dtype: torch.dtype | None, rank: int, shards: int):
        self.name, self.shape, self.numel = name, weight.shape, weight.numel()
        self.chunk = math.ceil(self.numel / shards)
        start = min(rank * self.chunk, self.numel)
        stop = min(start + self.chunk, self.numel)
        self.shard = nn.Parameter(weight.detach().reshape(-1)[start:stop].clone(), requires_grad=weight.requires_grad)
        self.dtype = compute_dtype or weight.dtype
        self.modules: list[nn.Module] = []
        self.group: Group | None = None
        self.flat: torch.Tensor | None = None
        self.gathering = None  # the Pending all-gather into `flat` (and its group's others gathered with it)
        self.saved = 0  # views of the gathered weight autograd keeps and backward has not yet asked for
        self.uses = 0  # forward uses whose gradient has not yet arrived
        self.grad: torch.Tensor | None = None  # full-weight gradient, summed over the uses so far

    def padded(self, values: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
        """Flat `values` in `dtype`, zero-padded to `size`: no copy where they already are that."""
        if values.numel() == size:
            return values.to(dtype)
        padded = values.new_zeros(size, dtype=dtype)
        padded[:values.numel()] = values
        return padded

    def add_to_grad(self, chunk: torch.Tensor) -> None:
        grad = chunk[:self.shard.numel()].to(self.shard.dtype)
        self.shard.grad = grad if self.shard.grad is None else self.shard.grad + grad


class Group:
    """Sharded weights gathered by one collective and reduce-scattered by one: a layer's, or every layer's in
    a block."""

    def __init__(self, name: str):
        self.name, self.units = name, []
        self.use = -1  # index of its latest use in the forward
        self.waiting = 0  # its weights whose gradient is still being summed

    def add(self, unit: Unit) -> None:
        unit.group = self
        self.units.append(unit)


def group_units(module: nn.Module, units: list[Unit], gather: Gather | Callable[[nn.Module], bool]) -> list[Group]:
    """The units of the layers inside each picked module (every element of an nn.ModuleList for "block", or
    what a policy picks; the outermost, where picks nest) as one group named as that module; every other
    unit, and one that layers of two picked modules share (tied weights), is a group of its own."""
    if gather == Gather.LAYER:
        picked = []
    elif gather == Gather.BLOCK:
        picked = [(f"{name}.{index}", block) for name, blocks in module.named_modules()
                  if isinstance(blocks, nn.ModuleList) for index, block in blocks.named_children()]
    else:
        picked = [(name, m) for name, m in module.named_modules() if gather(m)]
    owner: dict[nn.Module, str] = {}
    for name, picked_module in picked:
        for layer in picked_module.modules():
            owner.setdefault(layer, name)
    groups: dict[str, Group] = {}
    for unit in units:
        owners = {owner.get(layer) for layer in unit.modules}
        name = owners.pop() if len(owners) == 1 and None not in owners else unit.name
        if name not in groups:
            groups[name] = Group(name)
        groups[name].add(unit)
    return list(groups.values())
