"""ShardedOptimizer (ZeRO stage 1) against the unsharded optimizer it wraps.

Every rank trains two copies of one model on the same batches: one with ShardedOptimizer(AdamW),
one with plain AdamW. Each parameter is updated by the same AdamW arithmetic on the rank that
owns it and broadcast to the others, so after 10 steps with weight decay the copies must agree,
the tied embedding/output weight included, while each rank holds state for its shard only. A
parameter group added mid-training, a learning rate decayed through `param_groups` every step (as
schedulers do), zero_grad with and without set_to_none, a generator of parameters and a closure that
computes the loss in `step()` are exercised along the way.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from spawned_ranks import results_by_rank
from systems.optim import AdamW, ShardedOptimizer
from systems.parallel.ranks import rank_device

VOCAB, WIDTH, HIDDEN, STEPS, ADD_GROUP_AT, SEED = 31, 12, 40, 10, 3, 99
LR_DECAY = 0.7  # per step: the last steps' learning rate is a twentieth of the first's
ADAMW = dict(lr=0.02, weight_decay=0.1)
EXTRA_GROUP = dict(lr=0.05, weight_decay=0.0)


class TiedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (batch, seq, width)
        return self.head(x + self.down(torch.relu(self.up(x))))


def train_both() -> dict:
    """Train a sharded and an unsharded copy side by side; return both and what this rank owns."""
    device = rank_device()
    torch.manual_seed(SEED)  # the same model and data on every rank: only the optimizer differs
    sharded_model = TiedModel().to(device)
    plain_model = copy.deepcopy(sharded_model)
    sharded_extra = nn.Parameter(torch.randn(7, device=device))
    plain_extra = nn.Parameter(sharded_extra.detach().clone())
    sharded = ShardedOptimizer(sharded_model.parameters(), AdamW, **ADAMW)  # parameters() is a generator
    plain = AdamW(plain_model.parameters(), **ADAMW)
    grads_after_zero_grad, step_losses = [], {"sharded": [], "plain": []}
    for step in range(STEPS):
        if step == ADD_GROUP_AT:
            sharded.add_param_group({"params": [sharded_extra], **EXTRA_GROUP})
            plain.add_param_group({"params": [plain_extra], **EXTRA_GROUP})
        tokens = torch.randint(VOCAB, (4, 6), device=device)
        for name, model, extra, optimizer in (("sharded", sharded_model, sharded_extra, sharded),
                                              ("plain", plain_model, plain_extra, plain)):
            loss = optimizer.step(functools.partial(backpropagated_loss, model, extra, tokens, step))
            step_losses[name].append(None if loss is None else loss.item())
            for group in optimizer.param_groups:
                group["lr"] *= LR_DECAY
        set_to_none = step % 2 == 0
        sharded.zero_grad(set_to_none=set_to_none)
        plain.zero_grad()
        grads = [p.grad for p in [*sharded_model.parameters(), sharded_extra]]
        # The model's parameters always had gradients here; the extra one only from ADD_GROUP_AT on.
        grads_after_zero_grad.append(all(g is None if set_to_none else g is None or not g.any() for g in grads))
    names = {param: name for name, param in [*sharded_model.named_parameters(), ("extra", sharded_extra)]}
    restored = ShardedOptimizer(sharded_model.parameters(), AdamW, **ADAMW)
    restored.add_param_group({"params": [sharded_extra], **EXTRA_GROUP})
    restored.load_state_dict(sharded.state_dict())
    return {
        "sharded": _snapshot(sharded_model, sharded_extra),
        "plain": _snapshot(plain_model, plain_extra),
        "owner": {names[param]: rank for param, rank in sharded.owner.items()},
        "numel": {name: param.numel() for param, name in names.items()},
        "state_numel": {names[param]: sum(t.numel() for t in state.values() if torch.is_tensor(t))
                        for param, state in sharded.state.items()},
        "grads_after_zero_grad": grads_after_zero_grad,
        "step_losses": step_losses,
        # What the restored optimizer's next step would use: its local optimizer's state.
        "restored_matches": [torch.equal(value, restored.local_optimizer.state[param][key])
                             for param, state in sharded.state.items()
                             for key, value in state.items() if torch.is_tensor(value)],
        "rank": dist.get_rank(),
    }


def backpropagated_loss(model: nn.Module, extra: torch.Tensor, tokens: torch.Tensor, step: int) -> torch.Tensor:
    """The loss, after its backward: an optimizer step's closure."""
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    if step >= ADD_GROUP_AT:
        loss = loss + (extra.sin() * loss).sum()
    loss.backward()
    return loss


def _snapshot(model: nn.Module, extra: torch.Tensor) -> dict[str, torch.Tensor]:
    tensors = {name: t.detach().cpu().clone() for name, t in model.state_dict().items()}
    return tensors | {"extra": extra.detach().cpu().clone()}


ranks = results_by_rank("ranks", train_both, gloo_world_sizes=(2, 3), timeout=180)


def test_matches_unsharded_adamw(ranks):
    for result in ranks:
        assert result["sharded"].keys() == result["plain"].keys()
        for name, expected in result["plain"].items():
            torch.testing.assert_close(result["sharded"][name], expected, rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"rank {result['rank']}, {name}: {m}")


def test_training_moved_every_parameter(ranks):
    """Guards the comparison above against an optimizer that does nothing."""
    torch.manual_seed(SEED)
    initial = TiedModel().state_dict()
    for name, value in initial.items():
        assert not torch.allclose(ranks[0]["plain"][name], value), name


def test_each_rank_keeps_state_for_its_shard_only(ranks):
    owner, numel = ranks[0]["owner"], ranks[0]["numel"]
    assert owner.keys() == numel.keys()  # every parameter has an owner; the tied one is listed once
    for result in ranks:
        assert result["owner"] == owner  # every rank deals the same shards
        mine = {name for name, rank in owner.items() if rank == result["rank"]}
        assert result["state_numel"] == {name: 2 * numel[name] for name in mine}  # exp_avg and exp_avg_sq


def test_a_loaded_state_dict_reaches_the_local_optimizer(ranks):
    for result in ranks:
        assert result["restored_matches"] and all(result["restored_matches"])


def test_shards_are_balanced_by_size(ranks):
    owner, numel = ranks[0]["owner"], ranks[0]["numel"]
    loads = [sum(numel[name] for name, rank in owner.items() if rank == r) for r in range(len(ranks))]
    assert all(loads)
    assert max(loads) - min(loads) <= max(numel.values())


def test_step_returns_the_closure_loss(ranks):
    for result in ranks:
        assert None not in result["step_losses"]["sharded"]
        # As close as the parameters the losses are computed from (test_matches_unsharded_adamw).
        torch.testing.assert_close(result["step_losses"]["sharded"], result["step_losses"]["plain"], rtol=1e-6,
                                   atol=1e-7)


def test_zero_grad_clears_every_parameter(ranks):
    for result in ranks:
        assert all(result["grads_after_zero_grad"])


def test_rejects_a_non_optimizer_class():
    with pytest.raises(TypeError, match="optimizer_cls"):
        ShardedOptimizer([nn.Parameter(torch.randn(3))], torch.optim.SGD([nn.Parameter(torch.randn(3))], lr=0.1))
