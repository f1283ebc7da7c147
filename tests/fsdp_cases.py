"""The models, batches and levers the sharding tests share (test_fsdp, test_fsdp_prefetch, test_hsdp,
test_tensor_parallel): the project's TransformerLM at sizes not divisible by 3, and a toy of its own classes named
Linear and Embedding (not torch's), with an LM head tied to the embedding, a frozen layer, and a bias and a
LayerNorm that stay replicated."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from systems.model import TransformerLM, get_config

VOCAB, WIDTH, ROWS_PER_RANK, SEQ, STEPS, SEED = 23, 10, 2, 6, 3, 4321
MODELS = ["transformer", "toy"]
PREFETCHES = [1, 2, 5]  # all-gathers in flight ahead: FSDP's default, and deeper ones; 5 spans a block
GATHERS = ["layer", "block"]  # what one collective covers: a layer's weight, or a Transformer block's
TRANSFORMER = get_config("tiny", vocab_size=101, d_model=32, num_heads=4, d_ff=88, context_length=16)


class Linear(nn.Module):
    """Another codebase's own Linear: weight (out, in), applied by einsum, which saves a view of it."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / math.sqrt(d_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...i,oi->...o", x, self.weight)


class Embedding(nn.Module):
    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, width))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight[tokens]


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = Embedding(VOCAB, WIDTH)  # 230 elements
        self.hidden = Linear(WIDTH, WIDTH)  # 100
        self.bias = nn.Parameter(torch.randn(WIDTH))
        self.frozen = Linear(WIDTH, WIDTH).requires_grad_(False)
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)  # torch's, with a bias
        self.head = Linear(WIDTH, VOCAB)
        self.head.weight = self.embed.weight
        with torch.no_grad():  # LayerNorm starts at ones and zeros: make every rank's start differ
            self.norm.weight.normal_()
            self.norm.bias.normal_()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (rows, seq, width)
        x = torch.tanh(self.hidden(x) + self.bias) + self.frozen(x)
        x = x + self.mix(x)
        return self.head(self.norm(x))  # (rows, seq, vocab)


def build(model_name: str, device) -> nn.Module:
    with torch.device(device):
        return TransformerLM(TRANSFORMER) if model_name == "transformer" else ToyModel()


def vocab(model_name: str) -> int:
    return TRANSFORMER.vocab_size if model_name == "transformer" else VOCAB


def batches(model_name: str, device, world_size: int):
    """(step, tokens, targets) of each global batch: world_size * ROWS_PER_RANK rows."""
    data = torch.Generator().manual_seed(SEED)
    for step in range(STEPS):
        tokens = torch.randint(vocab(model_name), (world_size * ROWS_PER_RANK, SEQ + 1), generator=data).to(device)
        yield step, tokens[:, :-1], tokens[:, 1:]


def rows(rank: int) -> slice:
    return slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
