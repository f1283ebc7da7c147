"""The means FSDP and tensor parallelism reduce with are one process's arithmetic: the ranks' terms summed in rank
order, then divided, on gloo (any number of ranks) and on NCCL (2 ranks, whose two-term sum no order changes).

The inputs are fp16 subnormals, odd multiples of the smallest (2^-24): a mean that divides each term by N before
summing (what ReduceOp.AVG does) rounds every half of an odd multiple to even and loses the last bit, which a
mean of summed terms keeps. Each rank draws its own (the seed is its rank), and the test draws them again to
compute the expected means in one process."""

import torch
import torch.distributed as dist

from layout_reference import mean_in_order
from spawned_ranks import results_by_rank
from systems.parallel.collectives import all_reduce_mean, reduce_scatter_mean
from systems.parallel.ranks import rank_device

TINY = 2.0**-24  # the smallest fp16 subnormal
SIZE = 64  # elements per chunk


def terms(rank: int, numel: int) -> torch.Tensor:
    """Rank `rank`'s fp16 subnormals: odd multiples of 2^-24, at most 1023 of them (the subnormal range)."""
    odd = 2 * torch.randint(0, 512, (numel,), generator=torch.Generator().manual_seed(rank)) + 1
    return (odd.double() * TINY).half()


def reduce_on_every_rank() -> dict:
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    full = terms(rank, world * SIZE).to(device)
    mean = full.clone()
    all_reduce_mean(mean, "test").wait()
    chunk = torch.empty(SIZE, dtype=full.dtype, device=device)
    reduce_scatter_mean([chunk], [full], "test").wait()
    return {"all_reduce": mean.cpu(), "reduce_scatter": chunk.cpu()}


def one_process_mean(world: int) -> torch.Tensor:
    """The ranks' terms summed in rank order, then divided, in fp16 as the ranks compute it."""
    return mean_in_order([terms(rank, world * SIZE) for rank in range(world)])


results = results_by_rank("results", reduce_on_every_rank, gloo_world_sizes=(2, 3), timeout=120)


def test_all_reduce_mean_is_the_rank_ordered_sum_divided(results):
    expected = one_process_mean(len(results))
    assert (expected != 0).all()  # the sums do not underflow: a lost bit shows
    for rank, result in enumerate(results):
        assert torch.equal(result["all_reduce"], expected), f"rank {rank}"


def test_reduce_scatter_mean_gives_each_rank_its_chunk_of_that_mean(results):
    expected = one_process_mean(len(results)).view(len(results), SIZE)
    for rank, result in enumerate(results):
        assert torch.equal(result["reduce_scatter"], expected[rank]), f"rank {rank}"


def test_dividing_each_term_first_would_lose_bits_here():
    """Guards the two tests above: on these inputs AVG's premultiplied terms round (2 ranks), so it cannot pass."""
    premultiplied = terms(0, SIZE) / 2 + terms(1, SIZE) / 2
    assert not torch.equal(premultiplied, (terms(0, SIZE) + terms(1, SIZE)) / 2)

