"""Fully-sharded data parallelism: every rank keeps 1/N of each Linear and Embedding weight and gathers a
layer's full weight only while that layer computes.

`FSDP(module, compute_dtype=None, shard_policy=linear_or_embedding, prefetch=1, gather="block", mesh=None)` shards
the weights the policy picks over the world or a mesh's shard axis (HSDP replicates over its replicate axis),
all-gathers them a group at a time (systems.parallel.fsdp_units), `prefetch` groups ahead, and reduce-scatters their
gradients. A step is `loss = f(fsdp(x)); loss.backward(); fsdp.finish_gradient_synchronization(); optimizer.step()`
with the optimizer over `fsdp.parameters()`. Every rank must run the same sharded modules in the same order: the
gathers are collectives. `get_fsdp`, `fsdp_on_after_backward` and `fsdp_gather_full_params` are the course's
adapters. docs/design-notes.md has the design.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack
from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

from systems.levers.sharding import (DEFAULT_GATHER, DEFAULT_PREFETCH, REDUCE_SCATTERS_IN_FLIGHT, Gather,
                                     check_prefetch)
from systems.parallel.collectives import WaitClock, all_gather, all_reduce_mean, reduce_scatter_mean
from systems.parallel.fsdp_units import Group, Unit, check_compute_dtype, group_units, linear_or_embedding
from systems.parallel.mesh import Mesh
from systems.parallel.meters import GatheredMemory

_RECOMPUTE_MODES = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)  # selective checkpointing's


class _GatheredWeight(torch.autograd.Function):
    """The full weight as a view of the gathered buffer, in the graph of its shard: the gradient goes to
    FSDP, which reduce-scatters it, instead of to the shard."""

    @staticmethod
    def forward(ctx, shard, flat, unit, fsdp):
        ctx.unit, ctx.fsdp = unit, fsdp
        return flat[:unit.numel].view(unit.shape)

    @staticmethod
    def backward(ctx, grad):
        ctx.fsdp._on_gradient(ctx.unit, grad)
        return None, None, None, None


class _SavedView:
    """What autograd keeps in place of a view of a gathered weight: enough to rebuild it from a new gather."""

    def __init__(self, unit: Unit, tensor: torch.Tensor):
        self.unit, self.geometry = unit, (tensor.size(), tensor.stride(), tensor.storage_offset())


class FSDP(nn.Module):
    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 shard_policy: Callable[[nn.Module], bool] = linear_or_embedding, prefetch: int = DEFAULT_PREFETCH,
                 gather: Gather | str | Callable[[nn.Module], bool] = DEFAULT_GATHER, mesh: Mesh | None = None):
        check_compute_dtype(compute_dtype)
        check_prefetch(prefetch)
        gather = gather if callable(gather) else Gather(gather)
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be None (shard over the world) or a systems.parallel.mesh.Mesh, got {mesh!r}")
        super().__init__()
        self.module, self.compute_dtype, self.prefetch = module, compute_dtype, prefetch
        self.mesh = mesh  # None: the world
        # Without a mesh the world's group (None), as torch names it: today's collectives, no new group.
        self.shard_group = mesh.shard.group if mesh is not None else None
        self.replicate_group = mesh.replicate.group if mesh is not None and mesh.replicate.size > 1 else None
        self.shard_size = dist.get_world_size(self.shard_group)
        source, data = (0, None) if mesh is None else (mesh.data.source, mesh.data.group)
        with torch.no_grad():
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=source, group=data)
        names = {param: name for name, param in module.named_parameters()}
        units: dict[nn.Parameter, Unit] = {}
        self._cast: dict[nn.Module, dict[str, nn.Parameter]] = {}  # a sharded module's own replicated parameters
        for submodule in dict.fromkeys(m for m in module.modules() if shard_policy(m)):
            weight = submodule._parameters.pop("weight")
            units.setdefault(weight, Unit(names[weight], weight, compute_dtype, dist.get_rank(self.shard_group),
                                           self.shard_size)).modules.append(submodule)
            submodule.weight = None  # set to the gathered weight while the module runs
            if compute_dtype is not None:  # its bias, say: cast while the module runs, as its weight is gathered
                self._cast[submodule] = {name: p for name, p in submodule._parameters.items()
                                         if p is not None and p.is_floating_point()}
            submodule.register_forward_pre_hook(_eager_and_hidden_from_recompute(self._before))
            submodule.register_forward_hook(_eager_and_hidden_from_recompute(self._after))
        self.units = list(units.values())
        self.groups = group_units(module, self.units, gather)
        self.shards = nn.ParameterList(unit.shard for unit in self.units)  # first in parameters()
        self._unit_of = {m: unit for unit in self.units for m in unit.modules}
        # The wrapped module's own names, in its order: a sharded weight, or a replicated parameter.
        self._named = [(name, units.get(param, param)) for param, name in names.items()]
        self._replicated = [p for p in module.parameters() if p.requires_grad]
        self._storages: dict[int, Unit] = {}  # gathered buffer's storage -> its unit, for the saved-tensor hooks
        self._uses: list[Group] = []  # this forward's groups, in the order they were used (once per visit)
        self._order: list[Group] = []  # the last forward's: what forward and backward prefetch from
        self._saving: set[int] = set()  # indices of this forward's uses that saved a gathered weight
        self._backward: list[Group] = []  # those uses' groups, last first
        self._cursor = 0  # where backward is in `_backward`
        self._forwarding = False  # a sharded module called outside forward is activation checkpointing's recompute
        self._calls: list[nn.Module] = []  # the module that began each of this forward's uses, as `_uses`
        self._position: dict[nn.Module, int] = {}  # module -> the (last) use of `_order` it began
        self._recomputed: set[int] = set()  # indices of `_order` this backward has recomputed
        self._reducing: deque = deque()  # (units, Pending, chunks) of reduce-scatters in flight
        self._replicating: deque = deque()  # (units, Pending, flat chunks) of HSDP's all-reduces in flight
        device = self.shards[0].device if self.units else torch.device("cpu")
        self.gather_wait = WaitClock(device)
        self.gathered = GatheredMemory()
        # The saved-tensor hooks run eagerly, as the module hooks do: traced into a compiled block, Dynamo breaks
        # its graph on their storage lookup. (Wrapped here, not where they are defined:
        # Dynamo's import loads Triton, before a test run on a CPU has asked for its interpreter.)
        self._saved_hooks = (torch.compiler.disable(self._pack), torch.compiler.disable(self._unpack))

    def forward(self, *args, **kwargs):
        for unit in self.units:
            unit.saved = unit.uses = 0
        for group in self.groups:
            group.waiting = 0
        self._uses, self._saving, self._calls = [], set(), []
        self._forwarding = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(*self._saved_hooks):
                output = self.module(*args, **kwargs)
        finally:
            self._forwarding = False
        self._order = self._uses
        self._position = {module: i for i, module in enumerate(self._calls)}
        self._recomputed = set()
        self._backward = [self._uses[i] for i in sorted(self._saving, reverse=True)]
        self._cursor = 0
        return output

    # Forward: gather a group, prefetch the next ones, compute each layer and drop its weight.

    def _before(self, module: nn.Module, args: tuple):
        unit = self._unit_of[module]
        group = unit.group
        if self._forwarding and (not self._uses or self._uses[-1] is not group):  # the group's layers begin
            self._start_gather(group.units)
            group.use = len(self._uses)
            self._uses.append(group)
            self._calls.append(module)
            self._prefetch(group.use + 1, group.use + 1 + self.prefetch)
        elif not self._forwarding and module in self._position:
            self._start_gather(group.units)
            self._prefetch_recomputation(module)
        self._start_gather([unit])  # used again after its group's use let it go
        self._wait_gathered(unit)
        weight = _GatheredWeight.apply(unit.shard, unit.flat, unit, self)
        if weight.requires_grad and self._forwarding:
            # A recomputed use is not counted: its graph only refills saved tensors, and the gradient
            # arrives through the forward's use, so counting it would hold the reduce-scatter to the end.
            group.waiting += unit.uses == 0
            unit.uses += 1
        module.weight = weight
        if self.compute_dtype is not None:
            # In the parameter's place while the module runs: autograd casts its gradient back to its dtype.
            for name, param in self._cast[module].items():
                module._parameters[name] = param.to(self.compute_dtype)
            return tuple(a.to(self.compute_dtype) if torch.is_tensor(a) and a.is_floating_point() else a
                         for a in args)
        return None

    def _prefetch(self, start: int, stop: int) -> None:
        """Gather uses [start, stop) of the last forward's order; none past its end (the next forward's first
        layers wait for it: their gathers would hold memory through the backward)."""
        for group in self._order[start:stop]:
            self._start_gather(group.units)

    def _prefetch_recomputation(self, module: nn.Module) -> None:
        """A recomputed segment runs its groups in forward order: gather the next `prefetch`, up to where the
        segment ends: a group recomputed already (a later segment), or one whose forward saved a weight
        through FSDP (it was not checkpointed, so it is never recomputed)."""
        index = self._position[module]
        self._recomputed.add(index)
        end = index + 1
        while end <= index + self.prefetch and end not in self._recomputed and end not in self._saving:
            end += 1
        self._prefetch(index + 1, end)

    def _after(self, module: nn.Module, args: tuple, output) -> None:
        self._restore_own_parameters(module)
        self._release(self._unit_of[module])

    def _restore_own_parameters(self, module: nn.Module) -> None:
        """The module's own parameters back in place of what it computed with."""
        module.weight = None
        module._parameters.update(self._cast.get(module, {}))

    def _start_gather(self, units: list[Unit]) -> None:
        """One all-gather of those of `units` not gathered or in flight already (a group's, in the compute dtype)."""
        units = [unit for unit in units if unit.flat is None]
        if not units:
            return
        for unit in units:
            unit.flat = torch.empty(self.shard_size * unit.chunk, dtype=unit.dtype, device=unit.shard.device)
            self._storages[unit.flat.untyped_storage().data_ptr()] = unit
            self.gathered.add(unit.flat)
        shards = [unit.padded(unit.shard.detach(), unit.chunk, unit.dtype) for unit in units]
        pending = all_gather([unit.flat for unit in units], shards, units[0].group.name, self.shard_group)
        for unit in units:
            unit.gathering = pending

    def _wait_gathered(self, unit: Unit) -> None:
        pending = unit.gathering
        if pending is None:
            return
        self.gather_wait.wait(pending)
        for other in unit.group.units:
            if other.gathering is pending:
                other.gathering = None

    def _release(self, unit: Unit) -> None:
        if unit.flat is None:
            return
        self._wait_gathered(unit)  # prefetched, never used: the buffer must outlive the collective
        del self._storages[unit.flat.untyped_storage().data_ptr()]
        self.gathered.remove(unit.flat)
        unit.flat = None

    # Autograd keeps placeholders for gathered weights; backward gathers them again, a group's at once.

    def _pack(self, tensor: torch.Tensor):
        unit = self._storages.get(tensor.untyped_storage().data_ptr())
        if unit is None:
            return tensor
        unit.saved += 1
        self._saving.add(unit.group.use)
        return _SavedView(unit, tensor)

    def _unpack(self, saved):
        if not isinstance(saved, _SavedView):
            return saved
        unit = saved.unit
        self._start_gather(_saved_units(unit.group))
        while self._cursor < len(self._backward) and self._backward[self._cursor] is not unit.group:
            self._cursor += 1
        for ahead in self._backward[self._cursor + 1:self._cursor + 1 + self.prefetch]:
            self._start_gather(_saved_units(ahead))
        self._wait_gathered(unit)
        view = unit.flat.as_strided(*saved.geometry)
        unit.saved -= 1
        if unit.saved == 0:
            self._release(unit)  # autograd holds `view` until this node's backward is done
        return view

    def _on_gradient(self, unit: Unit, grad: torch.Tensor) -> None:
        unit.grad = grad if unit.grad is None else unit.grad + grad
        unit.uses -= 1
        if unit.uses == 0:
            unit.group.waiting -= 1
            if unit.group.waiting == 0:
                self._reduce_scatter(unit.group)
            if unit.saved == 0:  # a recomputation that torch stopped early inside the module never ran `_after`
                for module in unit.modules:  # which would drop the module's view of the gathered weight
                    self._restore_own_parameters(module)
                self._release(unit)

    def _reduce_scatter(self, group: Group) -> None:
        """One reduce-scatter of the group's gradients summed so far, each padded to its N chunks."""
        units = [unit for unit in group.units if unit.grad is not None]
        fulls = [unit.padded(unit.grad.contiguous().view(-1), self.shard_size * unit.chunk, unit.grad.dtype)
                 for unit in units]
        chunks = [full.new_empty(unit.chunk) for unit, full in zip(units, fulls)]
        for unit in units:
            unit.grad = None
        self._reducing.append((units, reduce_scatter_mean(chunks, fulls, group.name, self.shard_group), chunks))
        while len(self._reducing) > REDUCE_SCATTERS_IN_FLIGHT:
            self._finish_reduce_scatter()

    def _finish_reduce_scatter(self) -> None:
        units, pending, chunks = self._reducing.popleft()
        pending.wait()
        if self.replicate_group is None:
            for unit, chunk in zip(units, chunks):
                unit.add_to_grad(chunk)
            return
        # HSDP: the shard group's means averaged over the replicas, one all-reduce of the group's chunks.
        flat = torch.cat(chunks)
        pending = all_reduce_mean(flat, f"{units[0].group.name} replicas", self.replicate_group)
        self._replicating.append((units, pending, flat))
        while len(self._replicating) > REDUCE_SCATTERS_IN_FLIGHT:
            self._finish_replicating()

    def _finish_replicating(self) -> None:
        units, pending, flat = self._replicating.popleft()
        pending.wait()
        for unit, chunk in zip(units, flat.split([unit.chunk for unit in units])):
            unit.add_to_grad(chunk.clone())  # its own tensor: see _average_replicated_gradients

    def finish_gradient_synchronization(self) -> None:
        """Wait for the shards' gradients and average the replicated parameters'; call after every backward."""
        for group in self.groups:  # a use whose output took no part in the loss leaves its sum incomplete
            if any(unit.grad is not None for unit in group.units):
                self._reduce_scatter(group)
        while self._reducing:
            self._finish_reduce_scatter()
        while self._replicating:
            self._finish_replicating()
        self._average_replicated_gradients()
        for unit in self.units:
            self._release(unit)
            unit.saved = unit.uses = 0
        for group in self.groups:
            group.waiting = 0
        self.gather_wait.lap()

    def _average_replicated_gradients(self) -> None:
        """One all-reduce per dtype of every replicated gradient packed flat (zeros where a parameter got none),
        over the shard group, then over the replicas: the order of the shards' reduction."""
        for dtype in dict.fromkeys(p.dtype for p in self._replicated):  # the same order on every rank
            params = [p for p in self._replicated if p.dtype == dtype]
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            all_reduce_mean(flat, "replicated gradients", self.shard_group).wait()
            if self.replicate_group is not None:
                all_reduce_mean(flat, "replicated gradients replicas", self.replicate_group).wait()
            # Each its own tensor: a view into `flat` may start off a 16-byte boundary, where the fused AdamW
            # would leave that parameter to torch ops, which round differently from one process's update.
            for param, grad in zip(params, flat.split([p.numel() for p in params])):
                param.grad = grad.view_as(param).clone()

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter of the wrapped module, whole, in its own dtype, keyed by the module's own names."""
        full = {}
        for name, owner in self._named:
            if isinstance(owner, Unit):
                flat = owner.shard.new_empty(self.shard_size * owner.chunk)
                all_gather([flat], [owner.padded(owner.shard, owner.chunk, owner.shard.dtype)], name,
                           self.shard_group).wait()
                full[name] = flat[:owner.numel].view(owner.shape)
            else:
                full[name] = owner.detach().clone()
        return full


