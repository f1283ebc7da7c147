"""Data-parallel wrappers: four ways to average gradients across ranks, from naive to overlapped.

`NaiveDDP` (a blocking all-reduce per parameter after backward), `FlatDDP` (one all-reduce of every gradient in a
flat buffer), `DDPIndividualParameters` (an async all-reduce per parameter as backward makes its gradient) and
`DDPBucketed` (the same per bucket of about `bucket_size_mb`); `make_ddp(variant, module, bucket_size_mb)` builds
one by name (`VARIANTS`). Each broadcasts rank 0's parameters and buffers at construction. A step is
`loss = f(ddp(x)); loss.backward(); ddp.finish_gradient_synchronization(); optimizer.step()`, after which every
rank holds the gradient of the mean loss over all ranks' batches. docs/design-notes.md has the design: unused
parameters, the order of collectives, and the gradients' dtype and rounding.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from systems.device import host_to_device
from systems.levers.buckets import check_bucket_size, fill_buckets


class _InPlace:
    """One parameter's gradient, all-reduced in place."""

    def __init__(self, param: nn.Parameter):
        self.params = [param]

    def all_reduce(self, world_size: int) -> dist.Work:
        param = self.params[0]
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        param.grad.div_(world_size)
        return dist.all_reduce(param.grad, async_op=True)

    def unpack(self) -> None:
        """The gradient was reduced where it lives."""


class _Bucket:
    """Gradients of several parameters packed into one flat buffer and all-reduced as one tensor."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        # Each view starts on a 16-byte boundary: the gradients live on in these views, and
        # vectorized kernels (the fused AdamW) need aligned tensors. The padding stays zero.
        align = max(1, 16 // params[0].element_size())
        offsets = [0]
        for param in params:
            offsets.append(offsets[-1] + param.numel() + -param.numel() % align)
        # The gradients' dtype: a gradient has its parameter's, and a bucket holds one (fill_buckets).
        self.buffer = torch.zeros(offsets[-1], dtype=params[0].dtype, device=params[0].device)
        self.views = [self.buffer[start:start + p.numel()].view_as(p) for start, p in zip(offsets, params)]

    def all_reduce(self, world_size: int) -> dist.Work:
        for param, view in zip(self.params, self.views):
            if param.grad is None:
                view.zero_()
            else:
                torch.div(param.grad, world_size, out=view)  # averaging costs nothing extra in the copy
        return dist.all_reduce(self.buffer, async_op=True)

    def unpack(self) -> None:
        # The reduced gradients stay in the bucket: no copy back, and the freshly computed
        # gradients are freed.
        for param, view in zip(self.params, self.views):
            param.grad = view


class _DataParallel(nn.Module):
    """What every variant shares: the rank-0 broadcast, the forward, and finishing a step.

    `make_units` groups the trainable parameters (last layer first) into the units that are all-reduced
    together: one per parameter, or buckets.
    """

    def __init__(self, module: nn.Module, make_units: Callable[[list[nn.Parameter]], list]):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        with torch.no_grad():
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=0)
        # parameters() yields a tied parameter once, so its summed gradient is reduced once.
        # Reversed: backward produces gradients roughly from the last layer to the first.
        self.trainable = [p for p in module.parameters() if p.requires_grad][::-1]
        if not self.trainable:
            raise ValueError("the module has no parameter that requires a gradient")
        self.units = make_units(self.trainable)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _had_gradient(self) -> list[bool]:
        return [p.grad is not None for p in self.trainable]

    def _complete(self, works: list[dist.Work], had_gradient: list[bool]) -> None:
        """Wait for the units' all-reduces, then put back `None` where no rank had a gradient."""
        # After every unit's all-reduce on every rank, so the sequence of collectives matches.
        used = host_to_device(had_gradient, torch.int32, self.trainable[0].device)
        works.append(dist.all_reduce(used, async_op=True))
        for work in works:
            work.wait()
        for unit in self.units:
            unit.unpack()
        if all(had_gradient):
            return  # nothing to reset here; skip the host sync that reading `used` costs
        for param, count in zip(self.trainable, used.tolist()):
            if count == 0:
                param.grad = None


def _per_parameter(trainable: list[nn.Parameter]) -> list:
    return [_InPlace(p) for p in trainable]


