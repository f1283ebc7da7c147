"""The report's layout tables (systems.report.layouts): bench_layouts' points as the bench saves them, each
layout's step beside its axes, and the prediction of which layout wins built from the run's own figures."""

import pytest

from histories import config, entry, phases, rate, save_run
from systems.accounting.layouts import Cluster, Compute, Links, fastest, predict_layouts
from systems.bench.schema import LAYOUT_BUCKET_MB, AxisComm, LayoutMeasured, LayoutPoint
from systems.model import get_config
from systems.levers.layout import Layout
from systems.levers.variant import Variant
from systems.parallel.spec import TrainSpec
from systems.precision import PRECISIONS
from test_report import columns_and_rows, report

BF16 = PRECISIONS["bf16"]
SINGLE = phases(0.3, forward=0.1, backward=0.17, optimizer=0.03)


def layout_point(variant: Variant, grid: Layout, context: int = 64) -> LayoutPoint:
    """A point of bench_layouts' grid: the tiny model over `grid`, which the meshed variants' spec holds."""
    return LayoutPoint(TrainSpec(preset="tiny", variant=variant, layout=grid if variant.meshed else None,
                                 precision=BF16, batch_size=4, context=context, bucket_size_mb=LAYOUT_BUCKET_MB), grid)


def layout(variant: Variant, grid: Layout, step: float, axes: dict[str, AxisComm], context: int = 64) -> dict:
    point = layout_point(variant, grid, context)
    timed = SINGLE if variant == Variant.SINGLE else phases(step, comm_wait=0.004, gather_wait=0.002)
    measured = LayoutMeasured(backend="nccl", phases=timed, tokens_per_s=1e4, throughput=rate(100.0),
                              memory_mb=None, config=config("tiny", context), axes=axes)
    return entry(point, measured, step)


# Shard axis of FSDP over 4: 96 MiB in 0.4 ms; HSDP's shard and replicate axes.
FSDP_SHARD = AxisComm.of(4, 96 * 2**20, 0.0004)
BENCHMARKS = [layout(Variant.TORCH_HSDP, Layout(2, 2), 0.36, {"shard": AxisComm.of(2, 50 * 2**20, 0.0002),
                                                               "replicate": AxisComm.of(2, 20 * 2**20, 0.0001)}),
              layout(Variant.HSDP, Layout(2, 2), 0.33, {"shard": AxisComm.of(2, 48 * 2**20, 0.0002),
                                                        "replicate": AxisComm.of(2, 24 * 2**20, 0.0001)}),
              layout(Variant.FSDP, Layout(shard=4), 0.35, {"shard": FSDP_SHARD}),
              layout(Variant.BUCKETED, Layout(replicate=4), 0.45, {"replicate": AxisComm.of(4, 60 * 2**20, 0.0005)}),
              layout(Variant.SINGLE, Layout(), 0.3, {})]
OOM = [layout_point(Variant.HSDP, Layout(2, 2), 4096)]


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("layouts")
    save_run(tmp_path / "storage", 1, BENCHMARKS, OOM)
    code, out = report(tmp_path)
    assert code == 0
    return out


def test_layouts_come_in_order_with_each_axis_beside_the_step(tables):
    """One process, DDP, FSDP, ours and torch's HSDP (saved out of order), then the out-of-memory point; the step
    in ms against one process's, and per axis its ranks, MiB sent, time alone (ms) and bus bandwidth (GB/s)."""
    rows = columns_and_rows(tables / "layouts.md")
    assert [(row["variant"], row["layout"], row["ranks"]) for row in rows] == [
        ("single", "1x1", "1"), ("bucketed", "4x1", "4"), ("fsdp", "1x4", "4"), ("hsdp", "2x2", "4"),
        ("torch-hsdp", "2x2", "4"), ("hsdp", "2x2", "4")]
    hsdp = rows[3]
    assert (hsdp["step"], hsdp["comm wait"], hsdp["all-gather wait"], hsdp["vs single"]) == ("330", "4", "2", "1.1")
    assert (hsdp["shard ranks"], hsdp["shard MiB sent"], hsdp["shard alone (ms)"]) == ("2", "48", "0.2")
    assert hsdp["shard GB/s"] == f"{48 * 2**20 / 0.0002 / 1e9:.4g}"
    assert (hsdp["replicate ranks"], hsdp["replicate MiB sent"], hsdp["replicate alone (ms)"]) == ("2", "24", "0.1")
    assert rows[2]["replicate MiB sent"] == "" and rows[1]["shard MiB sent"] == ""
    assert rows[0]["vs single"] == "" and rows[0]["step"] == "300"
    assert (rows[5]["context"], rows[5]["step"]) == ("4096", "OOM")


def test_the_prediction_takes_one_process_compute_and_fsdps_shard_bandwidth(tables):
    """At 25 and 50 GB/s across nodes and 2, 8, 64 nodes of 8 GPUs: DDP, FSDP and HSDP's steps and exposed
    communication as systems.accounting.layouts predicts them from one process's phases and the FSDP point's
    measured shard-axis bandwidth."""
    rows = columns_and_rows(tables / "layout_prediction.md")
    assert [(row["inter GB/s (assumed)"], row["nodes"], row["GPUs"]) for row in rows] == [
        (inter, nodes, str(8 * int(nodes))) for inter in ("25", "50") for nodes in ("2", "8", "64")]
    compute = Compute(forward_s=0.1, backward_s=0.17, optimizer_s=0.03)
    for row in rows:
        assert row["intra GB/s (measured)"] == f"{FSDP_SHARD.busbw_gbps:.4g}"
        links = Links(FSDP_SHARD.busbw_gbps * 1e9, float(row["inter GB/s (assumed)"]) * 1e9)
        steps = predict_layouts(get_config("tiny", context_length=64), BF16, Cluster(int(row["nodes"]), 8), links,
                                compute, bucket_size_mb=LAYOUT_BUCKET_MB)
        for name, step in steps.items():
            assert row[name] == f"{step.step_s * 1e3:.4g}" and row[f"{name} exposed"] == f"{step.exposed_s * 1e3:.4g}"
        assert row["fastest"] == fastest(steps)


def test_no_prediction_without_a_one_process_point(tmp_path):
    save_run(tmp_path / "storage", 1, BENCHMARKS[:-1])
    code, out = report(tmp_path)
    assert code == 0 and (out / "layouts.md").exists() and not (out / "layout_prediction.md").exists()
