"""Measurements of memory that the accounting's tests compare with: the bytes autograd saves, the peak the CPU
allocator holds in tensors, a phase's peak on a GPU, and one rank of a process group alone in this process."""

import contextlib
import itertools

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

from systems.accounting import model_state
from systems.optim import AdamW
from systems.step import backward, forward_loss, make_model, optimizer_step, random_batch, train_step


def saved_tensor_bytes(model, tokens, targets, precision) -> int:
    """Bytes of the distinct storages autograd saves in a forward pass and loss, weights and inputs excluded."""
    excluded = {t.untyped_storage().data_ptr()
                for t in itertools.chain(model.parameters(), model.buffers(), (tokens, targets))}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward_loss(model, tokens, targets, precision)
    return sum(saved.values())


def _allocations(events):
    for event in events:
        if event.typed[0] == _EventType.Allocation:
            yield event
        yield from _allocations(event.children)


def cpu_peak_bytes(fn, leave_out: str | None = None) -> int:
    """Peak of the bytes the CPU allocator holds in tensors while `fn` runs, above what it held before (see
    cpu_peaks)."""
    return cpu_peaks(fn, (), leave_out)["whole"]


def cpu_peaks(fn, scopes: tuple[str, ...], leave_out: str | None = None) -> dict[str, int]:
    """Peaks of the bytes the CPU allocator holds in tensors while `fn` runs, above what it held before, from one
    profiled run: "whole", and for each name in `scopes` the peak up to the end of the first `record_function`
    scope of that name (e.g. a step's forward, without profiling a forward of its own).

    An op's workspace, memory it allocates and frees itself, directly or (an ATen op) through `aten::empty`,
    rather than through an op that computes something, is left out: the BLAS library and ATen's CPU flash
    attention size it for the CPU's instructions and thread count (attention takes a query-block by key-block
    fp32 tile per thread), and it is no tensor the accounting models. oneDNN's bf16 matmul takes per-thread
    tiles where the CPU has bf16 instructions, and an fp32 copy of the whole output where it has AVX-512
    without them (ONEDNN_MAX_CPU_ISA=AVX512_CORE shows that on a newer x86).

    `leave_out`: allocations made inside a profiler scope whose name starts with it are left out too, e.g.
    "gloo:" for gloo's own staging buffers, which its worker threads may free where the profiler does not see.
    Such a thread may also drop the last reference to a tensor made here: an allocation at a pointer still
    held means the allocator had it back, so the earlier tensor is counted freed there.
    """
    return _profiled_peaks(fn, scopes, leave_out)[0]


def certain_cpu_peaks(fn, scopes: tuple[str, ...], leave_out: str | None = None) -> dict[str, int] | None:
    """cpu_peaks, or None where other threads may have moved them: where a tensor `fn` made (outside `leave_out`'s
    scopes) was not freed in view by the thread that made it, but where the profiler did not see (its pointer
    allocated again, or never freed) or by another thread (a gloo worker dropping the last reference when it gets
    to it). `fn` must free what it makes, as a training step does. Such a free comes later than the one it stands
    for, so it only ever adds to a peak, and the same few recur from run to run: the least of several runs is no
    proof, the peaks of a run without any are those of `fn` itself."""
    peaks, certain = _profiled_peaks(fn, scopes, leave_out)
    return peaks if certain else None


