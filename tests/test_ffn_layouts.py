"""Section 8's arithmetic (systems.accounting.ffn_layouts) against hand-worked numbers, a FLOP counter, and the
identities that tie its formulas together."""

import math
import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from systems.accounting import (RING_COLLECTIVES, Accelerator, Collective, SwiGLULayer, dp_step, fsdp_step,
                                fsdp_tp_step, largest_dp_devices, largest_fsdp_devices, largest_fsdp_tp_grid,
                                largest_tp_devices, smallest_batch_per_device, tp_step)
from systems.model import SwiGLU

# The hand-worked layer: B = 8 rows, D = 4, F = 16, FP16 (b = 2); one weight is 4·16·2 = 128 bytes and one
# matmul of the layer 2BDF = 2·8·4·16 = 1024 FLOPs. The device: C = 64 FLOP/s, W = 16 bytes/s, so W/(bC) = 1/8.
LAYER = SwiGLULayer(batch=8, d_model=4, d_ff=16, bytes_per_element=2)
DEVICE = Accelerator(flops_per_s=64, egress_bandwidth=16)


@pytest.mark.parametrize(("kind", "sent"), [
    ("all-gather", 90),  # (N-1)/N S = 3/4 · 120
    ("reduce-scatter", 90),
    ("all-reduce", 180),  # 2 (N-1)/N S = 2 · 3/4 · 120
    ("alternate-all-reduce", 360),  # (N-1) S = 3 · 120
])
def test_ring_collectives_by_hand(kind, sent):
    """S = 120 bytes over N = 4 devices, W = 30 bytes/s: the seconds are the bytes sent / 30."""
    collective = Collective(kind, 120, 4)
    assert collective.bytes_sent == sent
    assert collective.seconds(Accelerator(flops_per_s=1.0, egress_bandwidth=30)) == sent / 30
    assert Collective(kind, 120, 1).bytes_sent == 0  # one device has nothing to send


@pytest.mark.parametrize("devices", [2, 3, 5, 8, 64])
def test_ring_collective_identities(devices):
    """A device of an all-gather receives every shard but its own: (N-1)/N of S, sent by the others as much as it
    sends; all-reduce is reduce-scatter then all-gather; the alternate all-reduce sends N/2 times the ring's."""
    size = random.uniform(1, 1e9)
    gather, scatter, reduce, alternate = (Collective(kind, size, devices).bytes_sent for kind in RING_COLLECTIVES)
    assert gather + size / devices == pytest.approx(size, rel=1e-12)
    assert reduce == pytest.approx(gather + scatter, rel=1e-12)
    assert alternate / reduce == pytest.approx(devices / 2, rel=1e-12)


def test_data_parallel_by_hand():
    """N = 2: forward 3 · 1024 / 2 = 1536 FLOPs, backward 6 · 1024 / 2 = 3072, i.e. 48 s at 64 FLOP/s; the backward
    all-reduces three 128-byte gradients, 2 · 1/2 · 128 = 128 bytes each, 384 bytes in 24 s."""
    step = dp_step(LAYER, 2)
    assert (step.forward.flops, step.backward.flops) == (1536, 3072)
    assert step.forward.bytes_sent == 0 and step.backward.bytes_sent == 384
    assert step.backward.comm_seconds(DEVICE) == 24 and step.backward.compute_seconds(DEVICE) == 48


def test_fsdp_by_hand():
    """N = 4: 768 and 1536 FLOPs (12 s and 24 s); the forward all-gathers three weights, 3/4 · 128 = 96 bytes
    each, 288 bytes in 18 s; the backward gathers them again and reduce-scatters the gradients: 576 bytes, 36 s."""
    step = fsdp_step(LAYER, 4)
    assert (step.forward.flops, step.backward.flops) == (768, 1536)
    assert (step.forward.bytes_sent, step.backward.bytes_sent) == (288, 576)
    assert (step.forward.comm_seconds(DEVICE), step.backward.comm_seconds(DEVICE)) == (18, 36)
    assert step.forward.communication_bound(DEVICE) and step.backward.communication_bound(DEVICE)  # 4 > 3 below


def test_tensor_parallel_by_hand():
    """N = 4: 768 and 1536 FLOPs; each pass all-reduces a (B, D) tensor of 8·4·2 = 64 bytes,
    2 · 3/4 · 64 = 96 bytes in 6 s, against 12 s and 24 s of math."""
    step = tp_step(LAYER, 4)
    assert (step.forward.flops, step.backward.flops) == (768, 1536)
    assert step.forward.bytes_sent == step.backward.bytes_sent == 96
    assert step.forward.comm_seconds(DEVICE) == 6 and not step.forward.communication_bound(DEVICE)


