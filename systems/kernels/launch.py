"""What every kernel of systems.kernels shares: where its tensors may live, a launch torch.compile sees as a custom
op, and the size of the work one program does.

Eager calls launch the kernels directly: a custom op's dispatch costs tens of microseconds a call, as it does for
FlashAttentionTriton. Under torch.compile, and under a dispatch mode (selective activation checkpointing saves
or recomputes what it sees as one op), the launch is a custom op, opaque to Dynamo: host-side decisions (block
sizes, grids) never meet symbolic sizes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from systems.attention.triton_launch import interpreted, through_dispatcher

__all__ = ["check_device", "interpreted", "kernel_op", "on_gpu"]


def on_gpu() -> bool:
    """Block sizes for a GPU, or the interpreter's small ones (several blocks and a partial last one in tests)."""
    return not interpreted()


def check_device(what: str, *tensors: torch.Tensor) -> None:
    """Raise unless the tensors are CUDA tensors, or CPU tensors under Triton's interpreter, all on one device."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{what} needs its tensors on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not interpreted():
        raise ValueError(f"{what} needs CUDA tensors, got {device}; on a CPU, TRITON_INTERPRET=1 must be set before "
                         "systems.kernels is imported (Triton reads it when it defines the kernels)")


def kernel_op(name: str, fake: Callable, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Decorator: `launch` called directly in eager code, as the custom op `systems::name` (with `fake` for its
    outputs' shapes; `mutates_args`, the arguments it writes in place) under torch.compile or a dispatch mode."""
    def wrap(launch: Callable) -> Callable:
        op = torch.library.custom_op(f"systems::{name}", launch, mutates_args=mutates_args)
        op.register_fake(fake)

        def call(*args):
            if through_dispatcher():
                return op(*args)
            return launch(*args)

        call.__name__, call.__doc__ = launch.__name__, launch.__doc__
        return call

    return wrap
