"""Whole-model comparisons against float64 that the kernels' and compilation's tests share: a computation's error
within a multiple of plain PyTorch's, as tests/attention_cases.py allows FlashAttention's.

Where another fp32 computation of the same function (fused kernels, compiled graphs: other orders of the same
sums, ops fused that eager rounds apart) runs through a whole model, no per-element bound is derivable; its error
is measured against eager fp32's instead, tensor by tensor in norm: at most PLAIN_ERROR_MULTIPLE times that, plus
FLOOR_ULPS fp32 roundings of every value (for a value eager happens to round less, such as a loss one ulp apart).
"""

import torch

from attention_cases import FLOOR_ULPS, PLAIN_ERROR_MULTIPLE

U32 = 2.0**-24


def check_near_plain(actual: list[torch.Tensor], plain: list[torch.Tensor], expected: list[torch.Tensor],
                     where: str = "") -> None:
    """Each of `actual` against float64's `expected`, within the rule above of eager fp32's `plain`."""
    for index, (value, plain_value, exact) in enumerate(zip(actual, plain, expected, strict=True)):
        exact = exact.double()
        error, plain_error = (torch.linalg.vector_norm(t.double() - exact).item() for t in (value, plain_value))
        allowed = PLAIN_ERROR_MULTIPLE * plain_error + FLOOR_ULPS * U32 * torch.linalg.vector_norm(exact).item()
        assert error <= allowed, f"{where}tensor {index}: error {error:.2e} exceeds {allowed:.2e}"
