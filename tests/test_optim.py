import pytest
import torch

from systems.optim import AdamW, adamw_update_torch, adamw_update_triton, clip_grad_norm


def _train_pair(ours_cls, device, steps=10, **hyper):
    """Run our optimizer and torch.optim.AdamW on identical parameters and gradients."""
    shapes = [(33, 17), (129,), (4, 5, 6)]
    ours = [torch.randn(s, device=device, requires_grad=True) for s in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    opt_ours, opt_theirs = ours_cls(ours, **hyper), torch.optim.AdamW(theirs, **hyper)
    for _ in range(steps):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt_ours.step()
        opt_theirs.step()
    return ours, theirs


@pytest.mark.parametrize("hyper", [
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
    dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0),
])
def test_adamw_matches_torch(hyper):
    ours, theirs = _train_pair(AdamW, torch.device("cpu"), **hyper)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_fused_kernel_matches_torch_update():
    """The Triton kernel (interpreted on a CPU) computes the same update as the torch ops."""
    p, g, m, v = (torch.randn(5000) for _ in range(4))
    v = v.abs()
    tensors = [p, g, m, v]
    reference = [t.clone() for t in tensors]
    hyper = dict(step=3, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    adamw_update_torch(*reference, **hyper)
    if torch.cuda.is_available():
        tensors = [t.cuda() for t in tensors]
    adamw_update_triton(*tensors, **hyper)
    for ours, ref in zip(tensors, reference):
        torch.testing.assert_close(ours.cpu(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_adamw_on_cuda_matches_torch():
    ours, theirs = _train_pair(AdamW, torch.device("cuda"), lr=1e-2, weight_decay=0.1)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad", [dict(lr=-1.0), dict(betas=(0.9, 1.0)), dict(weight_decay=-0.1)])
def test_adamw_rejects_bad_hyperparameters(bad):
    with pytest.raises(ValueError):
        AdamW([torch.nn.Parameter(torch.randn(3))], **bad)


def test_adamw_skips_parameters_without_gradients():
    used, unused = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    before = unused.detach().clone()
    used.grad = torch.randn(4)
    AdamW([used, unused], lr=0.1).step()
    assert torch.equal(unused, before) and unused not in AdamW([unused]).state


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
