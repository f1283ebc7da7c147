"""The time DDP spends after backward, all-reducing gradients in buckets, and its fit to measured steps."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BucketedAllReduce:
    """DDP's time after backward when gradients are all-reduced in equal buckets as they become ready.

    Backward produces `param_bytes` of gradients at a constant rate over `backward_seconds`. Buckets
    all-reduce one at a time, each as soon as its gradients exist and the previous one is done; a
    ring all-reduce of b bytes takes latency + 2·(n-1)/n · b / bandwidth, where bandwidth is the bus
    bandwidth per rank (nccl-tests' busbw).
    """

    backward_seconds: float
    param_bytes: float
    world_size: int
    bandwidth: float  # bytes/s
    latency: float  # seconds per all-reduce call

    def __post_init__(self):
        if self.world_size < 2 or self.bandwidth <= 0 or self.param_bytes <= 0:
            raise ValueError("need world_size >= 2 and positive bandwidth and param_bytes")
        if self.latency < 0 or self.backward_seconds < 0:
            raise ValueError("latency and backward_seconds must be non-negative")

    @property
    def transfer_seconds(self) -> float:
        """Moving all the gradients once through the ring, without latency."""
        return 2 * (self.world_size - 1) / self.world_size * self.param_bytes / self.bandwidth

    def allreduce_seconds(self, nbytes: float) -> float:
        return self.latency + self.transfer_seconds * nbytes / self.param_bytes

    def overhead(self, num_buckets: int) -> float:
        """Seconds from the end of backward to the end of the last all-reduce."""
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be positive, got {num_buckets}")
        interval = self.backward_seconds / num_buckets
        each = self.allreduce_seconds(self.param_bytes / num_buckets)
        # The last bucket waits for backward to end, or the queue of all-reduces outlasts it.
        return max(each, interval + num_buckets * each - self.backward_seconds)

    def optimal_num_buckets(self) -> float:
        """Where the overhead is least: with transfers hidden, buckets small enough that each one's
        all-reduce takes as long as backward takes to fill the next (the handout's assumption);
        when latency dominates, sqrt(backward / latency)."""
        if self.latency == 0:
            return math.inf
        hidden = (self.backward_seconds - self.transfer_seconds) / self.latency
        return max(1.0, hidden, math.sqrt(self.backward_seconds / self.latency))

    def optimal_bucket_bytes(self) -> float:
        return self.param_bytes / self.optimal_num_buckets()


def fit_bucketed_allreduce(*, backward_seconds: float, param_bytes: float, world_size: int,
                           allreduces: list[tuple[float, float]]) -> BucketedAllReduce | None:
    """The bucket model with the latency and bus bandwidth of measured all-reduces, (bytes, seconds) on
    `world_size` ranks: time = latency + ring bytes / busbw, a least-squares line through (ring bytes, time).
    None without two sizes to fit, or where the times do not grow with size."""
    ring = 2 * (world_size - 1) / world_size
    xs, ys = [ring * nbytes for nbytes, _ in allreduces], [seconds for _, seconds in allreduces]
    if len(set(xs)) < 2:
        return None
    x_mean, y_mean = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys)) / sum((x - x_mean) ** 2 for x in xs)
    if slope <= 0:
        return None
    return BucketedAllReduce(backward_seconds=backward_seconds, param_bytes=param_bytes, world_size=world_size,
                             bandwidth=1 / slope, latency=max(0.0, y_mean - slope * x_mean))
