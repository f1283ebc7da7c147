"""The precision registry: names resolve once to objects that say how a step runs."""

import pytest
import torch

from systems.optim import AdamW
from systems.precision import DTYPE_NAMES, DTYPES, PRECISIONS, Precision, get_precision

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", PRECISIONS)
def test_a_name_resolves_to_its_entry_and_an_object_to_itself(name):
    precision = get_precision(name)
    assert precision.name == name
    assert get_precision(precision) is precision


def test_an_unknown_name_is_a_value_error_naming_the_choices():
    choices = r"\['fp32', 'bf16', 'fp16', 'bf16-weights'\]"
    with pytest.raises(ValueError, match=rf"unknown precision 'fp8'; choose from {choices}"):
        get_precision("fp8")


def test_attention_dtypes_are_the_single_dtype_precisions():
    assert DTYPES == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    assert all(PRECISIONS[name].compute == dtype for name, dtype in DTYPES.items())
    assert DTYPE_NAMES == {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@pytest.mark.parametrize("name, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                         ("bf16-weights", torch.bfloat16)])
def test_autocast_runs_matmuls_in_the_compute_dtype(name, dtype):
    precision = PRECISIONS[name]
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with precision.autocast(CPU):
        assert torch.is_autocast_enabled("cpu") == (dtype != torch.float32)
        assert (a @ b).dtype == dtype
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("name, key", [("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("bf16-weights", "bf16")])
def test_peak_key_names_the_matmul_dtype_and_fp32_runs_as_tf32_when_allowed(name, key):
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert PRECISIONS[name].peak_key() == key
        torch.backends.cuda.matmul.allow_tf32 = True
        assert PRECISIONS[name].peak_key() == ("tf32" if key == "fp32" else key)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("name", PRECISIONS)
def test_bytes_per_parameter_match_a_trained_parameter(name):
    """Weights and gradients in the weights' dtype; AdamW's state as it allocates it in a step."""
    precision = PRECISIONS[name]
    weight = torch.nn.Parameter(torch.randn(5, 7, dtype=precision.weights))
    weight.grad = torch.randn_like(weight)
    optimizer = AdamW([weight])
    optimizer.step()
    state = sum(t.nbytes for t in optimizer.state[weight].values() if isinstance(t, torch.Tensor))
    assert (precision.weight_bytes, precision.grad_bytes) == (weight.element_size(), weight.grad.element_size())
    assert precision.optimizer_bytes * weight.numel() == state
    assert precision.autocast_copy_bytes == (2 if name in ("bf16", "fp16") else 0)


def test_precisions_are_frozen():
    with pytest.raises(AttributeError):
        PRECISIONS["fp32"].compute = torch.bfloat16
    assert isinstance(PRECISIONS["fp32"], Precision)