def _eager_and_hidden_from_recompute(hook: Callable) -> Callable:
    """A module hook run eagerly inside a compiled block (one graph break, the same every step), and out of sight of
    selective checkpointing's modes, which replay a block's ops in its recomputation, where the gathers differ (the
    forward prefetches past the block). Other modes (IssuedCollectives) still see the hook's ops."""
    @torch.compiler.disable
    @functools.wraps(hook)
    def run(*args):
        seeing = [mode for mode in _get_current_dispatch_mode_stack() if not isinstance(mode, _RECOMPUTE_MODES)]
        with _disable_current_modes(), contextlib.ExitStack() as modes:
            for mode in seeing:
                modes.enter_context(mode)
            return hook(*args)

    return run


def _saved_units(group: Group) -> list[Unit]:
    """What backward will ask of the group: the weights whose views autograd keeps."""
    return [unit for unit in group.units if unit.saved > 0]


def get_fsdp(module: nn.Module, compute_dtype: torch.dtype | None = None, **levers) -> FSDP:
    """The course's adapter: `module` wrapped in FSDP (`levers`: FSDP's prefetch, gather and mesh)."""
    return FSDP(module, compute_dtype, **levers)


def fsdp_on_after_backward(model: FSDP, optimizer: torch.optim.Optimizer) -> None:
    """The course's adapter, called between backward and the optimizer step."""
    model.finish_gradient_synchronization()


def fsdp_gather_full_params(model: FSDP) -> dict[str, torch.Tensor]:
    """The course's adapter: {name: full tensor}, keyed by the wrapped module's own parameter names."""
    return model.gather_full_params()
