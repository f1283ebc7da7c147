"""The reference's AdamW (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01): torch's has that update."""

import functools

import torch

AdamW = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
