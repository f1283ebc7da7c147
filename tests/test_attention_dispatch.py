"""Which kernel attention="flash" runs: the Gluon forward on Hopper for bf16/fp16 at head dims 64 and 128 in
eager code where it is the faster (long sequences, a grid that fills the GPU), our Triton FlashAttention-2 on every other GPU, input and under torch.compile or a dispatch mode,
the tiled PyTorch version off CUDA.

On a CPU the GPU is faked: CUDA tensors of FakeTensorMode (metadata only, which is all the decision reads) and
the capability torch.cuda reports, monkeypatched; the kernels themselves are replaced by recorders.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from systems.attention import BACKENDS, backends, triton_launch

pytest.importorskip("triton.experimental.gluon", reason="needs Triton with Gluon (its input check decides)")

HOPPER = (9, 0)
CAPABILITIES = [(8, 0), (8, 6), (8, 9), HOPPER, (10, 0), (12, 0)]  # A100, A10, L4/4090, H100/H200, B200, RTX 50
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HEAD_DIMS = [16, 32, 64, 80, 96, 128]
H100_SMS = 132
# (batch, heads or None, n_queries, n_keys): a long grid, a short sequence, one long sequence, unequal lengths,
LONG = (4, 32, 4096, 4096)
SHAPES = [LONG, (3, 2, 200, 300), (2, None, 8192, 8192), (1, 64, 300, 5000), (16, None, 16384, 16384),
          (8, 32, 2048, 2048)]  # ... and a grid that fills the GPU, one key tile short of 4096


def expected_kernel(capability, dtype, d, shape=LONG, sms=H100_SMS) -> str:
    """The rule, written out independently of the code under test: the Gluon forward where it takes the input
    and measured faster, 4096 keys or more over more than two query tiles of 128 rows per SM (below that,
    FlashAttention-2 splits the keys to fill the GPU)."""
    batch, heads, n_queries, n_keys = shape
    tiles = batch * (heads or 1) * -(-n_queries // 128)
    takes = capability == HOPPER and dtype in (torch.bfloat16, torch.float16) and d in (64, 128)
    return "gluon" if takes and n_keys >= 4096 and tiles > 2 * sms else "triton"


@pytest.fixture
def fake_gpu(monkeypatch):
    """make(shape, dtype): a fake CUDA tensor; the fixture's `capability` attribute sets the GPU's compute
    capability. The kernels are recorders, so `flash_attention` returns the name of the one it called."""

    class FakeGpu:
        capability = HOPPER
        sms = H100_SMS
        mode = FakeTensorMode()

        def make(self, shape, dtype=torch.bfloat16):
            with self.mode:
                return torch.empty(shape, dtype=dtype, device="cuda")

        def qkv(self, shape, d, dtype=torch.bfloat16):
            batch, heads, n_queries, n_keys = shape
            heads = () if heads is None else (heads,)
            return self.make((batch, *heads, n_queries, d), dtype), self.make((batch, *heads, n_keys, d), dtype)

    gpu = FakeGpu()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: gpu.capability)
    monkeypatch.setattr(triton_launch, "sm_count", lambda device_index=None: gpu.sms)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"a fake sm{gpu.capability}")
    for name in ("gluon", "triton"):
        monkeypatch.setattr(backends, f"{name}_attention", lambda q, k, v, is_causal=False, name=name: name)
    monkeypatch.setattr(backends.FlashAttentionPytorch, "apply", lambda q, k, v, is_causal=False: "pytorch")
    return gpu


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm{c[0]}{c[1]}")
def test_flash_runs_gluon_exactly_on_hopper_16bit_d64_d128_long_sequences(fake_gpu, capability, dtype):
    fake_gpu.capability = capability
    picked, expected = {}, {}
    for d, is_causal, shape in itertools.product(HEAD_DIMS, (False, True), SHAPES):
        q, kv = fake_gpu.qkv(shape, d, dtype)
        case = (d, is_causal, shape)
        picked[case] = BACKENDS["flash"](q, kv, kv, is_causal)
        assert backends.flash_kernel(q, kv, kv, is_causal) == picked[case]
        expected[case] = expected_kernel(capability, dtype, d, shape)
    assert picked == expected


@pytest.mark.parametrize("sms", [16, H100_SMS, 1024])
def test_flash_weighs_the_grid_against_this_gpus_sms(fake_gpu, sms):
    """A grid of 128 query tiles fills a GPU of 16 SMs, not an H100: the SM count read is this GPU's."""
    fake_gpu.sms = sms
    for shape in [(1, None, 16384, 16384), (2, 16, 4096, 4096), (8, 32, 4096, 4096)]:
        q, kv = fake_gpu.qkv(shape, 64)
        assert BACKENDS["flash"](q, kv, kv, True) == expected_kernel(HOPPER, torch.bfloat16, 64, shape, sms)


