import dataclasses
import json
import math

import pytest
import torch

from systems.attention import BACKENDS, naive_attention
from systems.loss import cross_entropy
from systems.model import (EDITIONS, Attention, RMSNorm, RotaryEmbedding, SwiGLU, TransformerBlock,
                           TransformerConfig, TransformerLM, check_id_range, get_config)
from systems.optim import AdamW
from systems.precision import PRECISIONS
from systems.step import check_batch, random_batch, train_step

# Every preset of every edition, the untied embedding and LM head included: with vocabulary V, width d,
# d_ff f and L blocks, L (4d² + 3df + 2d) (attention's four projections, SwiGLU's three, two norms) + 2Vd + d.
EXPECTED_PARAMETERS = {
    # 2 (4·64² + 3·64·256 + 128) = 2 · 65,664 = 131,328; + 2·10,000·64 = 1,280,000; + 64
    ("2025", "tiny"): 1_411_392,
    # 12 (4·768² + 3·768·3072 + 1536) = 12 · 9,438,720 = 113,264,640; + 15,360,000 + 768
    ("2025", "small"): 128_625_408,
    # 24 (4·1024² + 3·1024·4096 + 2048) = 24 · 16,779,264 = 402,702,336; + 20,480,000 + 1024
    ("2025", "medium"): 423_183_360,
    # 36 (4·1280² + 3·1280·5120 + 2560) = 36 · 26,216,960 = 943,810,560; + 25,600,000 + 1280
    ("2025", "large"): 969_411_840,
    # 48 (4·1600² + 3·1600·6400 + 3200) = 48 · 40,963,200 = 1,966,233,600; + 32,000,000 + 1600
    ("2025", "xl"): 1_998_235_200,
    # 32 (4·2560² + 3·2560·10240 + 5120) = 32 · 104,862,720 = 3,355,607,040; + 51,200,000 + 2560
    ("2025", "2.7b"): 3_406_809_600,
    # 34 (4·4096² + 3·4096·11008 + 8192) = 34 · 202,383,360 = 6,881,034,240;
    # + 2·151,936·4096 = 1,244,659,712; + 4096
    ("2025", "leaderboard-2026"): 8_125_698_048,
    # 4 (4·128² + 3·128·344 + 256) = 4 · 197,888 = 791,552; + 2·4748·128 = 1,215,488; + 128
    ("2025", "leaderboard-2026-tiny"): 2_007_168,
    # 2026: small, medium and large as in 2025; its xl is 2025's 2.7b.
    ("2026", "tiny"): 1_411_392,
    ("2026", "small"): 128_625_408,
    ("2026", "medium"): 423_183_360,
    ("2026", "large"): 969_411_840,
    ("2026", "xl"): 3_406_809_600,
    # 50 (4·4608² + 3·4608·12288 + 9216) = 50 · (84,934,656 + 169,869,312 + 9216) = 50 · 254,813,184
    # = 12,740,659,200; + 2·10,000·4608 = 92,160,000; + 4608
    ("2026", "10B"): 12_832_823_808,
    ("2026", "leaderboard-2026"): 8_125_698_048,
    ("2026", "leaderboard-2026-tiny"): 2_007_168,
}
ALL_PRESETS = [(edition, name) for edition, presets in EDITIONS.items() for name in presets]


def test_every_preset_has_its_parameter_count_written_out():
    assert sorted(EXPECTED_PARAMETERS) == sorted(ALL_PRESETS)


@pytest.mark.parametrize(("edition", "preset"), EXPECTED_PARAMETERS)
def test_parameter_counts(edition, preset):
    with torch.device("meta"):
        model = TransformerLM(get_config(preset, edition))
    assert model.num_parameters() == EXPECTED_PARAMETERS[edition, preset]


def shape(config):
    return config.d_model, config.d_ff, config.num_layers, config.num_heads, config.vocab_size, config.context_length


def test_presets_have_each_editions_table():
    """Table 1 of each handout (d_model, d_ff, layers, heads), vocabulary 10,000; 2026 says context 512."""
    assert {name: shape(get_config(name, "2025")) for name in ("small", "medium", "large", "xl", "2.7b")} == {
        "small": (768, 3072, 12, 12, 10_000, 1024), "medium": (1024, 4096, 24, 16, 10_000, 1024),
        "large": (1280, 5120, 36, 20, 10_000, 1024), "xl": (1600, 6400, 48, 25, 10_000, 1024),
        "2.7b": (2560, 10240, 32, 32, 10_000, 1024)}
    assert {name: shape(get_config(name, "2026")) for name in ("small", "medium", "large", "xl", "10B")} == {
        "small": (768, 3072, 12, 12, 10_000, 512), "medium": (1024, 4096, 24, 16, 10_000, 512),
        "large": (1280, 5120, 36, 20, 10_000, 512), "xl": (2560, 10240, 32, 32, 10_000, 512),
        "10B": (4608, 12288, 50, 36, 10_000, 512)}
    assert get_config("xl", "2026").d_head == 80 and get_config("10B", "2026").d_head == 128