def _profiled_peaks(fn, scopes: tuple[str, ...], leave_out: str | None) -> tuple[dict[str, int], bool]:
    """cpu_peaks, and whether they are certain (certain_cpu_peaks)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    tree = prof.profiler.kineto_results.experimental_event_tree()
    events = sorted(_allocations(tree), key=lambda e: e.start_time_ns)
    changes = [(e.typed[1].ptr, e.typed[1].alloc_size, _owner(e)) for e in events]
    allocated_by, workspace = {}, set()  # pointer -> (op, index of its allocation)
    unseen_frees = {}  # index of an allocation at a pointer still held -> bytes the earlier one freed before it
    left_out = {}  # pointer -> index of its allocation, inside a scope named `leave_out`
    freed_elsewhere = False  # a tensor made here freed by another thread than the one that made it
    for index, (ptr, size, op) in enumerate(changes):
        if size > 0 and leave_out is not None and _inside(events[index], leave_out):
            left_out[ptr] = index
            workspace.add(index)
        elif size < 0 and ptr in left_out:
            del left_out[ptr]
            workspace.add(index)
        elif size > 0:
            if ptr in allocated_by:  # freed where the profiler did not see (a gloo worker thread dropping a Work)
                unseen_frees[index] = changes[allocated_by[ptr][1]][1]
            left_out.pop(ptr, None)  # likewise a staging buffer's
            allocated_by[ptr] = (op, index)
        elif ptr in allocated_by:
            allocating_op, allocation = allocated_by.pop(ptr)
            if op is not None and op == allocating_op:
                workspace |= {allocation, index}
            freed_elsewhere |= events[index].start_tid != events[allocation].start_tid
    ends = {name: _scope_end(tree, name) for name in scopes}
    held, peaks = 0, dict.fromkeys(("whole", *scopes), 0)
    for index, (_, size, _) in enumerate(changes):
        if index not in workspace:
            held += size - unseen_frees.get(index, 0)
            for name in peaks:
                if name == "whole" or events[index].start_time_ns <= ends[name]:
                    peaks[name] = max(peaks[name], held)
    return peaks, not (unseen_frees or allocated_by or freed_elsewhere)


def _scope_end(tree, name: str) -> int:
    def find(events):
        for event in events:
            if event.name == name:
                return event
            found = find(event.children)
            if found is not None:
                return found
        return None

    scope = find(tree)
    if scope is None:
        raise ValueError(f"no record_function scope {name!r} ran in the profiled function")
    return scope.end_time_ns


def _owner(event) -> int | None:
    """The op an allocation or free happened in; for a bare `aten::empty` that an ATen op called, that op.

    Only an ATen op: Python code runs inside other scopes too, and what its `torch.empty` makes is a tensor
    the accounting models, not scratch. FSDP gathers a saved weight in a saved-tensor hook inside the
    autograd node that unpacks it, which drops the weight before it returns (the chunked loss's backward)."""
    parent = event.parent
    if (parent is not None and parent.name == "aten::empty" and parent.parent is not None
            and parent.parent.name.startswith("aten::")):
        parent = parent.parent
    return parent.id if parent is not None else None


def _inside(event, scope: str) -> bool:
    parent = event.parent
    while parent is not None:
        if parent.name.startswith(scope):
            return True
        parent = parent.parent
    return False


def training_peaks(config, batch_size: int, seq: int, precision, inference: bool = True) -> dict[str, int]:
    """Allocation peaks of a fresh CPU model once AdamW's state exists, each counting the tensors already resident,
    as systems.accounting.peak_memory does: from one profiled training step its forward, forward and backward, and
    whole step, and unless `inference` is off a forward under no_grad ("inference")."""
    cpu = torch.device("cpu")
    model = make_model(config, cpu, precision)
    optimizer = AdamW(model.parameters())
    tokens, targets = random_batch(config, batch_size, seq, cpu)

    def step():
        with record_function("forward"):
            loss = forward_loss(model, tokens, targets, precision)
        with record_function("backward"):
            backward(loss)
        optimizer_step(optimizer)  # drops the gradients: the step ends in the state it found

    # AdamW's state as a first step leaves it, from zero gradients rather than a forward and backward: its bytes
    # do not depend on the gradients' values.
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer_step(optimizer)
    state = model_state(config, precision)
    resident = state.params + state.buffers  # already allocated when measuring starts
    peaks = cpu_peaks(step, ("forward", "backward"))
    measured = {"forward": resident + peaks["forward"], "forward_backward": resident + peaks["backward"],
                "train_step": state.training + peaks["whole"]}
    if inference:
        with torch.no_grad():
            measured["inference"] = resident + cpu_peak_bytes(lambda: forward_loss(model, tokens, targets, precision))
    return measured


def cuda_phase_peak(model, optimizer, tokens, targets, precision, phase: str) -> tuple[int, int]:
    """A phase ("forward": forward and loss; "step": a training step) run twice on the GPU, the first to warm up
    (kernels, cuBLAS's workspace and for the step the optimizer's state): the bytes allocated before the second run,
    and its peak."""
    def run():
        if phase == "forward":
            forward_loss(model, tokens, targets, precision)
        else:
            train_step(model, optimizer, tokens, targets, precision)

    run()
    torch.cuda.synchronize(tokens.device)
    resident = torch.cuda.memory_allocated(tokens.device)
    torch.cuda.reset_peak_memory_stats(tokens.device)
    run()
    torch.cuda.synchronize(tokens.device)
    return resident, torch.cuda.max_memory_allocated(tokens.device)


class _Alone(dist.ProcessGroup):
    """One rank of a process group, the only one in this process: a collective moves nothing and, as gloo's and
    NCCL's work does, holds its tensors until its work is dropped, so that this rank allocates and frees what it
    would among the others. (Two names for each collective: torch 2.13's and earlier ones'.)"""

    def broadcast(self, tensors, opts):
        return _holding(*tensors)

    def all_gather_single(self, output, input, opts):
        return _holding(output, input)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        return _holding(output, input)

    _allgather_base, alltoall_base = all_gather_single, all_to_all_single

    def getBackendName(self):
        return "alone"


def _holding(*tensors):
    done = torch.futures.Future()
    done.set_result(list(tensors))
    return _create_work_from_future(done)


@contextlib.contextmanager
def alone_as_rank(rank: int, world_size: int):
    """This process as rank `rank` of a default process group of `world_size` (_Alone), with a rank's share of its
    threads as systems.parallel.ranks gives its ranks: one rank's CPU allocations, without the others' processes,
    nor gloo's threads freeing where the profiler does not see."""
    dist.Backend.register_backend("alone", lambda store, rank, world_size, timeout: _Alone(rank, world_size),
                                  devices=["cpu"])
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // world_size))
    dist.init_process_group("alone", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
