"""One SwiGLU feed-forward layer laid out over ranks, as the 2026 handout's section 8 lays it out (whose costs
systems.accounting.ffn_layouts counts): x (B, D), y = w2(silu(w1 x) * w3 x) with w1, w3 (F, D) and w2 (D, F)
(the handout's W1, W2, W3 are our w1, w3, w2: docs/parallel-layouts.md).

`FFNLayout` names the layouts (single, dp, fsdp, tp, torch-tp, fsdp-tp), `placements` gives a layout's `Placement`s
over the ranks, and `lay_out(placement, batch, d_model, d_ff, dtype, device)` builds this rank's part of the layer
(a `LaidOut`) from one seed and says which rows of the global batch it takes. A step is
`y = laid.module(x[laid.rows]); y.backward(dy[laid.rows]); laid.finish()`. Each layout uses our own pieces where
they exist (DDP, FSDP, Megatron's f and g, the Mesh). docs/design-notes.md has each layout's design.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from systems.choice import Choice
from systems.levers.layout import Layout
from systems.model import SwiGLU
from systems.parallel.ddp import DDPIndividualParameters
from systems.parallel.fsdp import FSDP
from systems.parallel.mesh import Mesh, device_mesh
from systems.parallel.tensor import copy_to_region, reduce_from_region


class FFNLayout(Choice):
    SINGLE = "single"
    DP = "dp"
    FSDP = "fsdp"
    TP = "tp"
    TORCH_TP = "torch-tp"
    FSDP_TP = "fsdp-tp"

    @classmethod
    def noun(cls) -> str:
        return "FFN layout"

    @property
    def splits_batch(self) -> bool:
        return self in (FFNLayout.DP, FFNLayout.FSDP, FFNLayout.FSDP_TP)

    @property
    def splits_d_ff(self) -> bool:
        return self in (FFNLayout.TP, FFNLayout.TORCH_TP, FFNLayout.FSDP_TP)


@dataclass(frozen=True)
class Placement:
    """A layout over `data` x `tensor` ranks: `data` split the batch, `tensor` split d_ff."""

    layout: FFNLayout
    data: int
    tensor: int

    def __post_init__(self):
        object.__setattr__(self, "layout", FFNLayout(self.layout))
        for axis in ("data", "tensor"):
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"Placement's {axis} must be a positive int, got {size!r}")
        wants = (self.layout.splits_batch, self.layout.splits_d_ff)
        if (self.data > 1, self.tensor > 1) != wants:
            raise ValueError(f"{self.layout} splits {'the batch' if wants[0] else 'no rows'} and "
                             f"{'d_ff' if wants[1] else 'no weights'}: got data={self.data}, tensor={self.tensor}")

    @property
    def world_size(self) -> int:
        return self.data * self.tensor

    def check_shape(self, batch: int, d_ff: int) -> None:
        """Every rank takes as many rows and as much of d_ff as every other."""
        if batch % self.data or d_ff % self.tensor:
            raise ValueError(f"{self.layout} over {self.data} x {self.tensor} ranks splits batch={batch} "
                             f"{self.data} ways and d_ff={d_ff} {self.tensor} ways evenly")

    def __str__(self) -> str:
        return f"{self.layout}-{self.data}x{self.tensor}"


def placements(layout: FFNLayout, world_size: int) -> list[Placement]:
    """The placements of `layout` over `world_size` ranks: fsdp-tp's every grid with both axes above one."""
    layout = FFNLayout(layout)
    if layout == FFNLayout.SINGLE:
        return [Placement(layout, 1, 1)] if world_size == 1 else []
    if world_size == 1:
        return []
    if layout == FFNLayout.FSDP_TP:
        return [Placement(layout, data, world_size // data) for data in range(2, world_size // 2 + 1)
                if world_size % data == 0]
    return [Placement(layout, world_size, 1) if layout.splits_batch else Placement(layout, 1, world_size)]


@dataclass
class LaidOut:
    module: nn.Module  # y of this rank's rows: the whole (rows, D) output, summed over the tensor axis
    rows: slice  # this rank's rows of the global batch
    d_ff: int  # this rank's share of d_ff: the width of its local matmuls
    finish: Callable[[], None]  # after backward: the gradients' synchronization


class _Megatron(nn.Module):
    """A column-then-row-parallel region between f and g (systems.parallel.tensor)."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup | None):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_region(self.inner(copy_to_region(x, self.group)), self.group)


def tensor_slice(full: SwiGLU, index: int, size: int) -> SwiGLU:
    """Rank `index` of `size`'s part of the layer: w1's and w3's rows and w2's columns of its d_ff slice."""
    d_ff = full.w1.out_features // size
    part = SwiGLU(full.w1.in_features, d_ff).to(full.w1.weight.device)
    mine = slice(index * d_ff, (index + 1) * d_ff)
    with torch.no_grad():
        part.w1.weight.copy_(full.w1.weight[mine])
        part.w3.weight.copy_(full.w3.weight[mine])
        part.w2.weight.copy_(full.w2.weight[:, mine])
    return part


def full_layer(d_model: int, d_ff: int, device: torch.device, seed: int) -> SwiGLU:
    """The whole layer in fp32, the same on every rank that passes the same seed."""
    generator = torch.Generator().manual_seed(seed)
    layer = SwiGLU(d_model, d_ff)
    with torch.no_grad():
        for linear in (layer.w1, layer.w3, layer.w2):
            std = (2.0 / (linear.in_features + linear.out_features)) ** 0.5  # the model's initialization's scale
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * std)
    return layer.to(device)


def lay_out(placement: Placement, batch: int, d_model: int, d_ff: int, dtype: torch.dtype, device: torch.device,
            seed: int = 0) -> LaidOut:
    """This rank's part of the layer under `placement` (on every rank of a world of its size, in the same order:
    meshes and wrappers create groups and broadcast)."""
    placement.check_shape(batch, d_ff)
    if dist.is_initialized() and dist.get_world_size() != placement.world_size:
        raise ValueError(f"{placement} needs {placement.world_size} ranks, the process group has "
                         f"{dist.get_world_size()}")
    full = full_layer(d_model, d_ff, device, seed)
    master = torch.promote_types(dtype, torch.float32)  # FSDP's shards: fp32, or float64 to compute in float64
    rank = dist.get_rank() if dist.is_initialized() else 0
    rows = batch // placement.data
    match placement.layout:
        case FFNLayout.SINGLE:
            module, finish = full.to(dtype), _nothing
        case FFNLayout.DP:
            module = DDPIndividualParameters(full.to(dtype))
            finish = module.finish_gradient_synchronization
        case FFNLayout.FSDP:
            module = FSDP(full.to(master), compute_dtype=dtype, gather="layer")
            finish = module.finish_gradient_synchronization
        case FFNLayout.TP:
            module, finish = _Megatron(tensor_slice(full, rank, placement.tensor).to(dtype), None), _nothing
        case FFNLayout.TORCH_TP:
            module, finish = _torch_tensor_parallel(full.to(dtype), placement.tensor), _nothing
        case FFNLayout.FSDP_TP:
            mesh = Mesh(Layout(shard=placement.data, tensor=placement.tensor))
            part = tensor_slice(full, mesh.tensor.index, placement.tensor).to(master)
            sharded = FSDP(part, compute_dtype=dtype, gather="layer", mesh=mesh)
            module, finish = _Megatron(sharded, mesh.tensor.group), sharded.finish_gradient_synchronization
    data_index = rank // placement.tensor  # a Mesh's rank is data_index * tensor + tensor_index
    return LaidOut(module, slice(data_index * rows, (data_index + 1) * rows), d_ff // placement.tensor, finish)


def _nothing() -> None:
    """No gradient to synchronize: tensor parallelism's weights are each rank's own."""


def _torch_tensor_parallel(layer: SwiGLU, size: int) -> nn.Module:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)

    mesh = device_mesh(Layout(tensor=size), ("tensor",))
    plan = {"": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            "w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
    layer = parallelize_module(layer, mesh, plan)
    layer.register_forward_hook(_summed)
    return layer


def _summed(module: nn.Module, args, y: torch.Tensor) -> torch.Tensor:
    """y once its all-reduce is done, as for every other layout. RowwiseParallel returns it unwaited (an
    AsyncCollectiveTensor, waited for by the first op that reads it, as the next layer would): a step that ends
    in `y.backward(dy)` reads no value of y, and its timing would leave the forward's all-reduce out."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(y, AsyncCollectiveTensor):
        y.trigger_wait()
    return y
