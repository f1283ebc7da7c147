"""Optimizers: AdamW (one fused Triton launch per step on CUDA), gradient clipping, and a ZeRO-1 sharded optimizer."""

from systems.optim.adamw import AdamW, ShardedOptimizer, clip_grad_norm

__all__ = ["AdamW", "ShardedOptimizer", "clip_grad_norm"]
