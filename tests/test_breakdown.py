"""The step breakdown (systems.bench.breakdown): kernel kinds by name, ranges by the launching thread, and
communication counted exposed only where nothing else runs."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from systems.bench.breakdown import StepBreakdown, breakdown_of, kind_of, profile_step
from systems.model import get_config
from systems.optim import AdamW
from systems.precision import PRECISIONS
from systems.step import make_model, random_batch, train_step

MAIN, AUTOGRAD = 1, 2  # thread ids
ATTENTION = Path(__file__).parents[1] / "systems" / "attention"


@pytest.mark.parametrize("name, kind", [
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_NNT", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_128x128_16x5_nn_align4>", "matmul"),
    ("fwd_kernel", "attention_forward"),
    ("fwd_merge_kernel", "attention_forward"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>", "attention_forward"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128", "attention_forward"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention_forward"),
    ("bwd_dkdv_kernel", "attention_backward"),
    ("bwd_preprocess_kernel", "attention_backward"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>", "attention_backward"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7", "attention_backward"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "other"),
    ("_adamw_kernel", "other"),
    ("triton_poi_fused_add_mul_0", "other"),
])
def test_kernels_are_sorted_by_name(name, kind):
    assert kind_of(name) == kind


@pytest.mark.parametrize("module", sorted(ATTENTION.glob("*_forward.py")) + sorted(ATTENTION.glob("*_backward.py")),
                         ids=lambda path: path.stem)
def test_each_of_our_attention_kernels_is_sorted_by_its_pass(module):
    """Every kernel that systems.attention launches, Triton's and Gluon's, is its pass's attention: a kernel
    missing from the names would count as other, and a step's attention time would look smaller."""
    tree = ast.parse(module.read_text())
    kernels = [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")
               and any(ast.unparse(getattr(d, "func", d)).endswith(".jit") for d in node.decorator_list)]
    assert kernels
    expected = "attention_forward" if module.stem.endswith("_forward") else "attention_backward"
    assert {name: kind_of(name) for name in kernels} == dict.fromkeys(kernels, expected)


def kernel(name, start, duration, correlation, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "tid": stream, "ts": start, "dur": duration,
            "args": {"correlation": correlation}}


def launch(thread, at, correlation):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": thread, "ts": at, "dur": 1,
            "args": {"correlation": correlation}}


def annotation(name, thread, start, end):
    return {"ph": "X", "cat": "user_annotation", "name": name, "tid": thread, "ts": start, "dur": end - start}


def test_breakdown_of_a_trace_worked_by_hand():
    trace = {"traceEvents": [
        annotation("recompute", AUTOGRAD, 10, 50), annotation("optimizer_step", MAIN, 100, 200),
        annotation("forward", MAIN, 0, 99),  # not a range the breakdown counts
        kernel("nvjet_tst_128x256", 0, 10, 1), launch(MAIN, 5, 1),  # in no range
        # On a second stream, inside busy time already counted: busy is the union, not the sum.
        kernel("triton_poi_fused_mul_0", 5, 10, 6, stream=8), launch(AUTOGRAD, 30, 6),
        kernel("fwd_kernel", 10, 20, 2), launch(AUTOGRAD, 20, 2),  # recomputed
        kernel("bwd_dq_kernel", 30, 10, 3), launch(MAIN, 20, 3),  # in recompute's time, not its thread
        kernel("ncclDevKernel_AllGather_RING_LL", 35, 20, 4), launch(MAIN, 21, 4),  # 5 hidden behind bwd_dq
        kernel("_adamw_kernel", 60, 5, 5), launch(MAIN, 150, 5),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "tid": 7, "ts": 70, "dur": 2, "args": {}},
        {"ph": "i", "cat": "kernel", "name": "instant events are not activity", "tid": 7, "ts": 80},
    ]}
    expected = StepBreakdown(span_s=72e-6, busy_s=62e-6, matmul_s=10e-6, attention_forward_s=20e-6,
                             attention_backward_s=10e-6, communication_s=20e-6, communication_exposed_s=15e-6,
                             other_s=17e-6, optimizer_s=5e-6, loss_s=0.0, recompute_s=30e-6)
    actual = breakdown_of(trace)
    for field in dataclasses.fields(StepBreakdown):
        assert getattr(actual, field.name) == pytest.approx(getattr(expected, field.name), abs=1e-12), field.name


def test_a_trace_without_gpu_activity_is_an_error():
    with pytest.raises(ValueError, match="no GPU activity"):
        breakdown_of({"traceEvents": [annotation("optimizer_step", MAIN, 0, 10)]})


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["flash", "sdpa"])
def test_a_checkpointed_step_on_the_gpu_shows_every_part(attention, device):
    config = get_config("tiny", attention=attention, checkpoint=(1,))
    precision = PRECISIONS["bf16"]
    model = make_model(config, device, precision)
    optimizer = AdamW(model.parameters())
    tokens, targets = random_batch(config, 2, config.context_length, device)
    train_step(model, optimizer, tokens, targets, precision)  # compiles, and creates the optimizer state
    parts = profile_step(lambda: train_step(model, optimizer, tokens, targets, precision))
    kinds = parts.matmul_s + parts.attention_forward_s + parts.attention_backward_s + parts.other_s
    assert parts.communication_s == parts.communication_exposed_s == 0
    assert all(s > 0 for s in (parts.matmul_s, parts.attention_forward_s, parts.attention_backward_s,
                               parts.optimizer_s, parts.loss_s, parts.recompute_s))
    # Every block is recomputed once: its attention forward runs twice, half of it inside `recompute`.
    assert parts.recompute_s > parts.attention_forward_s / 2 * 0.99
    # The union of the activities is at most their sum; the trace's float microseconds round each end.
    assert parts.busy_s <= kinds + 1e-6 and parts.busy_s <= parts.span_s
