"""The language model's loss: mean cross-entropy of next-token targets, from the whole logits or a chunk of
tokens at a time.

`cross_entropy(logits, targets)` takes logits the LM head has made. `chunked_cross_entropy(hidden, weight,
targets, chunk)` is the LM head and the loss in one: it makes the logits of `chunk` tokens at a time and keeps
none of them, so a step holds one chunk's logits instead of all of them (with `fused`, each chunk's softmax runs
in Triton kernels, systems.kernels). `LMHead` is a Linear whose forward takes the targets too and returns the loss,
so that the loss runs inside one call of the head module. docs/design-notes.md has the design.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from systems.device import nvtx_range


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood, stable for large logits: log-sum-exp with the max taken out."""
    # logits: (..., vocab), targets: (...)
    _check_targets(targets, logits.shape[:-1], "logits")
    logits = logits.float()
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    log_norm = shifted.exp().sum(dim=-1).log()
    target_logit = shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (log_norm - target_logit).mean()


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                          fused: bool = False) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, targets), `chunk` tokens at a time, never holding more logits than those;
    with `fused`, each chunk's softmax in Triton kernels.

    hidden: (..., d_model), weight: (vocab, d_model), targets: (...)."""
    _check_targets(targets, hidden.shape[:-1], "hidden states")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (vocab, d_model) with d_model={hidden.shape[-1]} as the hidden states' last "
                         f"dimension, got shape {tuple(weight.shape)}")
    check_chunk(chunk)
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    with torch.autocast(device, enabled=False):  # the casts are explicit, the same in the backward
        softmax = _FusedSoftmax if fused else _EagerSoftmax
        return _ChunkedCrossEntropy.apply(hidden.flatten(0, -2), weight, targets.flatten(), chunk, dtype, softmax)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, dtype, softmax):
        # hidden: (tokens, d_model), targets: (tokens,)
        log_norm = hidden.new_empty(len(targets), dtype=torch.float32)
        losses = torch.empty_like(log_norm)
        cast = weight.to(dtype)
        for rows in _chunks(len(targets), chunk):
            logits = softmax.logits(hidden[rows], cast)  # (chunk, vocab)
            log_norm[rows], losses[rows] = softmax.rows(logits, targets[rows])
            del logits  # before the next chunk's matmul: one chunk of logits alive at a time
        ctx.save_for_backward(hidden, weight, targets, log_norm)
        ctx.chunk, ctx.dtype, ctx.softmax = chunk, dtype, softmax
        return losses.mean()

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, log_norm = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)  # summed over chunks in fp32
        scale = grad / len(targets)
        cast = weight.to(ctx.dtype)
        for rows in _chunks(len(targets), ctx.chunk):
            with nvtx_range("loss_recompute"):
                logits = ctx.softmax.logits(hidden[rows], cast)
            grad_logits = ctx.softmax.gradients_(logits, targets[rows], log_norm[rows], scale).to(ctx.dtype)
            grad_hidden[rows] = grad_logits @ cast
            grad_weight.add_(grad_logits.T @ hidden[rows].to(ctx.dtype))
            del logits, grad_logits  # as in the forward
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(rows, vocab) logits of the rows, the matmul in the weight's dtype."""
    return hidden.to(weight.dtype) @ weight.T


class _EagerSoftmax:
    """A chunk's softmax in PyTorch ops, on an fp32 copy of its logits (the matmul's output freed at once)."""

    @staticmethod
    def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _logits(hidden, weight).float()

    @staticmethod
    def rows(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's log-sum-exp and loss."""
        log_norm = torch.logsumexp(logits, dim=-1)
        return log_norm, log_norm - logits.gather(-1, targets[:, None]).squeeze(-1)

    @staticmethod
    def gradients_(logits: torch.Tensor, targets: torch.Tensor, log_norm: torch.Tensor,
                   scale: torch.Tensor) -> torch.Tensor:
        """`scale` (d(loss) / tokens) times d(the rows' losses) / d(their logits), written over the logits."""
        # d(loss of a row) / d(its logits) = softmax - one-hot of its target
        probs = logits.sub_(log_norm[:, None]).exp_()
        probs[torch.arange(len(probs), device=probs.device), targets] -= 1
        return probs.mul_(scale)


class _FusedSoftmax:
    """A chunk's softmax in systems.kernels' Triton kernels, on its logits as the matmul made them."""

    logits = staticmethod(_logits)

    @staticmethod
    def rows(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from systems.kernels import cross_entropy_rows  # Triton on first use: this module imports without it

        return cross_entropy_rows(logits, targets)

    @staticmethod
    def gradients_(logits: torch.Tensor, targets: torch.Tensor, log_norm: torch.Tensor,
                   scale: torch.Tensor) -> torch.Tensor:
        from systems.kernels import logit_gradients_

        logit_gradients_(logits, targets, log_norm, scale)
        return logits


def _chunks(tokens: int, chunk: int):
    for start in range(0, tokens, chunk):
        yield slice(start, min(start + chunk, tokens))


def check_chunk(chunk, name: str = "chunk") -> None:
    """A chunk is a whole number of tokens, at least one (`chunked_cross_entropy`, `TransformerConfig.loss_chunk`)."""
    if not isinstance(chunk, int) or isinstance(chunk, bool):
        raise TypeError(f"{name} must be a positive int, a number of tokens, got {chunk!r} of type "
                        f"{type(chunk).__name__}")
    if chunk < 1:
        raise ValueError(f"{name} must be a positive number of tokens, got {chunk}")


def _check_targets(targets: torch.Tensor, rows: torch.Size, labelled: str) -> None:
    """One int64 class id per row of what the loss labels, and at least one. Dtype and shapes only: no host sync,
    and torch.compile traces it."""
    if targets.dtype != torch.int64:
        raise TypeError(f"targets must be int64 class ids, got {targets.dtype}")
    if targets.shape != rows:
        raise ValueError(f"targets must be one id per row of the {labelled}: {tuple(rows)}, got targets of shape "
                         f"{tuple(targets.shape)}")
    if targets.numel() == 0:
        raise ValueError(f"cross_entropy needs at least one target to average over, got targets of shape "
                         f"{tuple(targets.shape)}")


class LMHead(nn.Linear):
    """The LM head: forward(hidden) -> logits (..., vocab); forward(hidden, targets, chunk) -> the mean
    cross-entropy, whole (chunk None) or `chunk` tokens at a time. `fused`: the loss's softmax in Triton kernels
    (chunked_cross_entropy's), in chunks of `chunk` tokens or one chunk of them all."""

    def __init__(self, d_model: int, vocab_size: int, fused: bool = False):
        super().__init__(d_model, vocab_size, bias=False)
        self.fused = fused

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None,
                chunk: int | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(hidden)
        with nvtx_range("loss"):
            if self.fused:
                return chunked_cross_entropy(hidden, self.weight, targets, chunk or max(1, targets.numel()), fused=True)
            if chunk is None:
                return cross_entropy(super().forward(hidden), targets)
            return chunked_cross_entropy(hidden, self.weight, targets, chunk)
