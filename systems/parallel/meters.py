"""What a training step is measured with: a clock marked between its phases, peak memory at named moments, and
the gathered weights FSDP holds.

The clock reads its CUDA events only when asked for the seconds, after the run, so marking a phase adds
no host sync.
"""

from __future__ import annotations

import time

import torch

from systems.device import synchronize


class PhaseClock:
    """Timestamps between the phases of a step: CUDA events on a GPU, the wall clock on a CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.marks = []

    def mark(self) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Seconds between consecutive marks."""
        synchronize(self.device)
        if self.device.type == "cuda":
            return [start.elapsed_time(end) / 1e3 for start, end in zip(self.marks, self.marks[1:])]
        return [end - start for start, end in zip(self.marks, self.marks[1:])]


class PeakMeter:
    """Peak MiB allocated on a GPU between a reset and each named moment; nothing elsewhere."""

    def __init__(self, device: torch.device):
        self.device = device
        self.mb: dict[str, float] = {}
        self.reset()

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def mark(self, moment: str) -> None:
        """Record the peak since the last reset as `moment`, and reset."""
        if self.device.type == "cuda":
            self.mb[moment] = torch.cuda.max_memory_allocated(self.device) / 2**20
        self.reset()


class GatheredMemory:
    """Bytes of gathered weights FSDP holds now, and the most it held at once. Autograd holds none of them
    (placeholders stand in), so once FSDP lets one go the allocator has it back; a collective's work object
    may keep its buffer a moment longer, which is why this counts what FSDP holds rather than live storage."""

    def __init__(self):
        self.bytes = self.peak = 0

    def add(self, tensor: torch.Tensor) -> None:
        self.bytes += tensor.nbytes
        self.peak = max(self.peak, self.bytes)

    def remove(self, tensor: torch.Tensor) -> None:
        self.bytes -= tensor.nbytes