def test_flash_runs_fa2_under_torch_compile(fake_gpu, monkeypatch):
    """Dynamo would trace into the Gluon launcher (its TensorDescriptor and layouts are host-side Python that
    Dynamo does not model), while FlashAttentionTriton runs custom ops under torch.compile."""
    q, _ = fake_gpu.qkv(LONG, 64)
    assert BACKENDS["flash"](q, q, q, True) == "gluon"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert BACKENDS["flash"](q, q, q, True) == "triton"


class _Passing(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_flash_runs_fa2_under_a_dispatch_mode(fake_gpu):
    """Selective checkpointing keeps attention's outputs by seeing FlashAttention-2's custom op in its dispatch
    mode; the Gluon launch is no op it could see, so there "flash" stays FlashAttention-2."""
    q, _ = fake_gpu.qkv(LONG, 128, torch.float16)
    with _Passing():
        assert BACKENDS["flash"](q, q, q, False) == "triton"
    assert BACKENDS["flash"](q, q, q, False) == "gluon"


def test_flash_refuses_gluon_for_input_that_breaks_the_contract(fake_gpu):
    """Mismatched shapes are not the Gluon kernel's to take: FlashAttention-2 then raises the contract's error."""
    (q, _), (k, _) = fake_gpu.qkv(LONG, 64), fake_gpu.qkv((4, 16, 4096, 4096), 64)
    assert BACKENDS["flash"](q, k, k, True) == "triton"


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_flash_runs_pytorch_off_cuda_whatever_the_gpu(fake_gpu, device):
    q = torch.empty(1, 2, 128, 64, dtype=torch.bfloat16, device=device)
    assert BACKENDS["flash"](q, q, q, True) == "pytorch"


def test_importing_attention_and_flash_on_a_cpu_leave_gluon_unimported():
    script = ("import sys, torch\n"
              "import systems.model\n"
              "from systems.attention import BACKENDS\n"
              "q = torch.randn(1, 2, 64, 64, requires_grad=True)\n"
              "BACKENDS['flash'](q, q, q, True).sum().backward()\n"
              "loaded = [m for m in sys.modules if 'gluon' in m or m == 'triton']\n"
              "assert not loaded, loaded\n")
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr


HOPPER_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() == HOPPER


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, d", [(torch.bfloat16, 64), (torch.float16, 128), (torch.float32, 64),
                                      (torch.bfloat16, 32)], ids=str)
@pytest.mark.parametrize("shape", [(2, 16, 4096, 4096), (2, 3, 300, 300)], ids=str)
def test_flash_on_this_gpu_runs_what_the_rule_says(dtype, d, shape, monkeypatch):
    # Triton's one tile at any length: which kernel runs is checked here, not its tile search, which at 4096 keys
    # would compile every candidate tile.
    monkeypatch.setattr(triton_launch, "TUNE_FROM_SEQ", math.inf)
    q = torch.randn(shape[:3] + (d,), device="cuda", dtype=dtype, requires_grad=True)
    o = BACKENDS["flash"](q, q, q, True)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    gluon = HOPPER_GPU and expected_kernel(HOPPER, dtype, d, shape, sms) == "gluon"
    assert type(o.grad_fn).__name__ == ("FlashAttentionGluonBackward" if gluon else "FlashAttentionTritonBackward")
    if gluon:  # the same kernel as the "gluon" backend, bit for bit
        torch.testing.assert_close(o, BACKENDS["gluon"](q, q, q, True), rtol=0, atol=0)


@pytest.mark.gpu
def test_compiled_flash_traces_whole_on_any_gpu():
    """fullgraph: FlashAttention-2's custom ops under compile, also where eager calls run the Gluon forward."""
    torch._dynamo.reset()
    q = torch.randn(2, 3, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(BACKENDS["flash"], fullgraph=True)
    o = compiled(q, q, q, True)
    o.sum().backward()
    torch._dynamo.reset()
    torch.testing.assert_close(o, BACKENDS["triton"](q, q, q, True), rtol=0, atol=0)
