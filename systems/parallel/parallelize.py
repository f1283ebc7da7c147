"""`parallelize(model, spec, device, layout)`: the model wrapped the way `spec.variant` shares a step between
ranks laid out as `layout` (`spec.layout_for(world_size)`).

Every wrapper has `module` (the model) and `finish_gradient_synchronization()`, called between backward and the
optimizer step, so the training loop treats them alike: one process alone, our DDP variants
(systems.parallel.ddp), torch's DistributedDataParallel, our FSDP (systems.parallel.fsdp) over the world or over a
Mesh of replicas x shards (HSDP), and torch's FSDP2 over the world or over a 2D DeviceMesh (TorchFSDP2).
`full_parameters(wrapper)` gathers what any of them trained, whole.
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


def parallelize(model: TransformerLM, spec: TrainSpec, device: torch.device, layout: Layout) -> nn.Module:
    """`model` in the wrapper of `spec.variant`, with the spec's levers, over `layout`'s ranks."""
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
            return TorchFSDP2(model, compute, layout if spec.variant == Variant.TORCH_HSDP else None)
        case _:
            return make_ddp(spec.variant, model, spec.bucket_size_mb if spec.variant == Variant.BUCKETED else None)


@torch.no_grad()
def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of the model a wrapper trains, whole, on the CPU, by the model's own names. A collective
    for the sharded wrappers: call it on every rank."""
    if isinstance(model, FSDP):
        params = model.gather_full_params()
    else:  # FSDP2's parameters are DTensors; the other wrappers hold whole parameters
        params = {name: p.full_tensor() if hasattr(p, "full_tensor") else p
                  for name, p in model.module.named_parameters()}
    return {name: p.detach().cpu().clone() for name, p in params.items()}


class SingleProcess(nn.Module):
    """One process training alone, with the interface of the wrappers in systems.parallel.ddp."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Nothing to synchronize."""


class TorchDDP(DistributedDataParallel):
    """Torch's DistributedDataParallel with the interface of the wrappers in systems.parallel.ddp."""

    def finish_gradient_synchronization(self) -> None:
        """Nothing left to do: torch's reducer waits for its all-reduces at the end of backward."""


class TorchFSDP2(nn.Module):
    """Torch's FSDP2 (`fully_shard`, block by block, then the root) with the interface of our wrappers: over the
    world, or over a 2D DeviceMesh of `layout`'s replicas x shards (HSDP where both are above 1). Weights are cast
    to `compute_dtype` before the all-gathers and gradients reduced in it, as ours does."""

    def __init__(self, module: TransformerLM, compute_dtype: torch.dtype, layout: Layout | None = None):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # here: a slow import

        if layout is not None and layout.tensor != 1:
            raise ValueError(f"torch's FSDP2 here shards and replicates only; got {layout}")
        super().__init__()
        with torch.no_grad():  # ranks start apart; ours and DDP broadcast rank 0's weights, fully_shard does not
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=0)
        mesh = None if layout is None else device_mesh(layout, ("replicate", "shard"))
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=compute_dtype)
        for block in module.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        self.module = fully_shard(module, mesh=mesh, mp_policy=policy)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Nothing left to do: FSDP2 waits for its reduce-scatters at the end of backward."""