def test_the_default_edition_is_2025():
    """Preset names saved before editions existed keep meaning 2025's models."""
    assert get_config("xl") == get_config("xl", "2025") == EDITIONS["2025"]["xl"]
    assert get_config("xl").d_model == 1600


@pytest.mark.parametrize("name", ["tiny", "leaderboard-2026", "leaderboard-2026-tiny"])
def test_presets_outside_the_course_tables_are_in_both_editions(name):
    assert get_config(name, "2025") == get_config(name, "2026")


@pytest.mark.parametrize(("edition", "preset"), ALL_PRESETS)
def test_a_config_records_its_model_whatever_its_name(edition, preset):
    """A history stores dataclasses.asdict(config) as JSON: the record survives JSON and builds the same config
    again (JSON's list back to the checkpoint tuple), and holds no name or edition, so one model has one record."""
    config = get_config(preset, edition)
    record = json.loads(json.dumps(dataclasses.asdict(config)))
    assert TransformerConfig(**{**record, "checkpoint": tuple(record["checkpoint"])}) == config


def test_records_tell_apart_what_names_confuse():
    """2026's xl is 2025's 2.7b (up to the context the 2026 handout defaults to); the two xl differ."""
    same = dataclasses.asdict(get_config("xl", "2026", context_length=1024))
    assert same == dataclasses.asdict(get_config("2.7b", "2025"))
    assert dataclasses.asdict(get_config("xl", "2026")) != dataclasses.asdict(get_config("xl", "2025"))


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


@pytest.mark.parametrize("backend", sorted(set(Attention) - {"naive", "flash"}))
def test_attention_backends_match_naive(backend):
    q, k, v = (torch.randn(2, 3, 37, 16, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(BACKENDS[backend](q, k, v, True), naive_attention(q, k, v, True))


def test_naive_attention_matches_explicit_loops():
    q, k, v = (torch.randn(1, 1, 5, 4, dtype=torch.float64) for _ in range(3))
    expected = torch.empty_like(q)
    for i in range(5):
        weights = torch.softmax(torch.stack([q[0, 0, i] @ k[0, 0, j] for j in range(i + 1)]) / 2.0, dim=0)
        expected[0, 0, i] = sum(w * v[0, 0, j] for j, w in enumerate(weights))
    torch.testing.assert_close(naive_attention(q, k, v, True), expected)


def rmsnorm_formula(x, weight, eps=1e-5):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_formula(x, theta):
    """Pair (2i, 2i+1) at position m turned by the angle m * theta^(-2i / d_head), element by element."""
    seq, d_head = x.shape[-2:]
    out = torch.empty_like(x)
    for m in range(seq):
        for i in range(d_head // 2):
            angle = m * theta ** (-2 * i / d_head)
            even, odd = x[..., m, 2 * i], x[..., m, 2 * i + 1]
            out[..., m, 2 * i] = even * math.cos(angle) - odd * math.sin(angle)
            out[..., m, 2 * i + 1] = even * math.sin(angle) + odd * math.cos(angle)
    return out


def swiglu_formula(x, w1, w2, w3):
    gate = x @ w1.T
    return (gate * torch.sigmoid(gate) * (x @ w3.T)) @ w2.T


# fp32: the rounding of a mean of 48 squares, a square root and two products, well under 1e-5. bf16: that
# result rounded once to 8 significant bits, at most 2**-8 relative.
@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float32, 1e-5), (torch.bfloat16, 2**-8 + 1e-5)])
def test_rmsnorm_matches_float64_formula(dtype, rtol):
    norm = RMSNorm(48)
    norm.weight.data = torch.randn(48)
    # Rows from 1e-4 to 10: mean(x²) from far below eps = 1e-5 to far above it.
    x = (torch.randn(4, 7, 48) * torch.logspace(-4, 1, 7).view(7, 1)).to(dtype)
    out = norm(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), rmsnorm_formula(x.double(), norm.weight.double()), rtol=rtol, atol=0)


def test_rope_matches_float64_formula():
    rope = RotaryEmbedding(d_head=8, context_length=64, theta=500.0)
    x = torch.randn(2, 3, 50, 8, dtype=torch.float64)
    # The tables are fp32: their rounding, relative to the O(1) outputs.
    torch.testing.assert_close(rope(x), rope_formula(x, 500.0), rtol=0, atol=1e-6)


def test_swiglu_matches_float64_formula():
    ffn = SwiGLU(32, 80).double()
    x = torch.randn(3, 5, 32, dtype=torch.float64)
    expected = swiglu_formula(x, ffn.w1.weight, ffn.w2.weight, ffn.w3.weight)
    torch.testing.assert_close(ffn(x), expected)


