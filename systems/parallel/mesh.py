"""The process groups of a 3D layout of ranks (systems.levers.layout), along each axis.

`Layout(replicate, shard, tensor)` splits world = replicate x shard x tensor ranks as torchtitan's ParallelDims
does, rank = (r * shard + s) * tensor + t: tensor-parallel ranks adjacent, replicas farthest apart.
`Mesh(layout)` creates the process groups on every rank in the same order and holds this rank's `Axis` on each:
`replicate`, `shard`, `tensor`, and `data` (replicate x shard). `device_mesh(layout)` is torch's DeviceMesh of the
same layout, for FSDP2 (systems.parallel.parallelize.TorchFSDP2) and torch's TP.
docs/design-notes.md has why the axes are ordered so, and the layouts for FSDP, HSDP, DDP and 2D.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from systems.levers.layout import AXES, Layout


@dataclass(frozen=True)
class Axis:
    """This rank's process group along one axis (or, for `data`, two): its members' global ranks, in the group's
    rank order, and this rank's index among them."""

    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def source(self) -> int:
        """The global rank of the group's first member: what broadcasts start from."""
        return self.ranks[0]


class Mesh:
    """This rank's process groups under `layout`, created collectively: build it on every rank, in the same order
    as any other group."""

    def __init__(self, layout: Layout):
        if not isinstance(layout, Layout):
            raise TypeError(f"Mesh takes a Layout, got {layout!r}")
        if not dist.is_initialized():
            raise RuntimeError("Mesh needs an initialized process group (systems.parallel.ranks.launch, torchrun)")
        if layout.world_size != dist.get_world_size():
            raise ValueError(f"layout {layout} has {layout.world_size} ranks, the process group "
                             f"{dist.get_world_size()}")
        self.layout = layout
        self.rank = dist.get_rank()
        self.coordinates = layout.coordinates(self.rank)
        self.replicate = self._axis(("replicate",))
        self.shard = self._axis(("shard",))
        self.tensor = self._axis(("tensor",))
        self.data = self._axis(("replicate", "shard"))

    def _axis(self, axes: tuple[str, ...]) -> Axis:
        mine = None
        for ranks in self.layout.groups(axes):  # every rank creates every group, in the same order
            group = dist.group.WORLD if len(ranks) == self.layout.world_size else dist.new_group(list(ranks))
            if self.rank in ranks:
                mine = Axis(group, ranks, ranks.index(self.rank))
        return mine

    def __repr__(self) -> str:
        return f"Mesh({self.layout}, rank {self.rank} at {self.coordinates})"


def device_mesh(layout: Layout, axes: tuple[str, ...] = AXES):
    """Torch's DeviceMesh over the same ranks, with the dimensions `axes` (outermost first; the others must be of
    size 1), named as ours, on this rank's device type."""
    from torch.distributed.device_mesh import init_device_mesh  # here: a slow import

    if any(getattr(layout, axis) > 1 for axis in AXES if axis not in axes):
        raise ValueError(f"{layout} has ranks along an axis outside {axes}")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, tuple(getattr(layout, axis) for axis in axes), mesh_dim_names=axes)
