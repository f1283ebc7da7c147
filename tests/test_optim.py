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


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_kernel_matches_torch_update(weights):
    """One Triton launch (interpreted on a CPU) updates tensors of mixed sizes and step counts
    exactly as the torch ops do, one tensor at a time; bf16/fp16 weights through fp32 masters."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes, steps = [5000, 1, 4096, 4097, 300], [3, 1, 7, 3, 12]
    masters = [torch.randn(n, device=device) for n in sizes]
    params = [m.to(weights) if weights != torch.float32 else m for m in masters]
    grads = [torch.randn(n, device=device).to(weights) for n in sizes]
    moments = [(torch.randn(n, device=device), torch.rand(n, device=device)) for n in sizes]
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    expected = [[t.clone() for t in (m, *mv)] for m, mv in zip(masters, moments)]
    for (master, m, v), g, step in zip(expected, grads, steps):
        adamw_update_torch(master, g.float(), m, v, step=step, **hyper)
    for p, g in zip(params, grads):
        p.grad = g
    states = [dict(exp_avg=m, exp_avg_sq=v, step=s) for (m, v), s in zip(moments, steps)]
    if weights != torch.float32:
        for state, master in zip(states, masters):
            state["master"] = master
    adamw_update_fused(params, states, **hyper)
    for master, p, (m, v), (want_master, want_m, want_v) in zip(masters, params, moments, expected):
        for got, want in ((master, want_master), (m, want_m), (v, want_v)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        if weights == torch.float32:
            continue
        if device.type == "cuda":
            assert torch.equal(p, master.to(weights))  # the master, rounded to nearest even as torch does
        else:  # the interpreter's fp32 -> bf16 conversion truncates: allow one unit in the last place
            torch.testing.assert_close(p, master.to(weights), rtol=torch.finfo(weights).eps, atol=0)


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
