"""Per-process speed of a sub-millisecond GPU point (docs/gate-error-rates.md): this process times the (1, 1024,
64) bf16 causal forward through our Triton kernel, 5 blocks of 100 synchronized calls after 20 of warm-up, and
prints LABEL, its CPU affinity and each block's median in ms. jobs/process_offsets.sh starts many such processes."""
import os
import statistics
import sys
import time

import torch

from systems.attention import FlashAttentionTriton

q, k, v = (torch.randn(1, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(20):
    FlashAttentionTriton.apply(q, k, v, True)
    torch.cuda.synchronize()
medians = []
for _ in range(5):
    times = []
    for _ in range(100):
        start = time.perf_counter()
        FlashAttentionTriton.apply(q, k, v, True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    medians.append(statistics.median(times) * 1e3)
cores = os.sched_getaffinity(0)
print(sys.argv[1], sorted(cores) if len(cores) < os.cpu_count() else "all", " ".join(f"{m:.4f}" for m in medians))
