import math

import pytest
import torch

from systems.model import (ATTENTION_BACKENDS, PRESETS, RMSNorm, RotaryEmbedding, TransformerLM,
                           cross_entropy, get_config, naive_attention)
from systems.optim import AdamW
from systems.train import random_batch, train_step

EXPECTED_PARAMETERS = {
    "small": 128_625_408,
    "medium": 423_183_360,
    "large": 969_411_840,
    "xl": 1_998_235_200,
    "2.7b": 3_406_809_600,
}


@pytest.mark.parametrize("preset", EXPECTED_PARAMETERS)
def test_parameter_counts(preset):
    with torch.device("meta"):
        model = TransformerLM(get_config(preset))
    assert model.num_parameters() == EXPECTED_PARAMETERS[preset]


def test_presets_have_cs336_shapes():
    shapes = {name: (c.d_model, c.d_ff, c.num_layers, c.num_heads) for name, c in PRESETS.items()}
    assert shapes["2.7b"] == (2560, 10240, 32, 32) and PRESETS["2.7b"].d_head == 80
    assert shapes["xl"] == (1600, 6400, 48, 25)


@pytest.fixture
def tiny():
    return TransformerLM(get_config("tiny", attention="naive")).double()


def test_logits_shape(tiny):
    tokens, _ = random_batch(tiny.config, 3, 17, torch.device("cpu"))
    assert tiny(tokens).shape == (3, 17, tiny.config.vocab_size)


def test_causality(tiny):
    tokens, _ = random_batch(tiny.config, 2, 32, torch.device("cpu"))
    changed = tokens.clone()
    changed[:, 20:] = (changed[:, 20:] + 1 + torch.randint(100, changed[:, 20:].shape)) % tiny.config.vocab_size
    before, after = tiny(tokens), tiny(changed)
    torch.testing.assert_close(before[:, :20], after[:, :20], rtol=0, atol=0)
    assert not torch.allclose(before[:, 20:], after[:, 20:])


@pytest.mark.parametrize("backend", sorted(set(ATTENTION_BACKENDS) - {"naive", "flash"}))
def test_attention_backends_match_naive(backend):
    q, k, v = (torch.randn(2, 3, 37, 16, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(ATTENTION_BACKENDS[backend](q, k, v), naive_attention(q, k, v))


def test_naive_attention_matches_explicit_loops():
    q, k, v = (torch.randn(1, 1, 5, 4, dtype=torch.float64) for _ in range(3))
    expected = torch.empty_like(q)
    for i in range(5):
        weights = torch.softmax(torch.stack([q[0, 0, i] @ k[0, 0, j] for j in range(i + 1)]) / 2.0, dim=0)
        expected[0, 0, i] = sum(w * v[0, 0, j] for j, w in enumerate(weights))
    torch.testing.assert_close(naive_attention(q, k, v), expected)


def test_rmsnorm_matches_float64_formula():
    norm = RMSNorm(48)
    norm.weight.data = torch.randn(48)
    x = torch.randn(4, 7, 48, dtype=torch.bfloat16) * 30
    x64 = x.double()
    expected = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    out = norm(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(d_head=16, context_length=64, theta=10_000.0)
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    rotated_q = rope(q.expand(1, 1, 64, 16))[0, 0]  # (seq, d_head): q placed at every position
    rotated_k = rope(k.expand(1, 1, 64, 16))[0, 0]
    scores = rotated_q @ rotated_k.T  # scores[m, n] = <q at m, k at n>
    assert scores[10, 3].item() == pytest.approx(scores[40, 33].item(), rel=1e-5)
    assert scores[10, 3].item() != pytest.approx(scores[10, 4].item(), rel=1e-2)
    torch.testing.assert_close(rotated_q[0], q)  # position 0 is not rotated


def test_rope_theta_is_configurable():
    a = RotaryEmbedding(8, 16, theta=10_000.0)
    b = RotaryEmbedding(8, 16, theta=500.0)
    assert not torch.allclose(a.cos, b.cos)


def test_loss_falls_when_overfitting_one_batch():
    model = TransformerLM(get_config("tiny"))
    optimizer = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    tokens, targets = random_batch(model.config, 4, 32, torch.device("cpu"))
    losses = [train_step(model, optimizer, tokens, targets, "fp32").item() for _ in range(40)]
    assert losses[0] == pytest.approx(math.log(model.config.vocab_size), rel=0.2)
    assert losses[-1] < 0.3 * losses[0]


def test_cross_entropy_matches_torch_on_large_logits():
    logits = torch.randn(64, 500, dtype=torch.float32) * 1e4  # exp() alone overflows at ~88
    targets = torch.randint(500, (64,))
    ours = cross_entropy(logits, targets)
    assert torch.isfinite(ours)
    torch.testing.assert_close(ours, torch.nn.functional.cross_entropy(logits.double(), targets).float())


def test_cross_entropy_gradient_matches_torch():
    logits = (torch.randn(8, 3, 50, dtype=torch.float64) * 20).requires_grad_()
    targets = torch.randint(50, (8, 3))
    cross_entropy(logits, targets).backward()
    ours = logits.grad.clone()
    logits.grad = None
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    torch.testing.assert_close(ours, logits.grad)


@pytest.mark.parametrize(
    ("tokens", "error", "match"),
    [
        (torch.randint(100, (2, 8)).float(), TypeError, "int64 or int32"),
        (torch.full((2, 8), 10_000), ValueError, r"\[0, 10000\)"),
        (torch.full((2, 8), -1), ValueError, r"\[0, 10000\)"),
        (torch.randint(100, (2, 257)), ValueError, "exceeds context_length=256"),
        (torch.randint(100, (8,)), ValueError, r"\(batch, seq\)"),
    ],
)
def test_bad_tokens_get_clear_errors(tokens, error, match):
    with pytest.raises(error, match=match):
        TransformerLM(get_config("tiny"))(tokens)


def test_unknown_preset_and_backend_are_rejected():
    with pytest.raises(ValueError, match="unknown preset"):
        get_config("huge")
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_config("tiny", attention="fast")


@pytest.mark.gpu
def test_sdpa_model_matches_naive_on_gpu(exact_fp32_matmuls):
    # The flash backend's counterpart is in test_attention.py.
    device = torch.device("cuda")
    naive = TransformerLM(get_config("tiny", attention="naive")).to(device)
    other = TransformerLM(get_config("tiny", attention="sdpa")).to(device)
    other.load_state_dict(naive.state_dict())
    tokens, targets = random_batch(naive.config, 2, 200, device)
    for model in (naive, other):
        cross_entropy(model(tokens), targets).backward()
    torch.testing.assert_close(other(tokens), naive(tokens), rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(naive.named_parameters(), other.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5, msg=name)