def test_fsdp_x_tp_by_hand():
    """A 2 x 2 grid: forward 3 · 1024 / 4 = 768 FLOPs, 12 s. FSDP axis: three all-gathers of a TP rank's half of a
    weight, 128 / 2 = 64 bytes over 2 devices, 1/2 · 64 = 32 bytes each: 96 bytes, 6 s. TP axis: an all-reduce of
    B/2 = 4 rows, 4·4·2 = 32 bytes, 2 · 1/2 · 32 = 32 bytes, 2 s. Overlapped max(6, 2) = 6 s, else 6 + 2 = 8 s.
    Backward: 24 s of math; FSDP axis gathers and reduce-scatters, 192 bytes, 12 s; TP axis dx's 32 bytes, 2 s."""
    step = fsdp_tp_step(LAYER, fsdp=2, tp=2)
    assert step.forward.flops == 768 and step.forward.bytes_sent == 128
    assert step.forward.axis_seconds(DEVICE) == {"fsdp": 6, "tp": 2}
    assert step.forward.comm_seconds(DEVICE, overlap_axes=True) == 6
    assert step.forward.comm_seconds(DEVICE, overlap_axes=False) == 8
    assert step.backward.flops == 1536 and step.backward.axis_seconds(DEVICE) == {"fsdp": 12, "tp": 2}


def test_largest_device_counts_by_hand():
    """W/(bC) = 1/8. DP and FSDP: 1 + 2·8/8 = 3. TP: 1 + 3·16/8 = 7 forward, 1 + 6·16/8 = 13 backward.
    FSDP x TP overlapped: 3 x 7 = 21. Not overlapped, in units of b: 3F N_F + 2B N_T = 48 N_F + 16 N_T
    <= 6BF/8 + 48 + 16 = 160, the product largest at 48 N_F = 16 N_T = 80: N_F = 5/3, N_T = 5, N = 25/3
    (K²/(24b²BF) with K = 320: 102400 / 12288)."""
    assert (largest_dp_devices(LAYER, DEVICE).forward, largest_dp_devices(LAYER, DEVICE).backward) == (math.inf, 3)
    assert largest_fsdp_devices(LAYER, DEVICE).step == 3
    tp = largest_tp_devices(LAYER, DEVICE)
    assert (tp.forward, tp.backward, tp.step) == (7, 13, 7)
    overlapped = largest_fsdp_tp_grid(LAYER, DEVICE, overlap_axes=True)
    assert (overlapped.fsdp, overlapped.tp, overlapped.devices) == (3, 7, 21)
    serial = largest_fsdp_tp_grid(LAYER, DEVICE, overlap_axes=False)
    assert serial.fsdp == pytest.approx(5 / 3, rel=1e-15) and serial.tp == 5
    assert serial.devices == pytest.approx(102400 / 12288, rel=1e-15)


def test_smallest_batch_per_device_by_hand():
    """bC/(2W) (N-1)/N = 2·64/32 · 3/4 = 3 rows a device on 4 devices: B = 12, where DP's backward all-reduces
    3 · 2 · 3/4 · 128 = 576 bytes in 36 s and computes 6 · 2·12·4·16 / 4 = 2304 FLOPs in 36 s."""
    assert smallest_batch_per_device(DEVICE, 4) == 3
    step = dp_step(SwiGLULayer(batch=12, d_model=4, d_ff=16), 4)
    assert step.backward.comm_seconds(DEVICE) == step.backward.compute_seconds(DEVICE) == 36


def random_case():
    """A fresh layer and device, W/(bC) drawn so that the bounds fall between 1 and about 60 devices."""
    layer = SwiGLULayer(batch=random.randint(1, 64), d_model=random.randint(1, 64), d_ff=random.randint(1, 64),
                        bytes_per_element=random.choice([1, 2, 4]))
    flops = random.uniform(1e12, 1e15)
    ratio = random.uniform(0.05, 20) / max(layer.batch, layer.d_ff)  # W/(bC)
    return layer, Accelerator(flops_per_s=flops, egress_bandwidth=ratio * layer.bytes_per_element * flops)


@pytest.mark.parametrize("draw", range(4))
def test_flops_match_a_flop_counter(draw):
    """The layer's forward and backward on a FLOP counter, against every layout's per-device FLOPs times its devices
    (6BDF and 12BDF: a backward counted like a forward would be off by 2)."""
    layer, _ = random_case()
    ffn, x = SwiGLU(layer.d_model, layer.d_ff), torch.randn(layer.batch, layer.d_model, requires_grad=True)
    with FlopCounterMode(display=False) as forward:
        y = ffn(x)
    with FlopCounterMode(display=False) as backward:
        y.backward(torch.randn_like(y))
    steps = {4: dp_step(layer, 4), 3: fsdp_step(layer, 3), 5: tp_step(layer, 5), 6: fsdp_tp_step(layer, 2, 3)}
    for devices, step in steps.items():
        assert step.forward.flops * devices == pytest.approx(forward.get_total_flops(), rel=1e-12)
        assert step.backward.flops * devices == pytest.approx(backward.get_total_flops(), rel=1e-12)


