"""The collectives a piece of code issues, counted where every one of them passes: torch's dispatcher.

`with IssuedCollectives() as issued: step()` sees every collective the step issues, eager (`dist.all_reduce`,
our systems.parallel.collectives, DDP's hooks, FSDP's) or functional (DTensor's, so torch's tensor parallelism),
on the calling thread and in autograd's backward (the engine carries the mode over): its kind, the bytes of the
whole tensor S (an all-gather's output, a reduce-scatter's input, an all-reduce's tensor) and the size of the
group. `bytes_sent()` is what one rank sends of them as a ring sends it (systems.accounting.ffn_layouts: (n-1)/n S
for an all-gather or a reduce-scatter, 2 (n-1)/n S for an all-reduce, (n-1)/n S for an all-to-all of even
splits), by kind. Under NCCL that is what the wire carries for ring algorithms; under gloo our collectives
(systems.parallel.collectives) reduce by all-gather and all-to-all, and are counted as what they are.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from systems.accounting.ffn_layouts import Collective


@dataclass(frozen=True)
class Issued:
    kind: str  # all-reduce, all-gather, reduce-scatter, all-to-all
    nbytes: int  # S: the whole tensor
    devices: int  # the group's size

    @property
    def bytes_sent(self) -> float:
        if self.kind == "all-to-all":
            return (self.devices - 1) / self.devices * self.nbytes
        return Collective(self.kind, self.nbytes, self.devices).bytes_sent


def _nbytes(tensors) -> int:
    tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
    return sum(t.numel() * t.element_size() for t in tensors)


def _eager_size(group) -> int:
    return dist.ProcessGroup.unbox(group).size()


def _functional_size(name) -> int:
    return dist.distributed_c10d._resolve_process_group(name).size()


# op name -> (kind, S from the op's arguments, the group's size from them)
_OPS = {
    "c10d.allreduce_.default": ("all-reduce", lambda a: _nbytes(a[0]), lambda a: _eager_size(a[1])),
    "c10d._allgather_base_.default": ("all-gather", lambda a: _nbytes(a[0]), lambda a: _eager_size(a[2])),
    "c10d.allgather_into_tensor_coalesced_.default": ("all-gather", lambda a: _nbytes(a[0]),
                                                      lambda a: _eager_size(a[2])),
    "c10d._reduce_scatter_base_.default": ("reduce-scatter", lambda a: _nbytes(a[1]), lambda a: _eager_size(a[2])),
    "c10d.reduce_scatter_tensor_coalesced_.default": ("reduce-scatter", lambda a: _nbytes(a[1]),
                                                      lambda a: _eager_size(a[2])),
    "c10d.alltoall_base_.default": ("all-to-all", lambda a: _nbytes(a[1]), lambda a: _eager_size(a[2])),
    "_c10d_functional.all_reduce.default": ("all-reduce", lambda a: _nbytes(a[0]), lambda a: _functional_size(a[2])),
    "_c10d_functional.all_reduce_.default": ("all-reduce", lambda a: _nbytes(a[0]),
                                             lambda a: _functional_size(a[2])),
    "_c10d_functional.all_gather_into_tensor.default": ("all-gather", lambda a: _nbytes(a[0]) * a[1],
                                                        lambda a: a[1]),
    "_c10d_functional.reduce_scatter_tensor.default": ("reduce-scatter", lambda a: _nbytes(a[0]), lambda a: a[2]),
}
# Collectives this counter does not know: refused rather than left out of the count.
_UNKNOWN = ("c10d.", "_c10d_functional.")
_NOT_COLLECTIVES = ("_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd")


class IssuedCollectives(TorchDispatchMode):
    """Counts the collectives issued while it is active (see the module's docstring)."""

    def __init__(self):
        super().__init__()
        self.issued: list[Issued] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in _OPS:
            kind, nbytes, devices = _OPS[name]
            self.issued.append(Issued(kind, nbytes(args), devices(args)))
        elif name.startswith(_UNKNOWN) and not name.startswith(_NOT_COLLECTIVES):
            raise NotImplementedError(f"IssuedCollectives does not count {name}")
        return func(*args, **(kwargs or {}))

    def bytes_sent(self) -> dict[str, float]:
        """Bytes this rank sent, by kind of collective."""
        sent = defaultdict(float)
        for issued in self.issued:
            sent[issued.kind] += issued.bytes_sent
        return dict(sent)
