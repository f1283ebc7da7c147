"""Tensor parallelism (Megatron-LM; the 2026 handout's section 8): each Transformer block's attention and SwiGLU
split across the ranks of a group, so each rank holds and computes 1/T of every block.

`tensor_parallel(model, group)` shards a TransformerLM in place: the layers that expand the width column-parallel
(qkv by heads, SwiGLU's w1 and w3 by d_ff), those that contract it row-parallel (out, w2), each region bracketed by
Megatron's f and g (`copy_to_region`, `reduce_from_region`); the embedding, the norms and the LM head stay whole.
`torch_tensor_parallel` is torch's DTensor TP of the same model, beside it; `qkv_in_model_order` puts its qkv rows
back in the model's order, and `gather_slices` every rank's slices of ours. With FSDP (2D, `Layout(shard=dp,
tensor=tp)`) TP comes first, over the mesh's tensor axis (systems.parallel.parallelize). docs/design-notes.md has
the design.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn as nn

from systems.model import TransformerConfig, TransformerLM
from systems.parallel.collectives import all_gather, all_reduce_sum

# The weights tensor_parallel splits, by their name in a block, and the dimension each rank keeps a slice of: 0,
# column-parallel (output features); 1, row-parallel (input features).
SPLITS = {"attn.qkv.weight": 0, "attn.out.weight": 1, "ffn.w1.weight": 0, "ffn.w3.weight": 0, "ffn.w2.weight": 1}


class _CopyToRegion(torch.autograd.Function):
    """f: the identity forward; backward, the input's gradient summed over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # summed in place
        all_reduce_sum(grad, "tensor parallel f", ctx.group).wait()
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """g: forward, the row-parallel layer's partial output summed over the group; the identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone(memory_format=torch.contiguous_format)
        all_reduce_sum(x, "tensor parallel g", group).wait()
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, group)


def check_split(config: TransformerConfig, size: int) -> None:
    """Every rank takes as many heads and as many of d_ff's features as every other."""
    if config.num_heads % size or config.d_ff % size:
        raise ValueError(f"tensor parallelism over {size} ranks splits heads and d_ff evenly: num_heads="
                         f"{config.num_heads}, d_ff={config.d_ff}")


def tensor_parallel(model: TransformerLM, group: dist.ProcessGroup | None) -> TransformerLM:
    """Shard `model`'s blocks over `group` (None: the world) in place and return it. Ranks may build their models
    apart: the group's first rank's parameters and buffers are broadcast before each rank keeps its slices."""
    config = model.config
    size, index = dist.get_world_size(group), dist.get_rank(group)
    check_split(config, size)
    source = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(tensor, src=source, group=group)
    heads, d_ff, d_head = config.num_heads // size, config.d_ff // size, config.d_head
    mine_heads, mine_ff = slice(index * heads, (index + 1) * heads), slice(index * d_ff, (index + 1) * d_ff)
    for block in model.blocks:
        attn, ffn = block.attn, block.ffn
        d_model = attn.qkv.in_features
        # qkv: (3 * heads * d_head, d_model) -> this rank's heads of each of q, k, v: (3 * heads/T * d_head, d_model)
        _keep(attn.qkv, attn.qkv.weight.view(3, config.num_heads, d_head, d_model)[:, mine_heads].flatten(0, 2))
        # out: (d_model, heads * d_head) -> the columns of this rank's heads
        _keep(attn.out, attn.out.weight.view(d_model, config.num_heads, d_head)[:, mine_heads].flatten(1))
        attn.num_heads = heads
        _keep(ffn.w1, ffn.w1.weight[mine_ff])  # (d_ff/T, d_model)
        _keep(ffn.w3, ffn.w3.weight[mine_ff])
        _keep(ffn.w2, ffn.w2.weight[:, mine_ff])  # (d_model, d_ff/T)
        for region in (attn, ffn):
            region.register_forward_pre_hook(lambda module, args: (copy_to_region(args[0], group), *args[1:]))
            region.register_forward_hook(lambda module, args, output: reduce_from_region(output, group))
    return model


def _keep(linear: nn.Linear, weight: torch.Tensor) -> None:
    """`linear` keeps only `weight`, a slice of its weight, as a parameter of its own."""
    linear.weight = nn.Parameter(weight.detach().clone(), requires_grad=linear.weight.requires_grad)
    linear.out_features, linear.in_features = weight.shape


def torch_tensor_parallel(model: TransformerLM, mesh) -> TransformerLM:
    """Torch's tensor parallelism of the same blocks over a 1D DeviceMesh (systems.parallel.mesh.device_mesh):
    `parallelize_module` with ColwiseParallel qkv, w1, w3 and RowwiseParallel out, w2, in place. Broadcasts the
    first rank's parameters first. ColwiseParallel splits qkv's rows into contiguous chunks, so they are
    reordered first to (rank, 3, heads/T, d_head): each chunk is then [q, k, v] of one rank's heads;
    `qkv_in_model_order` undoes it."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    config, size = model.config, mesh.size()
    check_split(config, size)
    group = mesh.get_group()
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
    plan = {"attn.qkv": ColwiseParallel(), "attn.out": RowwiseParallel(), "ffn.w1": ColwiseParallel(),
            "ffn.w3": ColwiseParallel(), "ffn.w2": RowwiseParallel()}
    for block in model.blocks:
        weight = block.attn.qkv.weight
        rows = weight.view(3, size, config.num_heads // size, config.d_head, -1).transpose(0, 1).flatten(0, 3)
        block.attn.qkv.weight = nn.Parameter(rows.detach().clone())
        block.attn.num_heads = config.num_heads // size
        parallelize_module(block, mesh, plan)
    return model


def qkv_in_model_order(weight: torch.Tensor, config: TransformerConfig, size: int) -> torch.Tensor:
    """A full qkv weight in torch_tensor_parallel's row order, (T, 3, heads/T, d_head), back in the model's."""
    return weight.view(size, 3, config.num_heads // size, config.d_head, -1).transpose(0, 1).flatten(0, 3)


@torch.no_grad()
def gather_slices(params: dict[str, torch.Tensor], group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """`params` (a tensor_parallel model's, by name: this rank's slices of the split weights) with every rank's
    slices of the split weights gathered over `group` (None: the world) and put back whole, in the model's order:
    qkv's rows [q, k, v] each head after head, the others' slices concatenated along the dimension they split. A
    collective: call it on every rank of the group."""
    size = dist.get_world_size(group)
    whole = {}
    for name, param in params.items():
        dim = next((dim for suffix, dim in SPLITS.items() if name.endswith(suffix)), None)
        if dim is None:
            whole[name] = param
            continue
        flat = param.new_empty(size * param.numel())
        all_gather([flat], [param.detach().contiguous().view(-1)], f"tensor parallel {name}", group).wait()
        parts = flat.view(size, *param.shape).unbind()
        if name.endswith("attn.qkv.weight"):  # each part is (3, heads/T, d_head) rows: cat q's heads, k's, v's
            whole[name] = torch.cat([part.view(3, -1, part.shape[-1]) for part in parts], dim=1).flatten(0, 1)
        else:
            whole[name] = torch.cat(parts, dim=dim)
    return whole
