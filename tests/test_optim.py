import math
import os

import pytest
import torch

from systems.optim import adamw
from systems.optim import AdamW, clip_grad_norm


LRS = [1e-2, 1e-2, 3e-2, 3e-2, 1e-3, 1e-3]  # a schedule, set through param_groups as schedulers do
LATE = 2  # the parameter whose first gradient comes at step 2: it counts its own steps
SHAPES = [(50, 100), (1,), (64, 64), (4097,), (3, 100)]  # around the fused kernel's 4096-element blocks


def _train_pair(device, weights=torch.float32, **hyper):
    """Our AdamW and torch.optim.AdamW from a zero state, as training starts: the first steps are where
    bias correction and eps matter. Gradients span 1e-5 to 1e-1 (so an eps of 1e-3 lies among them), the
    learning rate changes between steps, and one parameter joins late. torch's parameters are fp32
    copies of ours, fed the same gradients. Returns ours, theirs and our optimizer."""
    ours = [torch.nn.Parameter(torch.randn(s, device=device).to(weights)) for s in SHAPES]
    theirs = [torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in ours]
    optimizers = AdamW(ours, lr=LRS[0], **hyper), torch.optim.AdamW(theirs, lr=LRS[0], **hyper)
    for step, lr in enumerate(LRS):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if i != LATE or step >= 2:
                scale = 10 ** torch.empty(b.shape, device=device).uniform_(-5, -1)
                a.grad = (torch.randn_like(b) * scale).to(weights)
                b.grad = a.grad.float()
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
    return ours, theirs, optimizers[0]


def _assert_follows_torch(ours, theirs, optimizer):
    """The fp32 masters (the parameters themselves in fp32) match torch's parameters and moments."""
    for a, b in zip(ours, theirs):
        state = optimizer.state[a]
        master = state.get("master", a)
        assert master.dtype == state["exp_avg"].dtype == torch.float32
        # Six steps of a few fp32 roundings each on O(1) values.
        torch.testing.assert_close(master.detach(), b.detach(), rtol=1e-6, atol=1e-6)


HYPER = [dict(betas=(0.9, 0.999), eps=1e-3, weight_decay=0.1), dict(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0)]


@pytest.mark.parametrize("hyper", HYPER)
def test_adamw_matches_torch(hyper):
    _assert_follows_torch(*_train_pair(torch.device("cpu"), **hyper))


