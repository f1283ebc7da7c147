"""Why the course's fp32 FSDP test (`torch.equal` between one process over the whole batch and two ranks over its
halves) cannot hold everywhere: a gradient is a sum over the batch's rows, and float addition is not associative.
One process sums all the rows in whatever order its matmul kernel takes; two ranks each sum their half and the
collective adds the two sums. Both are within rounding of the exact sum, not equal to each other
(docs/course-fsdp-test.md). What is exact is a reference that computes each half's gradient as its rank does and
adds them in rank order, the one tests/test_fsdp.py compares with.

Rows: 40, halves of 20, so that neither half is a multiple of a kernel's usual blocking of the summed dimension.
A mean over 40 rows and a mean over 20 rows of the same values scale by 1/40 and 2/40: fl(c/20) = 2 fl(c/40)
exactly, as are the halving of the two ranks' sum, so only the order of the additions differs.
"""

import copy

import torch
import torch.nn as nn

ROWS, WIDTH, OUT, DRAWS = 40, 24, 24, 5
U32 = 2.0**-24  # fp32's unit roundoff


def gamma(n: int) -> float:
    """Higham's bound on the relative error of a dot product of n terms in any order: n u / (1 - n u)."""
    return n * U32 / (1 - n * U32)


def weight_gradient(linear: nn.Linear, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The gradient of a mean over rows of (linear(x) * c).sum(-1): (c / rows).T @ x, the sum over rows."""
    linear.weight.grad = None
    ((linear(x) * c).sum() / len(x)).backward()
    return linear.weight.grad


def test_whole_batch_and_two_halves_differ_within_rounding():
    """On some of a handful of fresh draws the whole batch's gradient and the mean of its halves' differ (by an ulp
    or a few), never by more than the two sums' rounding: each is within gamma(40) of the exact sum (a sum of 20
    terms plus one addition, gamma(21), for the halves), so they are within twice that of each other."""
    linear = nn.Linear(WIDTH, OUT, bias=False)
    differing = []
    for _ in range(DRAWS):
        x, c = torch.randn(ROWS, WIDTH), torch.randn(ROWS, OUT)
        whole = weight_gradient(linear, x, c).clone()
        halves = (weight_gradient(linear, x[:ROWS // 2], c[:ROWS // 2])
                  + weight_gradient(linear, x[ROWS // 2:], c[ROWS // 2:])) / 2
        terms = (c / ROWS).double().abs().T @ x.double().abs()  # the sum of |terms| of each element
        difference = (whole.double() - halves.double()).abs()
        assert (difference <= 2 * gamma(ROWS) * terms).all()
        differing.append((int((difference > 0).sum()), float(difference.max())))
    assert any(count > 0 for count, _ in differing), f"(elements differing, largest difference) by draw: {differing}"


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(WIDTH, OUT), nn.Linear(OUT, OUT)

    def loss(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (self.second(torch.tanh(self.first(x))) * c).sum() / len(x)


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_halves_summed_in_rank_order_reproduce_two_ranks_exactly():
    """Two ranks emulated in one process (each its own copy of the model and its half, then the collective's sum in
    rank order and the halving) against one model accumulating the halves' gradients in rank order: equal bit for
    bit, on every parameter, while the whole batch's gradient differs on some."""
    model = TwoLayers()
    x, c = torch.randn(ROWS, WIDTH), torch.randn(ROWS, OUT)
    halves = [(x[:ROWS // 2], c[:ROWS // 2]), (x[ROWS // 2:], c[ROWS // 2:])]

    by_rank = []
    for rows in halves:
        rank = copy.deepcopy(model)
        rank.loss(*rows).backward()
        by_rank.append(gradients(rank))
    reduced = {name: (by_rank[0][name] + by_rank[1][name]) / 2 for name in by_rank[0]}

    reference = copy.deepcopy(model)
    for rows in halves:  # .grad accumulates: rank 0's, plus rank 1's
        reference.loss(*rows).backward()
    accumulated = {name: grad / 2 for name, grad in gradients(reference).items()}

    whole = copy.deepcopy(model)
    whole.loss(x, c).backward()
    assert all(torch.equal(accumulated[name], reduced[name]) for name in reduced)
    assert not all(torch.equal(grad, reduced[name]) for name, grad in gradients(whole).items())
