"""`parallelize(model, spec, device, layout)`: the model wrapped the way `spec.variant` shares a step between
ranks laid out as `layout` (`spec.layout_for(world_size)`), in torchtitan's order where strategies compose
(`parallelize_llama`): tensor parallelism, then checkpointing and compile, then data parallelism or sharding.

Every wrapper has `module` (the model) and `finish_gradient_synchronization()`, called between backward and the
optimizer step, so the training loop treats them alike: one process alone, our DDP variants
(systems.parallel.ddp), torch's DistributedDataParallel, our FSDP (systems.parallel.fsdp) over the world or over a
Mesh of replicas x shards (HSDP), torch's FSDP2 over the world or over a DeviceMesh (TorchFSDP2), and tensor
parallelism (systems.parallel.tensor), ours and torch's, alone (TensorParallel) or under ours and torch's FSDP
over the layout's data axes. `full_parameters(wrapper)` gathers what any of them trained, whole.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from systems.levers.layout import Layout
from systems.levers.variant import Variant
from systems.model import TransformerLM
from systems.parallel.ddp import make_ddp
from systems.parallel.fsdp import FSDP
from systems.parallel.mesh import Mesh, device_mesh
from systems.parallel.spec import TrainSpec
from systems.parallel.tensor import gather_slices, qkv_in_model_order, tensor_parallel, torch_tensor_parallel

DATA_AXES = ("replicate", "shard")  # the ranks that split the batch and hold the same tensor-parallel slices


def parallelize(model: TransformerLM, spec: TrainSpec, device: torch.device, layout: Layout) -> nn.Module:
    """`model` in the wrapper of `spec.variant`, with the spec's levers, over `layout`'s ranks.

    Tensor parallelism comes first, in place: each rank keeps its slices of every block, over the layout's tensor
    axis. Checkpointing and compile are the model's own config, applied where its blocks run: a recomputed or
    compiled block runs TP's collectives inside it, and the wrapper's hooks around it. The data-parallel or
    sharding wrapper comes last, over the ranks that hold the same slices (replicate x shard)."""
    compute = spec.precision.compute
    match spec.variant:
        case Variant.SINGLE:
            return SingleProcess(model)
        case Variant.TORCH:
            return TorchDDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                            bucket_cap_mb=spec.bucket_size_mb)
        case Variant.FSDP | Variant.HSDP:  # FSDP over the world needs no mesh: no new process groups
            return FSDP(model, compute_dtype=compute, prefetch=spec.fsdp_prefetch, gather=spec.fsdp_gather,
                        mesh=Mesh(layout) if spec.variant == Variant.HSDP else None)
        case Variant.FSDP2 | Variant.TORCH_HSDP:
            return TorchFSDP2(model, compute, device_mesh(layout, DATA_AXES) if spec.variant.meshed else None)
        case Variant.TP:  # over every rank: the world's group, no new one
            return TensorParallel(tensor_parallel(model, dist.group.WORLD), dist.group.WORLD)
        case Variant.TORCH_TP:
            return TensorParallel(torch_tensor_parallel(model, device_mesh(layout, ("tensor",))))
        case Variant.FSDP_TP:
            mesh = Mesh(layout)
            return FSDP(tensor_parallel(model, mesh.tensor.group), compute_dtype=compute, prefetch=spec.fsdp_prefetch,
                        gather=spec.fsdp_gather, mesh=mesh)
        case Variant.TORCH_FSDP_TP:
            mesh = device_mesh(layout)  # one DeviceMesh: FSDP2 shards over a submesh of the one TP splits over
            return TorchFSDP2(torch_tensor_parallel(model, mesh["tensor"]), compute, mesh[DATA_AXES])
        case _:
            return make_ddp(spec.variant, model, spec.bucket_size_mb if spec.variant == Variant.BUCKETED else None)


@torch.no_grad()
def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of the model a wrapper trains, whole, on the CPU, by the model's own names, in its order
    and layout. A collective for the sharded and tensor-parallel wrappers: call it on every rank."""
    if isinstance(model, FSDP):
        params = model.gather_full_params()
        mesh = model.mesh
        tensor = mesh.tensor.group if mesh is not None and mesh.tensor.size > 1 else None
    else:  # torch's FSDP2 and TP's parameters are DTensors; the other wrappers hold whole parameters or our slices
        params = {name: _whole(name, p, model.module.config) for name, p in model.module.named_parameters()}
        tensor = model.group if isinstance(model, TensorParallel) else None
    if tensor is not None:  # our TP's slices, over its group
        params = gather_slices(params, tensor)
    return {name: p.detach().cpu().clone() for name, p in params.items()}


def _whole(name: str, param: torch.Tensor, config) -> torch.Tensor:
    """A parameter whole: a DTensor's full tensor (torch's TP's qkv rows back in the model's order), or itself."""
    if not hasattr(param, "full_tensor"):
        return param
    full, mesh = param.full_tensor(), param.device_mesh
    if name.endswith("attn.qkv.weight") and "tensor" in (mesh.mesh_dim_names or ()):
        full = qkv_in_model_order(full, config, mesh["tensor"].size())
    return full


class SingleProcess(nn.Module):
    """One process training alone, with the interface of the wrappers in systems.parallel.ddp."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Nothing to synchronize."""


class TensorParallel(SingleProcess):
    """Tensor parallelism alone, ours or torch's, already applied to `module`: the ranks compute each step together,
    each on its slices, their collectives inside forward and backward, so nothing is left to synchronize. `group`
    is our TP's, over which `full_parameters` gathers the slices; None for torch's (its DTensors know theirs)."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None):
        super().__init__(module)
        self.group = group


class TorchDDP(DistributedDataParallel):
    """Torch's DistributedDataParallel with the interface of the wrappers in systems.parallel.ddp."""

    def finish_gradient_synchronization(self) -> None:
        """Nothing left to do: torch's reducer waits for its all-reduces at the end of backward."""


class TorchFSDP2(nn.Module):
    """Torch's FSDP2 (`fully_shard`, block by block, then the root) with the interface of our wrappers: over the
    world, or over `mesh`, a DeviceMesh of the data axes (systems.parallel.mesh.device_mesh(layout, DATA_AXES):
    HSDP where both are above 1), which may be a submesh of the one torch's TP split the module over (2D: FSDP2 then
    shards each rank's slices). Weights are cast to `compute_dtype` before the all-gathers and gradients reduced in
    it, as ours does."""

    def __init__(self, module: TransformerLM, compute_dtype: torch.dtype, mesh=None):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # here: a slow import

        super().__init__()
        with torch.no_grad():  # ranks start apart; ours and DDP broadcast rank 0's weights, fully_shard does not
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                _broadcast_over(tensor, mesh)
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=compute_dtype)
        for block in module.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        self.module = fully_shard(module, mesh=mesh, mp_policy=policy)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Nothing left to do: FSDP2 waits for its reduce-scatters at the end of backward."""


def _broadcast_over(tensor: torch.Tensor, mesh) -> None:
    """This rank's part of `tensor` (a DTensor's local slice: torch's TP's ranks hold apart) from the first rank of
    `mesh` (None: the world), in place: along each of its dimensions in turn, from index 0, which together carry the
    first rank's part to every rank."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # under no_grad, the DTensor's own storage
    if mesh is None:
        dist.broadcast(local, src=0)
        return
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        dist.broadcast(local, src=dist.get_global_rank(group, 0), group=group)
