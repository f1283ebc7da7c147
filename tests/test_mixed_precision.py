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
