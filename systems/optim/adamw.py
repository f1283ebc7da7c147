"""AdamW with fp32 master copies of bf16/fp16 weights: one fused Triton launch per step on CUDA, torch ops
elsewhere."""

from __future__ import annotations

import math

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


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
        loss = run_closure(closure)
        for group in self.param_groups:
            hyper = {key: group[key] for key in HYPERPARAMETERS}
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                self._count_step(p)
            fusable = [_fusable(p) for p in params]
            fused = [p for p, fuse in zip(params, fusable) if fuse]
            for dtype in {p.dtype for p in fused}:  # one launch per weight dtype
                same = [p for p in fused if p.dtype == dtype]
                adamw_update_fused(same, [self.state[p] for p in same], **hyper)
            for p in (p for p, fuse in zip(params, fusable) if not fuse):
                self._update_torch(p, hyper)
        return loss

    def _count_step(self, p: torch.Tensor) -> None:
        """Count a step of `p`, creating its state (zero moments, the fp32 master) at its first."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            if p.dtype in LOW_PRECISION:
                state["master"] = p.detach().float()
            fp32 = state.get("master", p)
            state["exp_avg"] = torch.zeros_like(fp32, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(fp32, memory_format=torch.preserve_format)
        state["step"] += 1

    def _update_torch(self, p: torch.Tensor, hyper: dict) -> None:
        state = self.state[p]
        master = state.get("master", p)
        adamw_update_torch(master, p.grad.float(), state["exp_avg"], state["exp_avg_sq"], step=state["step"],
                           **hyper)
        if master is not p:
            p.copy_(master)

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, except that the state of a bf16/fp16 parameter stays fp32 (torch would cast it
        to the parameter's dtype and lose the master copy's precision)."""
        super().load_state_dict(state_dict)
        keep_low_precision_state_fp32(self, state_dict)


def run_closure(closure) -> torch.Tensor | None:
    """The loss `closure` recomputes, with gradients on (an optimizer's step runs under no_grad)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def keep_low_precision_state_fp32(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Undo torch's cast of loaded state to its parameter's dtype for bf16/fp16 parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, saved in state_dict["state"].items():
        param = params[index]
        if param.dtype in LOW_PRECISION:
            for key, value in saved.items():
                if isinstance(value, torch.Tensor):
                    optimizer.state[param][key] = value.to(param.device, torch.float32, copy=True)


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


def _fusable(p: torch.Tensor) -> bool:
    """Whether the fused kernel can update `p`: on CUDA, contiguous and 16-byte aligned (the gradient is copied
    where it is not), gradient of its dtype."""
    return p.is_cuda and p.dtype == p.grad.dtype and p.dtype in (torch.float32, *LOW_PRECISION) and _aligned(p)


def _aligned(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def _kernel_ready(grad: torch.Tensor) -> torch.Tensor:
    """`grad`, copied where the kernel cannot read it as it is (a transposed matmul's gradient, a view into
    a packed buffer): the update, fused or not, must not depend on where the gradient lies in memory."""
    return grad if _aligned(grad) else grad.clone(memory_format=torch.contiguous_format)


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
    # Imported here: triton is a dependency on Linux x86-64 only (pyproject.toml), and this path runs on CUDA only.
    from systems.optim.fused_adamw import adamw_step

    if params[0].dtype in LOW_PRECISION:
        masters, weights = [s["master"] for s in states], params
    else:
        masters, weights = params, None
    adamw_step(masters, [_kernel_ready(p.grad) for p in params], [s["exp_avg"] for s in states],
               [s["exp_avg_sq"] for s in states], [s["step"] for s in states], weights=weights,
               lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