@pytest.fixture
def fused_path(device_kind, monkeypatch):
    """On a CPU, send every parameter through the fused Triton kernel, which the interpreter runs there."""
    if device_kind == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it where there is no GPU
            pytest.skip("Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
        monkeypatch.setattr(adamw, "_fusable", lambda p: True)
    return torch.device(device_kind)


@pytest.mark.parametrize("device_kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hyper", HYPER)
def test_fused_adamw_matches_torch(fused_path, weights, hyper):
    """One launch per step updates tensors of mixed sizes and step counts; bf16/fp16 weights through fp32
    masters, each weight its master rounded."""
    ours, theirs, optimizer = _train_pair(fused_path, weights, **hyper)
    _assert_follows_torch(ours, theirs, optimizer)
    if weights == torch.float32:
        return
    for p in ours:
        master = optimizer.state[p]["master"]
        if fused_path.type == "cuda":
            assert torch.equal(p.detach(), master.to(weights))  # rounded to nearest even, as torch does
        else:  # the interpreter's fp32 -> bf16/fp16 conversion truncates: one unit in the last place
            torch.testing.assert_close(p.detach(), master.to(weights), rtol=torch.finfo(weights).eps, atol=0)


def _laid_out(grad: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as `grad`, contiguous, transposed in memory (as a matmul's weight gradient can come),
    or in a buffer 4 bytes off a 16-byte boundary (as a view into a packed gradient buffer)."""
    if layout == "transposed":
        return grad.T.contiguous().T
    if layout == "offset":
        packed = torch.empty(grad.numel() + 1, dtype=grad.dtype, device=grad.device)
        packed[1:] = grad.reshape(-1)
        return packed[1:].view_as(grad)
    return grad.clone()


@pytest.mark.parametrize("device_kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_update_does_not_depend_on_where_the_gradient_lies(fused_path):
    """One update, whatever the gradient's layout: bitwise, as one process and FSDP shards compare."""
    start = torch.randn(64, 96, device=fused_path)
    grads = [torch.randn(64, 96, device=fused_path) * 1e-3 for _ in LRS]
    params = {}
    for layout in ("contiguous", "transposed", "offset"):
        param = torch.nn.Parameter(start.clone())
        optimizer = AdamW([param], lr=LRS[0], weight_decay=0.1)
        for grad, lr in zip(grads, LRS):
            param.grad = _laid_out(grad, layout)
            optimizer.param_groups[0]["lr"] = lr
            optimizer.step()
        params[layout] = param.detach()
    assert torch.equal(params["transposed"], params["contiguous"])
    assert torch.equal(params["offset"], params["contiguous"])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_low_precision_weights_keep_fp32_masters(device):
    """bf16 weights updated by steps far below their resolution: the fp32 master copy follows
    torch.optim.AdamW on fp32 parameters (fed the same gradients), and the weights are it, rounded."""
    hyper = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    ours = [torch.nn.Parameter(torch.randn(s, device=device).to(torch.bfloat16)) for s in [(33, 17), (129,)]]
    theirs = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt_ours, opt_theirs = AdamW(ours, **hyper), torch.optim.AdamW(theirs, **hyper)
    for _ in range(10):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.float()
        opt_ours.step()
        opt_theirs.step()
    for a, b in zip(ours, theirs):
        master = opt_ours.state[a]["master"]
        assert master.dtype == opt_ours.state[a]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(master, b.detach(), rtol=1e-6, atol=1e-6)
        assert torch.equal(a.detach(), master.to(torch.bfloat16))


def test_state_dict_round_trip_keeps_fp32_masters():
    weight = torch.nn.Parameter(torch.randn(64).to(torch.bfloat16))
    weight.grad = torch.randn_like(weight)
    optimizer = AdamW([weight], lr=1e-4)
    optimizer.step()
    saved = {key: value.clone() for key, value in optimizer.state[weight].items() if torch.is_tensor(value)}
    restored = AdamW([weight], lr=1e-4)
    restored.load_state_dict(optimizer.state_dict())
    for key, value in saved.items():
        assert restored.state[weight][key].dtype == torch.float32
        assert torch.equal(restored.state[weight][key], value)


@pytest.mark.parametrize(("bad", "error", "match"), [
    (dict(lr=-1.0), ValueError, "lr must be finite and non-negative, got -1.0"),
    (dict(lr=math.nan), ValueError, "lr must be finite and non-negative, got nan"),
    (dict(lr=math.inf), ValueError, "lr must be finite and non-negative, got inf"),
    (dict(lr="1e-3"), TypeError, "lr must be a float, got '1e-3'"),
    (dict(eps=math.nan), ValueError, "eps must be finite and non-negative, got nan"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay must be finite and non-negative, got -0.1"),
    (dict(betas=(0.9,)), ValueError, r"betas must be a pair \(beta1, beta2\), got \(0.9,\)"),
    (dict(betas=0.9), ValueError, r"betas must be a pair \(beta1, beta2\), got 0.9"),
    (dict(betas=(0.9, 1.0)), ValueError, r"beta2 must lie in \[0, 1\), got 1.0"),
    (dict(betas=(math.nan, 0.999)), ValueError, r"beta1 must lie in \[0, 1\), got nan"),
    (dict(betas=(-0.1, 0.999)), ValueError, r"beta1 must lie in \[0, 1\), got -0.1"),
])
def test_adamw_rejects_bad_hyperparameters(bad, error, match):
    with pytest.raises(error, match=match):
        AdamW([torch.nn.Parameter(torch.randn(3))], **bad)


def test_adamw_skips_parameters_without_gradients():
    used, unused = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    before = unused.detach().clone()
    used.grad = torch.randn(4)
    optimizer = AdamW([used, unused], lr=0.1)
    optimizer.step()
    assert torch.equal(unused, before)
    assert unused not in optimizer.state and used in optimizer.state


def test_step_evaluates_the_closure_with_gradients_on():
    weight = torch.nn.Parameter(torch.randn(5))
    optimizer = AdamW([weight], lr=0.1)

    def closure():
        loss = (weight**2).sum()
        loss.backward()
        return loss

    before = weight.detach().clone()
    loss = optimizer.step(closure)
    torch.testing.assert_close(loss.detach(), (before**2).sum())
    assert not torch.equal(weight.detach(), before)  # updated with the gradient the closure computed


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_grad_norm_matches_torch(max_norm):
    ours = [torch.nn.Parameter(torch.randn(10, 10)) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn_like(a) * 3
        b.grad = a.grad.clone()
    norm = clip_grad_norm(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    torch.testing.assert_close(norm, expected)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)
