"""The leaderboard harness (systems.leaderboard) runs the handout's step on the handout's inputs with the handout's
loss, times it with do_bench's algorithm, and our model computes the reference's forward on the reference's
weights (here a stand-in written to cs336_basics' documented layout, tests/reference_standin: the real package is
not installed; bench_leaderboard's reference points run it where it is)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from systems.leaderboard import (Reference, course_timing, forward_difference, from_reference_state_dict,
                                 handout_inputs, handout_loss, handout_step, run_leaderboard)
from systems.loss import LMHead
from systems.model import TransformerLM, get_config
from systems.precision import PRECISIONS

STANDIN = Reference("reference_standin")
CONFIG = get_config("tiny", vocab_size=97, d_model=32, num_heads=4, d_ff=48, num_layers=2, context_length=16)
U32 = 2.0**-24


def test_inputs_are_the_handouts_two_draws():
    labels, targets = handout_inputs(97, 2, 16, torch.Generator().manual_seed(5))
    drawn = torch.randint(high=97, size=(2, 2, 16), generator=torch.Generator().manual_seed(5))
    assert labels.shape == targets.shape == (2, 16) and labels.dtype == torch.int64
    assert torch.equal(labels, drawn[0]) and torch.equal(targets, drawn[1])
    assert not torch.equal(labels, targets)


@pytest.mark.parametrize("chunk", [None, 5])
def test_the_loss_is_the_mean_over_every_token(chunk):
    """The course's cross_entropy averages over all batch x context tokens, so `.sum()` of it is that mean: our LM
    head's loss (whole or chunked) under handout_loss must have the mean's value and gradient, (softmax - one-hot)
    / tokens by hand, not the per-token sum's, tokens times larger. The loss's softmax runs in fp32 (systems.loss)
    on float64 inputs: a token's log-sum-exp and the mean over tokens are sums of at most V + tokens terms, within
    2 (V + tokens) u32 of their magnitudes (the logits' largest, plus 1 for a probability)."""
    batch, context, width = 2, 8, 12
    head = LMHead(width, CONFIG.vocab_size).double()
    hidden = torch.randn(batch, context, width, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(CONFIG.vocab_size, (batch, context))
    loss = handout_loss(head(hidden, targets, chunk))
    loss.backward()
    logits = (hidden @ head.weight.T).detach()
    expected = F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), targets.reshape(-1))
    terms = 2 * (CONFIG.vocab_size + batch * context) * U32
    assert abs(loss.item() - expected.item()) <= terms * (logits.abs().max().item() + 1)
    by_hand = (logits.softmax(-1) - F.one_hot(targets, CONFIG.vocab_size)) / (batch * context) @ head.weight.detach()
    tolerance = terms * head.weight.abs().max().item() / (batch * context)
    assert (hidden.grad - by_hand).abs().max().item() <= tolerance
    assert (hidden.grad * batch * context - by_hand).abs().max().item() > 100 * tolerance  # a per-token sum's