def test_block_matches_float64_formula():
    """A pre-norm block written out from its weights: norms, heads, RoPE on q and k, causal softmax, residuals."""
    config = get_config("tiny", attention="sdpa", rope_theta=1000.0)
    block = TransformerBlock(config).double()
    for norm in (block.attn_norm, block.ffn_norm):
        norm.weight.data = torch.rand(config.d_model, dtype=torch.float64) + 0.5
    x = torch.randn(2, 40, config.d_model, dtype=torch.float64)
    batch, seq, heads, d_head = 2, 40, config.num_heads, config.d_head

    h = rmsnorm_formula(x, block.attn_norm.weight)
    q, k, v = (t.view(batch, seq, heads, d_head).transpose(1, 2) for t in (h @ block.attn.qkv.weight.T).chunk(3, -1))
    q, k = rope_formula(q, 1000.0), rope_formula(k, 1000.0)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(d_head)).masked_fill(torch.ones(seq, seq).triu(1).bool(), -math.inf)
    attended = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(batch, seq, config.d_model)
    mid = x + attended @ block.attn.out.weight.T
    h = rmsnorm_formula(mid, block.ffn_norm.weight)
    expected = mid + swiglu_formula(h, block.ffn.w1.weight, block.ffn.w2.weight, block.ffn.w3.weight)
    # fp32 RoPE tables, as above.
    torch.testing.assert_close(block(x), expected, rtol=0, atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(d_head=16, context_length=64, theta=10_000.0)
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    rotated_q = rope(q.expand(1, 1, 64, 16))[0, 0]  # (seq, d_head): q placed at every position
    rotated_k = rope(k.expand(1, 1, 64, 16))[0, 0]
    scores = rotated_q @ rotated_k.T  # scores[m, n] = <q at m, k at n>
    assert scores[10, 3].item() == pytest.approx(scores[40, 33].item(), rel=1e-5)
    assert scores[10, 3].item() != pytest.approx(scores[10, 4].item(), rel=1e-2)
    torch.testing.assert_close(rotated_q[0], q)  # position 0 is not rotated


def test_loss_falls_when_overfitting_one_batch():
    # Tiny's model with a tenth of its vocabulary, whose LM head would take most of the time, and fewer steps: the
    # loss crosses the bar about as late among them as tiny's does.
    model = TransformerLM(get_config("tiny", vocab_size=1000))
    optimizer = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    tokens, targets = random_batch(model.config, 4, 32, torch.device("cpu"))
    losses = [train_step(model, optimizer, tokens, targets, PRECISIONS["fp32"]).item() for _ in range(28)]
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
        (torch.randint(100, (2, 257)), ValueError, "exceeds context_length=256"),
        (torch.randint(100, (8,)), ValueError, r"\(batch, seq\)"),
    ],
)
@pytest.mark.parametrize("check_ids", [False, True])
def test_bad_token_shapes_get_clear_errors(tokens, error, match, check_ids):
    with pytest.raises(error, match=match):
        TransformerLM(get_config("tiny", check_ids=check_ids))(tokens)


@pytest.mark.parametrize("bad_id", [10_000, -1])
def test_out_of_range_token_ids_get_a_clear_error_in_debug_mode(bad_id):
    tokens, targets = (t.clone() for t in random_batch(get_config("tiny"), 2, 8, torch.device("cpu")))  # no views
    tokens[1, 5] = bad_id
    with pytest.raises(ValueError, match=r"^token ids must lie in \[0, 10000\)"):
        TransformerLM(get_config("tiny", check_ids=True))(tokens)
    with pytest.raises(ValueError, match=r"^token ids must lie in \[0, 10000\)"):
        check_batch(tokens, targets, 10_000)
    with pytest.raises(IndexError):  # unchecked, the CPU embedding still refuses it (a GPU's asserts)
        TransformerLM(get_config("tiny"))(tokens)


@pytest.mark.parametrize("bad_id", [10_000, -1])
@pytest.mark.parametrize("loss_chunk", [None, 4])
def test_out_of_range_target_ids_get_a_clear_error_in_debug_mode(bad_id, loss_chunk):
    """An id equal to the vocabulary's size, or negative, in the targets of either loss."""
    tokens, targets = (t.clone() for t in random_batch(get_config("tiny"), 2, 8, torch.device("cpu")))  # no views
    targets[0, 3] = bad_id
    with pytest.raises(ValueError, match=r"^target ids must lie in \[0, 10000\)"):
        TransformerLM(get_config("tiny", check_ids=True, loss_chunk=loss_chunk))(tokens, targets)
    with pytest.raises(ValueError, match=r"^target ids must lie in \[0, 10000\)"):
        check_batch(tokens, targets, 10_000)
    with pytest.raises((IndexError, RuntimeError)):  # unchecked: torch's error from deep inside the loss
        TransformerLM(get_config("tiny", loss_chunk=loss_chunk))(tokens, targets)


