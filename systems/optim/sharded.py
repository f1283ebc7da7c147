"""ZeRO stage 1: optimizer state sharded across the ranks of a process group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from systems.optim.adamw import keep_low_precision_state_fp32, run_closure


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
        keep_low_precision_state_fp32(self, state_dict)
        if self.local_optimizer is not None:
            self.local_optimizer.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
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
