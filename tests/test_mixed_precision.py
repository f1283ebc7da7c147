"""The handout's mixed-precision questions, answered by executable checks."""

import pytest
import torch
import torch.nn as nn


class ToyModel(nn.Module):
    def __init__(self, in_features: int = 10, out_features: int = 5):
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x):
        self.fc1_out = self.fc1(x)
        self.ln_out = self.ln(self.relu(self.fc1_out))
        return self.fc2(self.ln_out)


def autocast_dtypes(device: str, dtype: torch.dtype) -> dict:
    model = ToyModel().to(device)
    x = torch.randn(8, 10, device=device)
    with torch.autocast(device, dtype=dtype):
        params = {p.dtype for p in model.parameters()}
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, torch.randint(5, (8,), device=device))
    loss.backward()
    return dict(params=params, fc1=model.fc1_out.dtype, ln=model.ln_out.dtype, logits=logits.dtype,
                loss=loss.dtype, grads={p.grad.dtype for p in model.parameters()})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_autocast_dtypes(dtype):
    assert autocast_dtypes("cuda", dtype) == dict(params={torch.float32}, fc1=dtype, ln=torch.float32,
                                                  logits=dtype, loss=torch.float32, grads={torch.float32})


def test_cpu_autocast_dtypes():
    # CPU autocast has no fp32 rule for layer_norm: the LayerNorm output stays bf16 there.
    bf16 = torch.bfloat16
    assert autocast_dtypes("cpu", bf16) == dict(params={torch.float32}, fc1=bf16, ln=bf16,
                                                logits=bf16, loss=torch.float32, grads={torch.float32})


def test_accumulation_error_ordering():
    """Summing 0.01 a thousand times: the accumulator's precision decides the error."""
    exact = 10.0
    fp32 = torch.tensor(0.0, dtype=torch.float32)
    fp16 = torch.tensor(0.0, dtype=torch.float16)
    mixed = torch.tensor(0.0, dtype=torch.float32)
    for _ in range(1000):
        fp32 += torch.tensor(0.01, dtype=torch.float32)
        fp16 += torch.tensor(0.01, dtype=torch.float16)
        mixed += torch.tensor(0.01, dtype=torch.float16)  # fp16 addends, fp32 accumulator
    errors = {name: abs(t.item() - exact) for name, t in dict(fp32=fp32, fp16=fp16, mixed=mixed).items()}
    assert errors["fp32"] < errors["mixed"] < errors["fp16"]
    assert errors["fp32"] < 1e-3 and errors["fp16"] > 0.01


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_weights_training_tracks_fp32(device):
    """Training with bf16 weights (fp32 master copies in AdamW) follows fp32 training: bf16 parameters,
    fp32 optimizer state, and losses within bf16's resolution of fp32's."""
    from systems.model import TransformerLM, get_config
    from systems.optim import AdamW
    from systems.precision import get_precision
    from systems.step import random_batch, train_step

    device = torch.device(device)
    config = get_config("tiny", attention="sdpa")
    fp32 = TransformerLM(config).to(device)
    bf16 = TransformerLM(config).to(device)
    bf16.load_state_dict(fp32.state_dict())
    bf16.to(get_precision("bf16-weights").weights)
    tokens, targets = random_batch(config, 4, 32, device)
    runs, optimizers = {}, {}
    for name, model, precision in (("fp32", fp32, "fp32"), ("bf16", bf16, "bf16-weights")):
        optimizers[name] = AdamW(model.parameters(), lr=1e-3)
        runs[name] = [train_step(model, optimizers[name], tokens, targets, get_precision(precision)).item()
                      for _ in range(5)]
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert {s["master"].dtype for s in optimizers["bf16"].state.values()} == {torch.float32}
    assert runs["bf16"][-1] < runs["bf16"][0]
    # The five steps lower the loss by ~4%: 0.5% tells lost or half-size updates from bf16 rounding.
    torch.testing.assert_close(torch.tensor(runs["bf16"]), torch.tensor(runs["fp32"]), rtol=5e-3, atol=0)
