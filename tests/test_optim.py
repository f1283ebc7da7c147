import pytest
import torch

from systems.optim import AdamW, adamw_update_fused, adamw_update_torch, clip_grad_norm


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
    """One Triton launch (interpreted on a CPU) updates tensors of mixed sizes and step counts
    exactly as the torch ops do, one tensor at a time."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes, steps = [5000, 1, 4096, 4097, 300], [3, 1, 7, 3, 12]
    tensors = [[torch.randn(n, device=device) for _ in range(4)] for n in sizes]
    for *_, v in tensors:
        v.abs_()
    reference = [[t.clone() for t in group] for group in tensors]
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    for group, step in zip(reference, steps):
        adamw_update_torch(*group, step=step, **hyper)
    for p, g, _, _ in tensors:
        p.grad = g
    states = [dict(exp_avg=m, exp_avg_sq=v, step=s) for (_, _, m, v), s in zip(tensors, steps)]
    adamw_update_fused([group[0] for group in tensors], states, **hyper)
    for ours, ref in zip(tensors, reference):
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


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
    optimizer = AdamW([used, unused], lr=0.1)
    optimizer.step()
    assert torch.equal(unused, before)
    assert unused not in optimizer.state and used in optimizer.state


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