@pytest.mark.parametrize("loss_chunk", [None, 4])
def test_targets_of_another_shape_than_the_tokens_are_an_error(loss_chunk):
    """Always checked, at the loss's entry: (2, 15) targets for (2, 16) tokens would otherwise label 15 of each
    row's 16 positions."""
    model = TransformerLM(get_config("tiny", loss_chunk=loss_chunk))
    tokens, targets = random_batch(model.config, 2, 16, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"targets must be one id per row of the \w+( states)?: \(2, 16\), got "
                                         r"targets of shape \(2, 15\)"):
        model(tokens, targets[:, :15])
    with pytest.raises(ValueError, match=r"of one shape, got \(2, 16\) and \(2, 15\)"):
        check_batch(tokens, targets[:, :15], 10_000)


def test_check_batch_takes_a_good_batch_and_id_ranges_anywhere():
    tokens, targets = random_batch(get_config("tiny"), 3, 5, torch.device("cpu"))
    check_batch(tokens, targets, 10_000)
    check_id_range(torch.tensor([0, 9999]), 10_000)
    with pytest.raises(ValueError, match=r"^token ids must lie in \[0, 10000\), got ids from 0 to 10000$"):
        check_id_range(torch.tensor([0, 10_000]), 10_000)
    with pytest.raises(ValueError, match=r"\(batch, seq\)"):
        check_batch(tokens.flatten(), targets.flatten(), 10_000)


def test_forward_compiles_to_one_graph():
    """No range check on the hot path: it would read the ids back to the host and break the graph."""
    model = TransformerLM(get_config("tiny"))
    tokens, _ = random_batch(model.config, 2, 16, torch.device("cpu"))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(tokens), model(tokens))


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
@pytest.mark.parametrize("shape", [(0, 8), (2, 0)], ids=["no-sequences", "no-tokens"])
def test_empty_batch_gives_empty_logits(attention, shape):
    model = TransformerLM(get_config("tiny", attention=attention))
    logits = model(torch.randint(100, shape))
    assert logits.shape == (*shape, model.config.vocab_size)
    logits.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_cross_entropy_of_no_targets_is_an_error():
    """Its mean over nothing would be NaN."""
    with pytest.raises(ValueError, match="at least one target"):
        cross_entropy(torch.randn(2, 0, 50), torch.zeros(2, 0, dtype=torch.int64))


@pytest.mark.parametrize(("field", "value", "error"), [
    ("num_layers", 0, ValueError),
    ("num_layers", -1, ValueError),
    ("num_heads", 0, ValueError),
    ("d_model", 0, ValueError),
    ("d_ff", -4, ValueError),
    ("vocab_size", 0, ValueError),
    ("context_length", 0, ValueError),
    ("d_model", "64", TypeError),
    ("d_model", 64.0, TypeError),
    ("num_heads", True, TypeError),
    ("rope_theta", 0.0, ValueError),
    ("rope_theta", -10_000.0, ValueError),
    ("rope_theta", math.inf, ValueError),
    ("rope_theta", math.nan, ValueError),
    ("rope_theta", "10000", TypeError),
    ("check_ids", 1, TypeError),
    ("loss_chunk", 0, ValueError),
    ("loss_chunk", 2.5, TypeError),
    ("loss_chunk", True, TypeError),
])
def test_bad_config_fields_are_rejected_by_name(field, value, error):
    with pytest.raises(error, match=f"^{field} must") as caught:
        get_config("tiny", **{field: value})
    assert str(value) in str(caught.value)


def test_unknown_preset_and_backend_are_rejected():
    with pytest.raises(ValueError, match="unknown preset 'huge'") as caught:
        get_config("huge")
    for edition, presets in EDITIONS.items():  # both editions' names listed
        assert f"{edition}: {', '.join(presets)}" in str(caught.value)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_config("tiny", attention="fast")


@pytest.mark.parametrize(("preset", "edition", "other"), [("10B", "2025", "2026"), ("2.7b", "2026", "2025")])
def test_a_preset_of_the_other_edition_says_which(preset, edition, other):
    with pytest.raises(ValueError, match=f"^'{preset}' is a {other} preset; pass edition='{other}'$"):
        get_config(preset, edition)


@pytest.mark.parametrize(("edition", "error", "match"), [
    ("2024", ValueError, "unknown edition '2024'; choose from '2025', '2026'"),
    (2026, TypeError, "edition must be a string such as '2026', got 2026"),
])
def test_unknown_edition_is_rejected(edition, error, match):
    with pytest.raises(error, match=f"^{match}$"):
        get_config("xl", edition)


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
