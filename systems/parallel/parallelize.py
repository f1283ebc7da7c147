"""`parallelize(model, spec, device)`: the model wrapped the way `spec.variant` shares a step between ranks.

Every wrapper has `module` (the model) and `finish_gradient_synchronization()`, called between backward and the
optimizer step, so the training loop treats them alike: one process alone, our DDP variants
(systems.parallel.ddp), torch's DistributedDataParallel, our FSDP (systems.parallel.fsdp) and torch's FSDP2.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from systems.model import TransformerLM
from systems.parallel.ddp import make_ddp
from systems.parallel.fsdp import FSDP
from systems.parallel.spec import TrainSpec, Variant


def parallelize(model: TransformerLM, spec: TrainSpec, device: torch.device) -> nn.Module:
    """`model` in the wrapper of `spec.variant`, with the spec's levers."""
    match spec.variant:
        case Variant.SINGLE:
            return SingleProcess(model)
        case Variant.TORCH:
            return TorchDDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                            bucket_cap_mb=spec.bucket_size_mb)
        case Variant.FSDP:
            return FSDP(model, compute_dtype=spec.precision.compute, prefetch=spec.fsdp_prefetch,
                        gather=spec.fsdp_gather)
        case Variant.FSDP2:
            return TorchFSDP2(model, spec.precision.compute)
        case _:
            return make_ddp(spec.variant, model, spec.bucket_size_mb if spec.variant == Variant.BUCKETED else None)


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
    """Torch's FSDP2 (`fully_shard`, block by block, then the root) with the interface of our wrappers,
    casting weights to `compute_dtype` before the all-gathers and reduce-scattering in it, as ours does."""

    def __init__(self, module: TransformerLM, compute_dtype: torch.dtype):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # here: a slow import

        super().__init__()
        with torch.no_grad():  # ranks start apart; ours and DDP broadcast rank 0's weights, fully_shard does not
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=0)
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=compute_dtype)
        for block in module.blocks:
            fully_shard(block, mp_policy=policy)
        self.module = fully_shard(module, mp_policy=policy)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Nothing left to do: FSDP2 waits for its reduce-scatters at the end of backward."""
