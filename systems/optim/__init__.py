"""Optimizers: AdamW (adamw.py; one fused Triton launch per step on CUDA, fused_adamw.py), gradient
clipping (clip.py), and ZeRO-1 sharding of any optimizer's state (sharded.py)."""

from systems.optim.adamw import AdamW
from systems.optim.clip import clip_grad_norm
from systems.optim.sharded import ShardedOptimizer

__all__ = ["AdamW", "ShardedOptimizer", "clip_grad_norm"]
