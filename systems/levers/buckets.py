"""DDP's bucket size and how it splits the parameters into buckets: the rule our bucketed DDP
(systems.parallel.ddp) runs and its traffic accounting (systems.accounting.traffic) counts."""

from __future__ import annotations

import math

import torch


def fill_buckets(params: list[torch.Tensor], bucket_size_mb: float | None) -> list[list[torch.Tensor]]:
    """Split `params` (parameters, or tensors of their sizes and dtypes), in order, into runs of at most
    `bucket_size_mb` (one bucket when None).

    A parameter larger than a bucket gets a bucket of its own; a change of dtype starts a new
    bucket, since a bucket is one flat tensor.
    """
    check_bucket_size(bucket_size_mb)
    capacity = math.inf if bucket_size_mb is None else bucket_size_mb * 2**20
    buckets, filled = [], 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        if not buckets or filled + nbytes > capacity or param.dtype != buckets[-1][0].dtype:
            buckets.append([])
            filled = 0
        buckets[-1].append(param)
        filled += nbytes
    return buckets


def check_bucket_size(bucket_size_mb: float | None) -> None:
    if bucket_size_mb is not None and not bucket_size_mb > 0:
        raise ValueError(f"bucket_size_mb must be positive or None, got {bucket_size_mb}")