@pytest.mark.parametrize("draw", range(4))
def test_layouts_agree_where_they_meet(draw):
    """FSDP moves 1.5 times DP's bytes a step (all-gather + reduce-scatter = all-reduce, plus the forward's
    gathers); FSDP x TP with one TP rank is FSDP, with one FSDP rank TP."""
    layer, device = random_case()
    n = random.randint(2, 16)
    dp, fsdp = dp_step(layer, n), fsdp_step(layer, n)
    assert fsdp.forward.bytes_sent + fsdp.backward.bytes_sent == pytest.approx(1.5 * dp.backward.bytes_sent, rel=1e-12)
    for grid, single in ((fsdp_tp_step(layer, n, 1), fsdp), (fsdp_tp_step(layer, 1, n), tp_step(layer, n))):
        for ours, theirs in ((grid.forward, single.forward), (grid.backward, single.backward)):
            assert ours.flops == theirs.flops
            assert ours.comm_seconds(device) == pytest.approx(theirs.comm_seconds(device), rel=1e-12)


def bound_holds(bound: float, pass_on, device) -> None:
    """Up to the bound's whole number of devices the pass is not communication-bound; one device more, it is."""
    n = math.floor(bound)
    assert n >= 1
    assert not pass_on(n).communication_bound(device), (bound, n)
    assert pass_on(n + 1).communication_bound(device), (bound, n + 1)


@pytest.mark.parametrize("draw", range(6))
def test_device_bounds_match_the_costs(draw):
    """Each closed form against the costs it is solved from, on fresh layers and devices: a factor of 2 or of
    (N-1)/N lost on either side moves the crossing off the bound."""
    layer, device = random_case()
    assert not dp_step(layer, 10**6).forward.communication_bound(device)  # DP's forward has no limit
    bound_holds(largest_dp_devices(layer, device).backward, lambda n: dp_step(layer, n).backward, device)
    fsdp = largest_fsdp_devices(layer, device)
    bound_holds(fsdp.forward, lambda n: fsdp_step(layer, n).forward, device)
    bound_holds(fsdp.backward, lambda n: fsdp_step(layer, n).backward, device)
    tp = largest_tp_devices(layer, device)
    bound_holds(tp.forward, lambda n: tp_step(layer, n).forward, device)
    bound_holds(tp.backward, lambda n: tp_step(layer, n).backward, device)


@pytest.mark.parametrize("draw", range(6))
def test_smallest_batch_per_device_matches_the_costs(draw):
    """On 8 devices, DP with the bound's rows a device (rounded up) is not communication-bound; a row fewer is."""
    layer, device = random_case()
    rows = math.ceil(smallest_batch_per_device(device, 8, layer.bytes_per_element))

    def backward(rows_per_device):
        return dp_step(SwiGLULayer(8 * rows_per_device, layer.d_model, layer.d_ff, layer.bytes_per_element), 8).backward

    assert not backward(rows).communication_bound(device)
    assert rows == 1 or backward(rows - 1).communication_bound(device)


def compute_bound_grids(layer, device, overlap_axes):
    """Every whole-number grid whose forward and backward are not communication-bound. No axis goes beyond its
    own bound (the overlapped grid's sides), where the other axis has one device."""
    sides = largest_fsdp_tp_grid(layer, device, overlap_axes=True)
    grids = []
    for fsdp in range(1, math.floor(sides.fsdp) + 2):
        for tp in range(1, math.floor(sides.tp) + 2):
            step = fsdp_tp_step(layer, fsdp, tp)
            if not step.forward.communication_bound(device, overlap_axes):
                assert not step.backward.communication_bound(device, overlap_axes)  # it asks no more
                grids.append((fsdp, tp))
    return grids


@pytest.mark.parametrize("draw", range(3))
def test_overlapped_grid_bound_is_each_axis_bound(draw):
    layer, device = random_case()
    bound = largest_fsdp_tp_grid(layer, device, overlap_axes=True)
    grids = compute_bound_grids(layer, device, overlap_axes=True)
    assert max(f * t for f, t in grids) == math.floor(bound.fsdp) * math.floor(bound.tp)


@pytest.mark.parametrize("draw", range(3))
def test_serial_grid_bound_holds_every_whole_grid(draw):
    """No whole-number grid beats the real-valued optimum of the serial axes."""
    layer, device = random_case()
    bound = largest_fsdp_tp_grid(layer, device, overlap_axes=False)
    grids = compute_bound_grids(layer, device, overlap_axes=False)
    assert max(f * t for f, t in grids) <= bound.devices * (1 + 1e-12)