def test_the_step_is_the_handouts():
    """zero_grad(set_to_none=True), forward and loss, backward, FSDP's synchronization, optimizer step: in order,
    with no gradient left from the last step when the forward runs."""
    calls = []

    class Model(torch.nn.Linear):
        def forward(self, x):
            calls.append(("forward", all(p.grad is None for p in self.parameters())))
            return super().forward(x)

        def finish_gradient_synchronization(self):
            calls.append(("finish", all(p.grad is not None for p in self.parameters())))

    class Optimizer(torch.optim.SGD):
        def zero_grad(self, set_to_none=True):
            calls.append(("zero_grad", set_to_none))
            super().zero_grad(set_to_none)

        def step(self, closure=None):
            calls.append(("step", None))
            return super().step(closure)

    model = Model(3, 1)
    optimizer = Optimizer(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    step = handout_step(model, optimizer, lambda: model(x).square().mean())
    step()
    step()
    assert calls == [("zero_grad", True), ("forward", True), ("finish", True), ("step", None)] * 2


def test_course_timing_runs_do_benchs_counts():
    """One untimed step, five to estimate, then warmup / estimate and rep / estimate steps (at least one each)."""
    steps = []

    def step():  # a millisecond at least
        steps.append(1)
        time.sleep(1e-3)
    timing = course_timing(step, rep_ms=20, warmup_ms=10, device=torch.device("cpu"))
    assert len(steps) == 1 + 5 + timing.warmup_steps + len(timing.times_ms)
    assert 1 < timing.warmup_steps <= 10 and 1 < len(timing.times_ms) <= 20
    once = course_timing(lambda: None, rep_ms=1e-9, warmup_ms=1e-9, device=torch.device("cpu"))
    assert once.warmup_steps == len(once.times_ms) == 1
    assert once.mean_ms == once.times_ms[0]


@pytest.mark.parametrize("source", [STANDIN, Reference()], ids=["standin", "cs336_basics"])
def test_the_mapping_gives_our_model_the_references_forward(source):
    """float64 on the stand-in's weights. The reference computes its RoPE table in fp32 (angles t theta^-d rounded
    twice, cos and sin once): each entry within (4 ctx + 1) u32 of ours (rounded once from float64); q and k move
    by twice that relatively, a score by four times, and softmax and two blocks' residual paths at most
    quadruple it each: 64 ctx u32 of the logits' scale. A mapping that stacks the projections in another order
    (k before q) must exceed it a hundredfold. The course's own package where it is importable."""
    pytest.importorskip(f"{source.package}.model", reason=f"{source.package} is not installed here")
    reference = source.model(CONFIG).double()
    tokens = torch.randint(CONFIG.vocab_size, (2, CONFIG.context_length))
    tolerance = 64 * CONFIG.context_length * U32
    assert forward_difference(reference, CONFIG, tokens) <= tolerance
    swapped = {name.replace("q_proj", "tmp").replace("k_proj", "q_proj").replace("tmp", "k_proj"): tensor
               for name, tensor in reference.state_dict().items()}
    ours = TransformerLM(CONFIG).double()
    ours.load_state_dict(from_reference_state_dict(swapped))
    with torch.no_grad():
        theirs = reference(tokens)
        assert ((ours(tokens) - theirs).abs().max() / theirs.abs().max()).item() > 100 * tolerance


def test_the_mapping_names_every_parameter():
    state = STANDIN.model(CONFIG).state_dict()
    mapped = from_reference_state_dict(state)
    assert mapped.keys() == TransformerLM(CONFIG).state_dict().keys()
    with pytest.raises(KeyError, match="no name of ours"):
        from_reference_state_dict(state | {"layers.0.attn.bias": torch.zeros(1)})
    with pytest.raises(KeyError, match="lacks v_proj"):
        from_reference_state_dict({k: v for k, v in state.items() if k != "layers.1.attn.v_proj.weight"})


@pytest.mark.parametrize("model", ["ours", "reference"])
def test_the_harness_runs_on_two_ranks(rank_pools, model):
    """Our model and the stand-in reference under our FSDP on 2 gloo ranks, bf16 compute, the handout's batch of 2."""
    ranks = rank_pools.run(2, "gloo", run_leaderboard, "ours" if model == "ours" else "reference", CONFIG,
                           PRECISIONS["bf16"], 2, 5.0, 2.0, STANDIN, timeout=120)
    timings = [rank["timing"] for rank in ranks]
    assert {timing.timer for timing in timings} == {"do_bench's algorithm on the host clock"}
    assert len({len(timing.times_ms) for timing in timings}) == 1  # the ranks agreed on the step counts
    assert ranks[0]["first_loss"] == ranks[1]["first_loss"]
    # A fresh model's loss on uniformly random tokens: near log(vocab), the mean over tokens (a per-token sum
    # would be 32 times it).
    assert abs(ranks[0]["first_loss"] - torch.log(torch.tensor(97.0)).item()) < 1.5
