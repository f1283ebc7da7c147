"""The pieces of a training step, shared by tests, benchmarks and the data-parallel code."""

from __future__ import annotations

import torch

from systems.device import nvtx_range
from systems.model import TransformerConfig, TransformerLM, check_id_range
from systems.precision import Precision


def check_batch(tokens: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError unless tokens and targets are each (batch, seq), of one shape, with every id in
    [0, vocab_size). It reads every id: call it where a batch is made, on the host before the batch goes to the
    device, never in the training step (the model's and the loss's entries check only dtypes and shapes; the
    model's `check_ids` debug switch checks ranges there too)."""
    if tokens.dim() != 2 or targets.shape != tokens.shape:
        raise ValueError(f"tokens and targets must each be (batch, seq), of one shape, got {tuple(tokens.shape)} "
                         f"and {tuple(targets.shape)}")
    check_id_range(tokens, vocab_size, "token ids")
    check_id_range(targets, vocab_size, "target ids")


def random_batch(config: TransformerConfig, batch_size: int, seq: int, device: torch.device,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniformly random token ids and next-token targets, each (batch_size, seq)."""
    data = torch.randint(config.vocab_size, (batch_size, seq + 1), generator=generator)
    check_batch(data[:, :-1], data[:, 1:], config.vocab_size)  # on the host: no device sync
    data = data.to(device)
    return data[:, :-1], data[:, 1:]


def make_model(config: TransformerConfig, device: torch.device, precision: Precision) -> TransformerLM:
    """A fresh model on `device`, its weights in the precision's weight dtype. It is initialized in fp32
    and then cast, so one seed gives every precision the same starting weights, up to rounding."""
    with torch.device(device):
        return TransformerLM(config).to(precision.weights)


def forward_loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
                 precision: Precision) -> torch.Tensor:
    """The model's mean cross-entropy, which it makes in its LM head's call (TransformerLM's `targets`)."""
    with nvtx_range("forward"), precision.autocast(tokens.device):
        return model(tokens, targets)


def backward(loss: torch.Tensor) -> None:
    with nvtx_range("backward"):
        loss.backward()


def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """Step, then drop the gradients (`set_to_none`: no memset, and their memory is free until the next backward)."""
    with nvtx_range("optimizer_step"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
               targets: torch.Tensor, precision: Precision) -> torch.Tensor:
    """Forward, backward and optimizer step, each in its NVTX range; returns the loss."""
    loss = forward_loss(model, tokens, targets, precision)
    backward(loss)
    optimizer_step(optimizer)
    return loss.detach()