def test_serial_grid_optimum_by_hand():
    """B = 24, F = 16, b = 2 and W/(bC) = 1/8 (C = 4, W = 1): 48 N_F + 48 N_T <= 6·24·16/8 + 48 + 48 = 384, so
    N_F = N_T = 384/96 = 4, 16 devices. The 4 x 4 forward: 3·2·24·4·16 / 16 = 576 FLOPs, 144 s; three all-gathers
    of 128/4 = 32 bytes over 4, 3 · 3/4 · 32 = 72 bytes, and an all-reduce of 24/4 rows, 2·6·4 = 48 bytes,
    2 · 3/4 · 48 = 72 bytes: 144 s, exactly balanced; no whole grid holds more."""
    layer, device = SwiGLULayer(batch=24, d_model=4, d_ff=16), Accelerator(flops_per_s=4, egress_bandwidth=1)
    bound = largest_fsdp_tp_grid(layer, device, overlap_axes=False)
    assert (bound.fsdp, bound.tp) == (4, 4)
    step = fsdp_tp_step(layer, 4, 4).forward
    assert step.compute_seconds(device) == 144 and step.axis_seconds(device) == {"fsdp": 72, "tp": 72}
    assert max(f * t for f, t in compute_bound_grids(layer, device, overlap_axes=False)) == 16


@pytest.mark.parametrize(("batch", "d_ff", "grid"), [
    # In units of b, 3F N_F + 2B N_T <= 6BF/8 + 3F + 2B. B = 1, F = 16: 48 N_F + 2 N_T <= 12 + 48 + 2 = 62, whose
    # product peaks at N_F = 62/96, below one device; so N_F = 1 and N_T = (62 - 48)/2 = 7, TP's own 1 + 3·16/8.
    (1, 16, (1, 7)),
    # B = 64, F = 1: 3 N_F + 128 N_T <= 48 + 3 + 128 = 179, peaking at N_T = 179/256; so N_T = 1 and
    # N_F = (179 - 128)/3 = 17, FSDP's own 1 + 2·64/8.
    (64, 1, (17, 1)),
])
def test_serial_grid_keeps_an_axis_at_one_device(batch, d_ff, grid):
    bound = largest_fsdp_tp_grid(SwiGLULayer(batch=batch, d_model=4, d_ff=d_ff), DEVICE, overlap_axes=False)
    assert (bound.fsdp, bound.tp) == grid


def test_serial_axes_hold_a_quarter_of_the_overlapped_devices_at_scale():
    """Overlapped (1 + 2Br)(1 + 3Fr) ~ 6BFr², serial K²/(24BF) ~ (6BFr)²/(24BF) = 1.5BFr², with r = W/(bC):
    at r = 1e6 and B = F = 16 the terms left out are about 1/(Br) = 6e-8 of them."""
    layer = SwiGLULayer(batch=16, d_model=4, d_ff=16)
    device = Accelerator(flops_per_s=1.0, egress_bandwidth=2e6)
    overlapped = largest_fsdp_tp_grid(layer, device, overlap_axes=True).devices
    serial = largest_fsdp_tp_grid(layer, device, overlap_axes=False).devices
    assert overlapped / serial == pytest.approx(4, rel=1e-6)


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda: SwiGLULayer(batch=0, d_model=4, d_ff=16), ValueError, "batch must be at least 1"),
    (lambda: SwiGLULayer(batch=8, d_model=4.0, d_ff=16), TypeError, "d_model must be an int"),
    (lambda: SwiGLULayer(batch=8, d_model=4, d_ff=16, bytes_per_element=True), TypeError, "bytes_per_element"),
    (lambda: Accelerator(flops_per_s=0, egress_bandwidth=1), ValueError, "flops_per_s must be positive"),
    (lambda: Accelerator(flops_per_s=1, egress_bandwidth=math.inf), ValueError, "egress_bandwidth must be positive"),
    (lambda: Accelerator(flops_per_s="1e15", egress_bandwidth=1), TypeError, "flops_per_s must be a number"),
    (lambda: Collective("broadcast", 8, 2), ValueError, "unknown collective 'broadcast'"),
    (lambda: Collective("all-gather", -8, 2), ValueError, "nbytes must be zero or more"),
    (lambda: dp_step(LAYER, 0), ValueError, "devices must be at least 1"),
    (lambda: fsdp_tp_step(LAYER, 2, 2.0), TypeError, "tp must be an int"),
    (lambda: smallest_batch_per_device(DEVICE, 0), ValueError, "devices must be at least 1"),
])
def test_bad_inputs_get_clear_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()
