"""Optimizers: AdamW (one fused Triton launch per step on CUDA), gradient clipping and
a ZeRO-1 sharded optimizer."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist


LOW_PRECISION = (torch.bfloat16, torch.float16)


class AdamW(torch.optim.Optimizer):
    """Adam with decoupled weight decay, with the semantics of `torch.optim.AdamW`.

    A bf16 or fp16 parameter gets an fp32 master copy in its state: the update runs on the master
    and the parameter receives it rounded, so small updates are not lost to the low precision. The
    moments are fp32 for every parameter.

    On CUDA the parameters of a group are updated by one Triton kernel launch per weight dtype that
    reads p, g, m, v and writes p, m, v once (bf16 weights: g, master, m, v and writes master, m, v, w):
    28 bytes per parameter, the floor for this update, and no per-parameter launch overhead.
    Elsewhere it runs as torch ops.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01):
        _check_hyperparameters(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hyper = dict(lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    if p.dtype in LOW_PRECISION:
                        state["master"] = p.detach().float()
                    fp32 = state.get("master", p)
                    state["exp_avg"] = torch.zeros_like(fp32, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(fp32, memory_format=torch.preserve_format)
                state["step"] += 1
            fusable = [_fusable(p) for p in params]
            for dtype in {p.dtype for p, fuse in zip(params, fusable) if fuse}:  # one launch per weight dtype
                fused = [p for p, fuse in zip(params, fusable) if fuse and p.dtype == dtype]
                adamw_update_fused(fused, [self.state[p] for p in fused], **hyper)
            for p in (p for p, fuse in zip(params, fusable) if not fuse):
                state = self.state[p]
                master = state.get("master", p)
                adamw_update_torch(master, p.grad.float(), state["exp_avg"], state["exp_avg_sq"],
                                   step=state["step"], **hyper)
                if master is not p:
                    p.copy_(master)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, except that the state of a bf16/fp16 parameter stays fp32 (torch would cast it
        to the parameter's dtype and lose the master copy's precision)."""
        super().load_state_dict(state_dict)
        _keep_low_precision_state_fp32(self, state_dict)


def _check_hyperparameters(*, lr, betas, eps, weight_decay) -> None:
    """At construction, what would otherwise turn the weights NaN or fail at the first step."""
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    beta1, beta2 = betas
    for name, value in dict(lr=lr, eps=eps, weight_decay=weight_decay, beta1=beta1, beta2=beta2).items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"{name} must be a float, got {value!r}")
        if name.startswith("beta"):
            if not 0 <= value < 1:  # NaN fails it too
                raise ValueError(f"{name} must lie in [0, 1), got {value}")
        elif not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and non-negative, got {value}")


def _keep_low_precision_state_fp32(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Undo torch's cast of loaded state to its parameter's dtype for bf16/fp16 parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, saved in state_dict["state"].items():
        param = params[index]
        if param.dtype in LOW_PRECISION:
            for key, value in saved.items():
                if isinstance(value, torch.Tensor):
                    optimizer.state[param][key] = value.to(param.device, torch.float32, copy=True)


def _fusable(p: torch.Tensor) -> bool:
    return p.is_cuda and p.dtype == p.grad.dtype and p.dtype in (torch.float32, *LOW_PRECISION) and all(
        t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (p, p.grad))


def adamw_update_torch(p, grad, exp_avg, exp_avg_sq, *, step, lr, betas, eps, weight_decay):
    beta1, beta2 = betas
    p.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))


def adamw_update_fused(params, states, *, lr, betas, eps, weight_decay):
    """The same update for many contiguous tensors of one dtype in one Triton launch (systems.optim.fused_adamw);
    bf16/fp16 parameters are updated through the fp32 master copies in their states."""
    from systems.optim.fused_adamw import adamw_step

    if params[0].dtype in LOW_PRECISION:
        masters, weights = [s["master"] for s in states], params
    else:
        masters, weights = params, None
    adamw_step(masters, [p.grad for p in params], [s["exp_avg"] for s in states],
               [s["exp_avg_sq"] for s in states], [s["step"] for s in states], weights=weights,
               lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale gradients in place so their global L2 norm is at most `max_norm`; returns the norm before.

    The scale is applied unconditionally (1 when under the limit) so no host sync is needed.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    scale = (max_norm / (total + eps)).clamp(max=1.0)
    torch._foreach_mul_(grads, scale)
    return total


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1: each rank keeps the state of `optimizer_cls` for its shard of the parameters only.

    Parameters are dealt out by size, largest first, each to the rank owning the fewest elements so
    far, so the state splits about evenly. `step()` updates this rank's shard, then every parameter
    is broadcast from its owner, so all ranks end the step with the same parameters. Gradients must
    already be averaged across ranks (a DDP wrapper does that). `state` holds this rank's shard.
    """

    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], **kwargs):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
        self.optimizer_cls = optimizer_cls
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.owner: dict[torch.Tensor, int] = {}  # insertion order is the broadcast order on every rank
        self._owned_numel = [0] * self.world_size
        self.local_optimizer: torch.optim.Optimizer | None = None  # None while this rank owns nothing
        self._sharded_groups: list[int] = []  # per local group, the index of the group it shards
        super().__init__(params, kwargs)  # calls add_param_group for every group

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        params = list(dict.fromkeys(group["params"]))  # a tied parameter listed twice is one parameter
        for param in sorted(params, key=torch.Tensor.numel, reverse=True):
            rank = min(range(self.world_size), key=self._owned_numel.__getitem__)
            self.owner[param] = rank
            self._owned_numel[rank] += param.numel()
        shard = [p for p in params if self.owner[p] == self.rank]
        if not shard:
            return
        local = {"params": shard, **_options(group)}
        if self.local_optimizer is None:
            self.local_optimizer = self.optimizer_cls([local], **self.defaults)
            self.local_optimizer.state = self.state  # one dict: `state` and state_dict() show this rank's shard
        else:
            self.local_optimizer.add_param_group(local)
        self._sharded_groups.append(len(self.param_groups) - 1)

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's; the local optimizer keeps sharing `state`, which torch's replaces, and bf16/fp16
        parameters keep fp32 state as in AdamW."""
        super().load_state_dict(state_dict)
        _keep_low_precision_state_fp32(self, state_dict)
        if self.local_optimizer is not None:
            self.local_optimizer.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.local_optimizer is not None:
            for local, index in zip(self.local_optimizer.param_groups, self._sharded_groups):
                local.update(_options(self.param_groups[index]))  # e.g. a learning-rate schedule changed it
            self.local_optimizer.step()
        works = [dist.broadcast(param, src=rank, async_op=True) for param, rank in self.owner.items()]
        for work in works:
            work.wait()
        return loss


def _options(group: dict) -> dict:
    """A parameter group's hyperparameters."""
    return {key: value for key, value in group.items() if key not in ("params", "param_names")}
