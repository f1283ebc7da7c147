"""The pieces of a training step, shared by tests, benchmarks and the data-parallel code."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from systems.model import TransformerConfig, TransformerLM, cross_entropy


def random_batch(config: TransformerConfig, batch_size: int, seq: int, device: torch.device,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniformly random token ids and next-token targets, each (batch_size, seq)."""
    data = torch.randint(config.vocab_size, (batch_size, seq + 1), generator=generator)
    data = data.to(device)
    return data[:, :-1], data[:, 1:]


@dataclass(frozen=True)
class Precision:
    """How a training step runs: the dtype the model's weights are kept in, and the dtype autocast runs
    matmuls in (fp32: no autocast)."""

    weights: torch.dtype
    compute: torch.dtype


PRECISIONS = {
    "fp32": Precision(weights=torch.float32, compute=torch.float32),
    # Autocast: the fp32 weights are cast to bf16 in every forward, their gradients cast back in backward.
    "bf16": Precision(weights=torch.float32, compute=torch.bfloat16),
    "fp16": Precision(weights=torch.float32, compute=torch.float16),
    # bf16 weights, with fp32 master copies kept by AdamW: no per-step casts of the weights, and the
    # gradients and the residual stream in bf16. Autocast still runs the ops it keeps in fp32 in fp32.
    "bf16-weights": Precision(weights=torch.bfloat16, compute=torch.bfloat16),
}


def get_precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; choose from {list(PRECISIONS)}")
    return PRECISIONS[name]


def make_model(config: TransformerConfig, device: torch.device, precision: str) -> TransformerLM:
    """A fresh model on `device`, its weights in the precision's weight dtype. It is initialized in fp32
    and then cast, so one seed gives every precision the same starting weights, up to rounding."""
    with torch.device(device):
        return TransformerLM(config).to(get_precision(precision).weights)


def autocast(device: torch.device, precision: str):
    """Autocast to the precision's compute dtype around the forward pass; fp32 runs without it."""
    compute = get_precision(precision).compute
    if compute == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=compute)


def host_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small table built on the host, on `device`. Through pinned memory the copy is queued on the
    stream instead of waiting for the work already queued there (the backward pass, say)."""
    table = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)
    return table


def nvtx_range(name: str):
    """An NVTX range for `nsys profile --capture-range=nvtx`, or nothing off-GPU."""
    if torch.cuda.is_available():
        return torch.cuda.nvtx.range(name)
    return contextlib.nullcontext()


def forward_loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor, precision: str) -> torch.Tensor:
    with nvtx_range("forward"), autocast(tokens.device, precision):
        return cross_entropy(model(tokens), targets)


def backward(loss: torch.Tensor) -> None:
    with nvtx_range("backward"):
        loss.backward()


def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    with nvtx_range("optimizer_step"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def train_step(model, optimizer, tokens, targets, precision: str) -> torch.Tensor:
    loss = forward_loss(model, tokens, targets, precision)
    backward(loss)
    optimizer_step(optimizer)
    return loss.detach()