def _buckets_of(bucket_size_mb: float | None) -> Callable[[list[nn.Parameter]], list]:
    return lambda trainable: [_Bucket(params) for params in fill_buckets(trainable, bucket_size_mb)]


class NaiveDDP(_DataParallel):
    """All-reduce each parameter's gradient, one blocking call after another, after backward."""

    def __init__(self, module: nn.Module):
        super().__init__(module, _per_parameter)

    def finish_gradient_synchronization(self) -> None:
        had_gradient = self._had_gradient()
        for unit in self.units:
            unit.all_reduce(self.world_size).wait()
        self._complete([], had_gradient)


class FlatDDP(_DataParallel):
    """All-reduce every gradient at once, packed into one flat buffer (one per dtype), after backward."""

    def __init__(self, module: nn.Module):
        super().__init__(module, _buckets_of(None))

    def finish_gradient_synchronization(self) -> None:
        had_gradient = self._had_gradient()
        self._complete([unit.all_reduce(self.world_size) for unit in self.units], had_gradient)


class _OverlappedDDP(_DataParallel):
    """All-reduces launched from post-accumulate-grad hooks while backward is still running."""

    def __init__(self, module: nn.Module, make_units: Callable[[list[nn.Parameter]], list]):
        super().__init__(module, make_units)
        self._unit_of = {param: index for index, unit in enumerate(self.units) for param in unit.params}
        self._reset()
        # Autograd keeps hooks where Python's garbage collector cannot see them: a hook holding this
        # wrapper would keep it, the module and all its memory alive forever. Hooks hold a weak
        # reference instead, and go away with the wrapper.
        this = weakref.ref(self)
        handles = [param.register_post_accumulate_grad_hook(lambda param: this()._on_gradient(param))
                   for param in self.trainable]
        weakref.finalize(self, _remove_hooks, handles)

    def _reset(self) -> None:
        self._waiting = [len(unit.params) for unit in self.units]  # gradients each unit still needs
        self._works = []  # one per launched unit; units launch in order

    def _on_gradient(self, param: nn.Parameter) -> None:
        index = self._unit_of[param]
        if self._waiting[index] == 0:
            raise RuntimeError("a parameter got a second gradient before finish_gradient_synchronization; "
                               "call it after every backward")
        self._waiting[index] -= 1
        while len(self._works) < len(self.units) and self._waiting[len(self._works)] == 0:
            self._works.append(self.units[len(self._works)].all_reduce(self.world_size))

    def finish_gradient_synchronization(self) -> None:
        had_gradient = self._had_gradient()
        works = self._works + [unit.all_reduce(self.world_size) for unit in self.units[len(self._works):]]
        self._complete(works, had_gradient)
        self._reset()


class DDPIndividualParameters(_OverlappedDDP):
    """An async all-reduce per parameter, launched as soon as backward has produced its gradient."""

    def __init__(self, module: nn.Module):
        super().__init__(module, _per_parameter)


class DDPBucketed(_OverlappedDDP):
    """Gradients packed into buckets of about `bucket_size_mb` (None: one bucket), each all-reduced
    as soon as backward has produced all of its gradients."""

    def __init__(self, module: nn.Module, bucket_size_mb: float | None):
        check_bucket_size(bucket_size_mb)  # before any collective: bad input fails on every rank alike
        super().__init__(module, _buckets_of(bucket_size_mb))
        self.bucket_size_mb = bucket_size_mb


# The variants by name, as benchmarks, the training loop and tests choose them.
VARIANTS = {"naive": NaiveDDP, "flat": FlatDDP, "individual": DDPIndividualParameters, "bucketed": DDPBucketed}


def make_ddp(variant: str, module: nn.Module, bucket_size_mb: float | None = None) -> nn.Module:
    """The data-parallel wrapper `variant` names around `module`; `bucket_size_mb` is for "bucketed" only."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown DDP variant {variant!r}; choose from {list(VARIANTS)}")
    if variant == "bucketed":
        return DDPBucketed(module, bucket_size_mb)
    if bucket_size_mb is not None:
        raise ValueError(f"bucket_size_mb is for the bucketed variant, not {variant!r}")
    return VARIANTS[variant](module)


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()
