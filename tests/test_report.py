"""The report: a table per deliverable, selected by point kind, and its plots, from histories as the benches save
them (tests/histories.py); a comparison of two runs; runs merged from chunks."""

import pathlib
import re

import matplotlib.image
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

import systems.report
from histories import MACHINE, TESTS, allreduce_measured, config, entry, phases, rate, save_run, step_breakdown
from systems.accounting import BucketedAllReduce, count_parameters, peak_memory
from systems.bench.predictions import predicted_peak_mb
from systems.bench.schema import (AllReducePoint, AttentionMeasured, AttentionPoint, CheckpointMeasured,
                                  CheckpointPoint, CollectiveBandwidth, DDPMeasured, DDPPoint, FFNBandwidthMeasured,
                                  FFNBandwidthPoint, FFNMeasured, FFNPoint, FSDPMeasured, FSDPPoint, FullStepMeasured,
                                  FullStepPoint, ModelMeasured, ModelPoint, OptimizerMeasured, OptimizerPoint, Passes,
                                  WarmupMeasured, WarmupPoint)
from systems.levers.checkpointing import Checkpointing
from systems.levers.sharding import Gather
from systems.levers.variant import Optimizer, Variant
from systems.model import get_config
from systems.precision import PRECISIONS
from systems.parallel.spec import TrainSpec
from systems.parallel.swiglu import FFNLayout
from systems.report import main, plots
from systems.report.plots import _figure, build_plots
from systems.report.runs import load_run, merge_runs

FP32, BF16 = PRECISIONS["fp32"], PRECISIONS["bf16"]


def model_benchmarks(scale: float = 1.0) -> list[dict]:
    out = []
    for context in (128, 256):
        for name in ("fp32", "bf16", "bf16-weights"):
            for phase, seconds in (("forward", 0.01), ("backward", 0.02), ("forward_backward", 0.03), ("step", 0.04)):
                seconds *= scale * context / 128 * (2 if name == "fp32" else 1)
                point = ModelPoint("small", "2025", 4, context, PRECISIONS[name], "sdpa", "eager", phase)
                out.append(entry(point, ModelMeasured(1, None, rate(100.0 * context / 128), 1000.0 + context,
                                                      config("small", context)), seconds))
    out += [entry(WarmupPoint("small", "2025", 4, 128, FP32, "sdpa", n), WarmupMeasured(None, config("small", 128)),
                  0.5 / (n + 1)) for n in (0, 1, 2, 5)]
    return out


def attention(sweep, impl, seq, d, precision, pass_, seconds, **measured) -> dict:
    batch, causal = {"handout": (8, False), "flash": (1, True), "leaderboard": (16, True)}[sweep]
    point = AttentionPoint(sweep, impl, batch, seq, d, precision, causal, pass_, measured.pop("first_seq", None))
    figures = dict(peak_memory_mb=None, memory_before_backward_mb=None, device_ms=None, sdpa_device_ms=None,
                   do_bench_ms=None, sdpa_do_bench_ms=None) | measured
    return entry(point, AttentionMeasured(ms=seconds * 1e3, throughput=rate(1.0), **figures), seconds)


def attention_benchmarks() -> list[dict]:
    out = []
    for seq in (256, 1024):
        out += [attention("handout", "naive", seq, 16, FP32, pass_, seq * 1e-6, memory_before_backward_mb=float(seq))
                for pass_ in ("forward", "backward")]
        for impl, speed in (("triton", 4), ("sdpa", 5), ("naive", 1)):
            kernels = dict(device_ms=seq / 5e3, sdpa_device_ms=seq / 4e3) if impl == "triton" else {}
            out.append(attention("flash", impl, seq, 64, BF16, "forward", seq * 1e-6 / speed, **kernels))
    out.append(attention("leaderboard", "triton", 16384, 64, BF16, "forward", 0.002, do_bench_ms=1.9,
                         sdpa_do_bench_ms=1.5))
    out.append(attention("leaderboard", "triton", 16384, 64, BF16, "forward", 0.003, first_seq=1024, do_bench_ms=2.9,
                         sdpa_do_bench_ms=1.45))
    return out


OOM = [AttentionPoint("handout", "naive", 8, 16384, 16, FP32, False, "forward"),
       AttentionPoint("flash", "naive", 1, 1024, 128, BF16, True, "forward"),
       DDPPoint(TrainSpec(preset="small", variant=Variant.BUCKETED, bucket_size_mb=100.0, precision=FP32,
                          batch_size=4, context=128), 2)]


def ddp(variant: Variant, bucket: float | None, ranks: int, step: float, wait: float, backward: float = 0.06,
        precision=FP32) -> dict:
    point = DDPPoint(TrainSpec(preset="small", variant=variant, bucket_size_mb=bucket, precision=precision,
                               batch_size=4, context=128), ranks)
    return entry(point, DDPMeasured("nccl", phases(step, backward=backward, comm_wait=wait), 1e4, rate(50.0), None,
                                    config("small", 128), 0.0, wait / step), 5.0)


def distributed_benchmarks() -> list[dict]:
    out = [entry(AllReducePoint("nccl", 2, float(mb)),
                 allreduce_measured(mb * 2**20, 1e-5 + mb * 2**20 / 100e9, mb * 2**20 / 200e9), 1.0)
           for mb in (1, 10, 100)]
    out += [ddp(Variant.SINGLE, None, 1, 0.100, 0.0), ddp(Variant.TORCH, 25.0, 2, 0.110, 0.0),
            ddp(Variant.NAIVE, None, 2, 0.150, 0.040), ddp(Variant.BUCKETED, 1.0, 2, 0.120, 0.012),
            ddp(Variant.BUCKETED, 10.0, 2, 0.115, 0.008)]
    for optimizer, share in ((Optimizer.ADAMW, 1.0), (Optimizer.SHARDED, 0.5)):
        point = OptimizerPoint(TrainSpec(preset="small", variant=Variant.BUCKETED, bucket_size_mb=25.0,
                                         optimizer=optimizer, precision=FP32, batch_size=4, context=128), 2)
        out.append(entry(point, OptimizerMeasured([981.0 * share] * 2, 981.0, share, 0.5, 0.01, 0.2,
                                                  {"before_step": 3000.0 - 500 * (1 - share)}), 5.0))
    return out


@pytest.fixture
def tables_only(monkeypatch):
    """The report without its plots, for tests of which tables a run gets: a figure takes a second to draw, and
    each kind's figures are drawn and checked in the tests of the plots."""
    monkeypatch.setattr(systems.report, "build_plots", lambda run, out: [])


def report(tmp_path, *args) -> tuple[int, pathlib.Path]:
    out = tmp_path / "report"
    return main(["--storage", str(tmp_path / "storage"), "--out", str(out), *args]), out


def table_rows(path: pathlib.Path) -> list[list[str]]:
    lines = [line for line in path.read_text().splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def columns_and_rows(path: pathlib.Path) -> list[dict[str, str]]:
    """A table's rows, each as {column: cell}."""
    header = next(line for line in path.read_text().splitlines() if line.startswith("|"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    return [dict(zip(columns, row)) for row in table_rows(path)]


def test_every_deliverable_gets_its_table_and_plots(tmp_path):
    save_run(tmp_path / "storage", 1, model_benchmarks() + attention_benchmarks() + distributed_benchmarks(),
             oom=OOM)
    code, out = report(tmp_path)
    assert code == 0
    for name in ("model", "precision", "memory", "warmup", "attention_handout", "attention_flash",
                 "attention_forward_kernels", "attention_leaderboard", "allreduce", "ddp", "ddp_buckets",
                 "sharded_optimizer"):
        assert (out / f"{name}.md").read_text() in (out / "report.md").read_text()

    model = table_rows(out / "model.md")
    assert ["small", "128", "bf16", "eager", "10 ± 0.5", "20 ± 1", "30 ± 1.5", "40 ± 2"] in model
    assert ["small", "256", "fp32", "eager", "40 ± 2", "80 ± 4", "120 ± 6", "160 ± 8"] in model
    assert ["small", "128", "eager", "step", "80", "40", "2.00x"] in table_rows(out / "precision.md")
    for precision in ("bf16", "bf16-weights"):  # every precision has predictions, bf16-weights included
        predicted = peak_memory(get_config("small", context_length=256), 4, 256, PRECISIONS[precision])
        assert ["small", "256", precision, "eager", "1,256", "1,256", "1,256", "1,256",
                f"{predicted.forward / 2**20:,.0f}", f"{predicted.forward_backward / 2**20:,.0f}",
                f"{predicted.train_step / 2**20:,.0f}"] in table_rows(out / "memory.md")
    assert [row[0] for row in table_rows(out / "warmup.md")] == ["0", "1", "2", "5"]

    handout = table_rows(out / "attention_handout.md")
    assert ["naive", "16", "1024", "1.024 ± 0.051", "1.024 ± 0.051", "1,024"] in handout  # MiB, as memory reads
    assert ["naive", "16", "16384", "OOM", ""] in [row[:5] for row in handout]
    flash = (out / "attention_flash.md").read_text()
    assert "| precision | d | seq | pass | naive | sdpa | triton |" in flash
    assert "| bf16 | 64 | 1024 | forward | 1.024 | 0.2048 | 0.256 |" in flash
    assert "| bf16 | 128 | 1024 | forward | OOM |" in flash
    assert table_rows(out / "attention_forward_kernels.md") == [["bf16", "64", "256", "0.0512", "0.064", "0.8"],
                                                               ["bf16", "64", "1024", "0.2048", "0.256", "0.8"]]
    assert table_rows(out / "attention_leaderboard.md") == [["forward", "16384", "2", "1.9", "1.5", "1.267"],
                                                          ["forward", "1024", "3", "2.9", "1.45", "2"]]

    assert ["nccl", "2", "100", f"{(1e-5 + 100 * 2**20 / 100e9) * 1e3:.4g}", "0.001",
            f"{100 * 2**20 / (1e-5 + 100 * 2**20 / 100e9) / 1e9:.4g}", f"{100 * 2**20 / 200e9 * 1e3:.4g}", "0.0001",
            "200", "200", "210", "0.9524"] in table_rows(out / "allreduce.md")
    ddp_rows = table_rows(out / "ddp.md")
    assert [row[3] for row in ddp_rows] == ["single", "torch", "naive", "bucketed", "bucketed", "bucketed"]
    assert ddp_rows[-1][:6] == ["fp32", "128", "2", "bucketed", "100", "OOM"]
    assert ddp_rows[2][:10] == ["fp32", "128", "2", "naive", "", "150", "30", "60", "40", "10"]
    # vs single and vs torch DDP, from the same run's points at the same shape
    assert ddp_rows[2][11:13] == ["1.5", f"{0.150 / 0.110:.4g}"] and ddp_rows[0][11:13] == ["", ""]
    assert [row[:7] for row in table_rows(out / "ddp_buckets.md")] == [
        ["fp32", "128", "2", "1", "120", "60", "12"], ["fp32", "128", "2", "10", "115", "60", "8"]]
    optimizers = table_rows(out / "sharded_optimizer.md")
    assert ["2", "sharded", "490", "981", "0.5", "0.5", "2,750", "10", "200"] in optimizers  # MiB whole

    for name in ("model_forward", "model_step", "attention_handout_forward_fp32", "attention_flash_forward_bf16",
                 "allreduce_bandwidth", "ddp_buckets"):
        image = matplotlib.image.imread(out / f"{name}.png")
        assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0
        assert f"({name}.png)" in (out / "report.md").read_text()


def test_tables_select_by_point_kind_not_by_test_name(tmp_path):
    """A bench renamed (another module and test function) keeps its table: the report reads the point's kind."""
    renamed = []
    for benchmark in model_benchmarks()[:4]:
        name = benchmark["name"].replace("test_model", "test_phases_of_a_step")
        renamed.append({**benchmark, "name": name, "fullname": f"benches/bench_renamed.py::{name}"})
    save_run(tmp_path / "storage", 1, renamed)
    code, out = report(tmp_path)
    assert code == 0
    assert table_rows(out / "model.md") == [
        ["small", "128", "fp32", "eager", "20 ± 1", "40 ± 2", "60 ± 3", "80 ± 4"]]
    assert not list(out.glob("*renamed*")) and not list(out.glob("test_phases_of_a_step*"))


def test_bucket_sweep_shows_the_bucket_model(tmp_path, tables_only):
    save_run(tmp_path / "storage", 1, distributed_benchmarks())
    code, out = report(tmp_path)
    assert code == 0
    rows = table_rows(out / "ddp_buckets.md")
    # The all-reduce points lie on time = 10 µs + bytes / 100 GB/s; with 2 ranks busbw equals algbw.
    model = BucketedAllReduce(backward_seconds=0.06, param_bytes=4 * count_parameters(get_config("small")),
                              world_size=2, bandwidth=100e9, latency=1e-5)
    buckets = -(-model.param_bytes // 2**20)
    assert rows[0][7] == f"{model.overhead(int(buckets)) * 1e3:.4g}"
    assert float(rows[0][8]) == pytest.approx(model.optimal_bucket_bytes() / 2**20, rel=1e-3)


def fsdp_point(variant: Variant, context: int = 512, prefetch: int = 1, gather: Gather = Gather.LAYER) -> FSDPPoint:
    """A point of bench_fsdp's grid of the xl model: ours at `prefetch` and `gather`, bucketed DDP at 100 MiB."""
    levers = ({"fsdp_prefetch": prefetch, "fsdp_gather": gather} if variant == Variant.FSDP else
              {"bucket_size_mb": 100.0} if variant == Variant.BUCKETED else {})
    return FSDPPoint(TrainSpec(preset="xl", variant=variant, precision=BF16, batch_size=16, context=context,
                               **levers), 1 if variant == Variant.SINGLE else 2)


def fsdp(variant: Variant, step: float, prefetch: int = 1, gather: Gather = Gather.LAYER, context=512,
         **figures) -> dict:
    """A bench_fsdp benchmark of the xl model, as the bench saves it."""
    point = fsdp_point(variant, context, prefetch, gather)
    measured = dict(backend="nccl", phases=phases(step, forward=step / 3, gather_wait=figures.pop("gather_wait",
                                                                                                 None)),
                    tokens_per_s=1e4, throughput=rate(200.0), memory_mb=None, config=config("xl", context),
                    predicted_peak_mb=None, peak_gathered_mb=None, breakdown_per_rank=None) | figures
    return entry(point, FSDPMeasured(**measured), step)


def test_fsdp_table_puts_each_variant_beside_one_process_with_its_peak_against_the_prediction(tmp_path):
    """Saved out of order, the FSDP points come back in the comparison's order (one process, DDP, ours by prefetch
    depth and group, torch's), with the step and all-gather wait in ms, the largest of the recorded peaks, that
    peak over the prediction, and the step against one process's of the same run."""
    benchmarks = [fsdp(Variant.FSDP2, 0.5, memory_mb={"before_step": 900.0, "after_step": 950.0}),
                  fsdp(Variant.FSDP, 0.41, gather=Gather.BLOCK),
                  fsdp(Variant.FSDP, 0.44, prefetch=5, gather_wait=0.002),
                  fsdp(Variant.FSDP, 0.48, gather_wait=0.0123, memory_mb={"before_step": 1200.0, "after_step": 1100.0},
                       predicted_peak_mb=1000.0, peak_gathered_mb=64.0),
                  fsdp(Variant.SINGLE, 0.4), fsdp(Variant.BUCKETED, 0.45)]
    oom = [fsdp_point(Variant.FSDP, 1024, prefetch=2)]
    save_run(tmp_path / "storage", 1, benchmarks, oom)
    code, out = report(tmp_path)
    assert code == 0
    rows = columns_and_rows(out / "fsdp.md")
    assert [(row["variant"], row["prefetch"], row["gather"]) for row in rows] == [
        ("single", "", ""), ("bucketed", "", ""), ("fsdp", "1", "block"), ("fsdp", "1", "layer"),
        ("fsdp", "5", "layer"), ("fsdp2", "", ""), ("fsdp", "2", "layer")]
    assert rows[2]["step"] == "410"
    ours = rows[3]
    assert (ours["step"], ours["forward"], ours["all-gather wait"]) == ("480", "160", "12.3")
    # The prediction is today's accounting's for the point's levers; the run's own (1,000) follows in brackets.
    today = predicted_peak_mb(fsdp_point(Variant.FSDP).spec, 2, "cuda")
    assert (ours["peak"], ours["predicted peak"], ours["peak / predicted"]) == (
        "1,200", f"{today:,.0f} (1,000)", f"{1200 / today:.2f}")
    assert (ours["vs single"], ours["gathered weights"]) == ("1.2", "64")
    assert rows[1]["vs single"] == "1.125" and rows[0]["vs single"] == ""
    assert rows[4]["all-gather wait"] == "2"
    assert rows[5]["peak"] == "950"
    assert (rows[6]["context"], rows[6]["step"]) == ("1024", "OOM")


def fullstep_point(attention: str, checkpoint: str = "every1", gather: Gather = Gather.BLOCK,
                   context: int = 32768) -> FullStepPoint:
    """The leaderboard's point of bench_fullstep's grid on 2 ranks: our FSDP at prefetch 1."""
    return FullStepPoint(TrainSpec(preset="leaderboard-2026", variant=Variant.FSDP, precision=BF16, batch_size=1,
                                   context=context, attention=attention, checkpoint=checkpoint, loss_chunk=4096,
                                   fsdp_gather=gather, fsdp_prefetch=1), 2)


def fullstep(attention: str, step: float, checkpoint: str = "every1", gather: Gather = Gather.BLOCK,
             **figures) -> dict:
    """A bench_fullstep benchmark of the leaderboard's point on 2 ranks, as the bench saves it."""
    point = fullstep_point(attention, checkpoint, gather)
    measured = dict(backend="nccl", phases=phases(step, forward=step / 3), tokens_per_s=1e4, throughput=rate(300.0),
                    memory_mb=None, config=config("leaderboard-2026", 32768), predicted_peak_mb=None,
                    peak_gathered_mb=None, breakdown_per_rank=None, do_bench_s=None, cold_start_s=None,
                    step_pflop=5.04, recomputed_tflop=1.0, peak_memory_mb_per_rank=None) | figures
    return entry(point, FullStepMeasured(**measured), step)


def test_fullstep_table_is_compact_and_replaces_the_dump_of_every_figure(tmp_path):
    """The leaderboard's figures per point (do_bench step, MFU, tokens/s, each rank's peak against the
    prediction, cold start), points in order, an out-of-memory point as a row, and no generic table."""
    # The run stored what today's accounting predicts: the cell holds it alone.
    today = predicted_peak_mb(fullstep_point("sdpa").spec, 2, "cuda")
    figures = dict(do_bench_s=6.5, throughput=rate(389.6, 0.3939), tokens_per_s=10123.5,
                   peak_memory_mb_per_rank=[70535.6, 70000.0], predicted_peak_mb=today, cold_start_s=115.45)
    oom = [fullstep_point("sdpa", gather=Gather.LAYER, context=65536)]
    save_run(tmp_path / "storage", 1, [fullstep("sdpa", 6.53, **figures),
                                       fullstep("flash", 7.03, "none", Gather.LAYER)], oom)
    code, out = report(tmp_path)
    assert code == 0
    rows = columns_and_rows(out / "fullstep.md")
    assert [(row["context"], row["attention"], row["checkpoint every"], row["gather"]) for row in rows] == [
        ("32768", "flash", "none", "layer"), ("32768", "sdpa", "1", "block"), ("65536", "sdpa", "1", "layer")]
    # torchtitan's count of the same step (attention whole, a backward of two forwards) is 1.2965 times ours
    assert {k: rows[1][k] for k in ("fused kernels", "compiled", "step", "do_bench step", "MFU",
                                    "MFU, torchtitan's count", "tokens/s", "peak per rank", "predicted peak",
                                    "peak / predicted", "cold start (s)")} == {
        "fused kernels": "none", "compiled": "no", "step": "6.53", "do_bench step": "6.5", "MFU": "39.4%",
        "MFU, torchtitan's count": "51.1%", "tokens/s": "10,124", "peak per rank": "68.88, 68.36",
        "predicted peak": f"{today / 1024:.2f}", "peak / predicted": f"{70535.6 / today:.2f}",
        "cold start (s)": "115.5"}
    assert rows[2]["step"] == "OOM"
    assert sorted(path.name for path in out.glob("*.md")) == ["fullstep.md", "report.md"]


def test_breakdown_table_has_a_row_per_point_and_rank_with_idle_the_span_less_busy(tmp_path):
    """Kind by kind, points in their tables' order, ranks in order; a point without breakdowns has no rows."""
    spans = {"flash": [(0.5, 0.45), (0.5, 0.4)], "sdpa": [(0.4, 0.4), (0.42, 0.3)], "fsdp": [(0.2, 0.15), (0.2, 0.1)]}
    benchmarks = [fullstep(attention, 1.0, breakdown_per_rank=[step_breakdown(*s) for s in spans[attention]])
                  for attention in ("sdpa", "flash")]
    benchmarks += [fsdp(Variant.FSDP, 0.2, breakdown_per_rank=[step_breakdown(*s) for s in spans["fsdp"]]),
                   fsdp(Variant.SINGLE, 0.1)]
    save_run(tmp_path / "storage", 1, benchmarks)
    code, out = report(tmp_path)
    assert code == 0
    rows = columns_and_rows(out / "breakdown.md")
    assert [(row["bench"], row["variant"], row["attention"], row["rank"]) for row in rows] == [
        ("fsdp", "fsdp", "", "0"), ("fsdp", "fsdp", "", "1"), ("fullstep", "fsdp", "flash", "0"),
        ("fullstep", "fsdp", "flash", "1"), ("fullstep", "fsdp", "sdpa", "0"), ("fullstep", "fsdp", "sdpa", "1")]
    for row, (span, busy) in zip(rows, spans["fsdp"] + spans["flash"] + spans["sdpa"]):
        assert (row["span"], row["busy"]) == (f"{span * 1e3:.4g}", f"{busy * 1e3:.4g}")
        assert row["idle"] == f"{(span - busy) * 1e3:.4g} ({(span - busy) / span:.1%})"
        assert row["matmul"] == f"{0.4 * busy * 1e3:.4g} ({0.4 * busy / span:.1%})"
    assert rows[0]["idle"] == "50 (25.0%)" and rows[4]["idle"] == "0 (0.0%)"
    assert rows[2]["recompute"] == "90 (18.0%)" and rows[2]["checkpoint every"] == "1"


@pytest.mark.parametrize("benchmarks", [[fsdp(Variant.FSDP, 0.2)], [fullstep("sdpa", 6.5)], []],
                         ids=["fsdp", "fullstep", "neither"])
def test_points_without_breakdowns_have_no_breakdown_table(tmp_path, benchmarks):
    save_run(tmp_path / "storage", 1, benchmarks + distributed_benchmarks()[:1])
    code, out = report(tmp_path)
    assert code == 0
    assert not (out / "breakdown.md").exists() and "GPU time goes" not in (out / "report.md").read_text()


def test_all_reduce_points_without_back_to_back_figures_show_their_per_call_ones(tmp_path):
    """Runs made before the back-to-back figures timed one call at a time: not nccl-tests' figures."""
    save_run(tmp_path / "storage", 1, [entry(AllReducePoint("nccl", 2, 1.0), allreduce_measured(2**20, 4e-5, None),
                                             1.0)])
    code, out = report(tmp_path)
    assert code == 0
    assert ("| backend | ranks | MiB | per call, sync each (ms) | spread across ranks (ms) | per call busbw (GB/s) "
            "| bare loop busbw (GB/s) |") in (out / "allreduce.md").read_text()
    assert table_rows(out / "allreduce.md") == [["nccl", "2", "1", "0.04", "0.001", f"{2**20 / 4e-5 / 1e9:.4g}",
                                                 "210"]]


def test_checkpoint_table_puts_every_scheme_beside_none_and_predicts_out_of_memory_points(tmp_path):
    def point(scheme: str) -> CheckpointPoint:
        return CheckpointPoint("small", "2025", 4, 256, FP32, "sdpa", Checkpointing.parse(scheme))

    def measured(levels: tuple, activation: float) -> CheckpointMeasured:
        return CheckpointMeasured(levels, 1, 500.0, 900.0, 400.0, 500.0 + activation, activation, 0.5, 1e3,
                                  rate(1.0), config("small", 256))

    benchmarks = [entry(point("nested"), measured((3, 1), 100.0), 0.3), entry(point("every1"), measured((1,), 80.0),
                                                                              0.25),
                  entry(point("none"), measured((), 400.0), 0.2)]
    save_run(tmp_path / "storage", 1, benchmarks, oom=[point("every4")])
    code, out = report(tmp_path)
    assert code == 0
    rows = columns_and_rows(out / "checkpointing.md")
    assert [(row["scheme"], row["segments"], row["step"]) for row in rows] == [
        ("none", "", "200"), ("every1", "1", "250"), ("every4", "", "OOM"), ("nested", "3x1", "300")]
    assert (rows[1]["step vs none"], rows[1]["activation vs none"]) == ("1.250", "0.200")
    assert rows[2]["predicted peak"] and rows[2]["peak"] == ""


def test_absent_benchmarks_are_absent_from_the_report(tmp_path):
    save_run(tmp_path / "storage", 1, distributed_benchmarks()[:3])
    code, out = report(tmp_path)
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["allreduce.md", "allreduce_bandwidth.png", "report.md"]


def test_benchmarks_without_points_get_a_table_of_their_own(tmp_path):
    """Another project's benchmarks, run with the plugin, hold no point: a table per test, of their figures."""
    foreign = {**entry(AllReducePoint("gloo", 2, 1.0), allreduce_measured(2**20, 1e-3, None), 0.003),
               "name": "test_thing[a-1]", "fullname": "benches/bench_new.py::test_thing[a-1]", "params": {"x": 1},
               "extra_info": {"kind": "a", "score": 0.5}}
    save_run(tmp_path / "storage", 1, [foreign])
    code, out = report(tmp_path)
    assert code == 0
    assert table_rows(out / "test_thing.md") == [["a", "0.5", "1", "3 ± 0.15"]]


def test_compare_flags_regressions(tmp_path, tables_only):
    storage = tmp_path / "storage"
    save_run(storage, 1, model_benchmarks(), stamp="20260101_120000")
    slower = model_benchmarks()
    slower[0]["stats"]["mean"] *= 2  # small ctx128 fp32 forward
    slower[1]["stats"]["mean"] *= 0.5
    save_run(storage, 2, slower[:-1], stamp="20260102_120000")  # without warmup5
    code, out = report(tmp_path, "--compare", "1")
    assert code == 0
    rows = table_rows(out / "comparison.md")
    assert rows[0] == ["test_model[small-2025-b4-ctx128-fp32-sdpa-eager-forward]", "20", "40", "2.000", "1.000",
                       "REGRESSION"]
    assert rows[-1][3:] == ["0.500", "1.000", "faster"]
    assert all(row[-1] == "" for row in rows[1:-1])
    text = (out / "comparison.md").read_text()
    assert "1 of 27 benchmarks slower by more than 10%" in text and "Only in run 0001: 1 of test_warmup_study" in text


def test_latest_run_and_machine_by_default(tmp_path, tables_only):
    storage = tmp_path / "storage"
    save_run(storage, 1, model_benchmarks(), stamp="20260101_120000")
    save_run(storage, 2, distributed_benchmarks(), stamp="20260102_120000")
    save_run(storage, 1, attention_benchmarks(), machine="Linux-CPython-3.11-64bit", stamp="20251231_120000")
    assert report(tmp_path)[0] == 0
    assert (tmp_path / "report" / "report.md").read_text().startswith("# Benchmark report: run 0002")
    code, out = report(tmp_path, "--run", "0001")
    assert code == 0
    assert (out / "model.md").exists() and not (out / "attention_flash.md").exists()
    code, out = report(tmp_path, "--machine", "Linux-CPython-3.11-64bit")
    assert code == 0
    assert (out / "attention_flash.md").exists()


def test_runs_saved_in_chunks_merge_and_later_runs_win(tmp_path, tables_only):
    storage = tmp_path / "storage"
    save_run(storage, 1, attention_benchmarks(), oom=OOM[1:2], stamp="20260101_120000")  # naive d128 ran out
    save_run(storage, 2, model_benchmarks(), stamp="20260102_120000")
    rerun = [attention("flash", "naive", 1024, 128, BF16, "forward", 0.004),
             attention("flash", "sdpa", 1024, 64, BF16, "forward", 0.003)]
    save_run(storage, 3, rerun, oom=OOM[:1], stamp="20260103_120000")  # and a handout point runs out
    code, out = report(tmp_path, "--run", "1-3")
    assert code == 0
    text = (out / "report.md").read_text()
    assert text.startswith("# Benchmark report: run 0001-0003\n")
    assert "3 histories merged" in text.splitlines()[2] and text.count("0001_abc123_") == 1  # listed once, at the end
    assert text.endswith("- run 0003: 1 x H100, commit abc123, `"
                         + str(storage / MACHINE / "0003_abc123_20260103_120000.json") + "`\n")
    assert (out / "model.md").exists()
    flash = (out / "attention_flash.md").read_text()
    # One machine, named in the title; each row its runs: run 3's sdpa replaced run 1's
    assert "— 1 x H100\n" in flash and "| 0001, 0003 | bf16 | 64 | 1024 | forward | 1.024 | 3 | 0.256 |" in flash
    assert "| 0003 | bf16 | 128 | 1024 | forward | 4 |" in flash and "| OOM |" not in flash
    assert ["0003", "naive", "16", "16384", "OOM", ""] in [row[:6] for row in table_rows(out / "attention_handout.md")]
    assert report(tmp_path, "--run", "3,1")[0] == 0  # the order decides: run 1's sdpa point wins now
    assert "| 0001 | bf16 | 64 | 1024 | forward | 1.024 | 0.2048 | 0.256 |" in (out / "attention_flash.md").read_text()


def on(gpu: str, count: int) -> dict:
    """A history's machine_info for a host of `count` GPUs of a kind."""
    return {"machine": "x86_64", "systems_lab": {"gpu": gpu, "gpu_count": count, "torch": "2.11.0"}}


H200X2 = on("NVIDIA H200", 2)


def two_machines(tmp_path) -> pathlib.Path:
    """The leaderboard's point measured on 1 x H100 (run 1, beside one process's DDP step) and on 2 x H200 (run 2,
    beside torch's DDP on 2 ranks)."""
    storage = tmp_path / "storage"
    save_run(storage, 1, [fullstep("sdpa", 6.5), ddp(Variant.SINGLE, None, 1, 0.100, 0.0)])
    save_run(storage, 2, [fullstep("sdpa", 5.0), ddp(Variant.TORCH, 25.0, 2, 0.110, 0.0)], machine_info=H200X2,
             stamp="20260102_120000")
    return storage


def test_a_merged_report_keeps_each_machines_point_and_names_the_machine_and_run_of_each_row(tmp_path):
    """Runs of two machines that share a point: a row each, named by machine and run; a ratio to another point
    (vs single) only where the same machine measured both."""
    two_machines(tmp_path)
    code, out = report(tmp_path, "--run", "1-2")
    assert code == 0
    rows = columns_and_rows(out / "fullstep.md")
    assert [(row["machine"], row["run"], row["attention"], row["step"]) for row in rows] == [
        ("1 x H100", "0001", "sdpa", "6.5"), ("2 x H200", "0002", "sdpa", "5")]
    ddp_rows = columns_and_rows(out / "ddp.md")
    assert [(row["machine"], row["run"], row["variant"], row.get("vs single", "")) for row in ddp_rows] == [
        ("1 x H100", "0001", "single", ""), ("2 x H200", "0002", "torch", "")]


def test_the_header_of_a_merged_report_is_two_lines_naming_its_machines(tmp_path):
    two_machines(tmp_path)
    code, out = report(tmp_path, "--run", "1-2")
    assert code == 0
    lines = (out / "report.md").read_text().splitlines()
    header = [line for line in lines[1:lines.index(next(line for line in lines if line.startswith("###")))] if line]
    assert len(header) <= 2 and "2 machines (1 x H100, 2 x H200)" in header[0]
    assert "- run 0002: 2 x H200, commit abc123, `" in lines[-1]


def test_every_plot_names_its_machine_and_runs_in_its_title_or_in_each_series(tmp_path, monkeypatch):
    """One machine's figure says so in its title; a figure of two machines keeps a line per machine, each series
    naming its machine and run."""
    storage = tmp_path / "storage"
    save_run(storage, 1, model_benchmarks()[:24] + attention_benchmarks())
    save_run(storage, 2, model_benchmarks(scale=0.5)[:24], machine_info=on("NVIDIA H100 80GB HBM3", 4),
             stamp="20260102_120000")
    titles = {}
    monkeypatch.setattr(plots, "_figure", lambda plt, title, xlabel, panels, columns=None: titles.update(
        {title: sorted({label for _, series in panels for label in series})}))
    build_plots(merge_runs([load_run(path) for path in sorted((storage / MACHINE).glob("*.json"))]), tmp_path)
    assert titles["Model, step"] == [f"small {precision} eager ({machine}, run {run})"
                                     for precision in ("bf16", "bf16-weights", "fp32")
                                     for machine, run in (("1 x H100", "0001"), ("4 x H100", "0002"))]
    assert "Attention, flash sweep, forward, bf16 — 1 x H100, run 0001" in titles
    for title, labels in titles.items():
        assert re.search(r"\d x H100", title) or all(re.search(r"\d x H100, run \d{4}", label) for label in labels)


def ffn(layout: FFNLayout, data: int, tensor: int, comm: float) -> dict:
    """A bench_ffn point of a small layer on gloo ranks, its collectives taking `comm` seconds a step."""
    point = FFNPoint(layout, data, tensor, 64, 32, 128, BF16, "gloo")
    passes = Passes(comm / 2, comm / 2)
    return entry(point, FFNMeasured("gloo", 64 // data, 128 // tensor, Passes(0.002, 0.004), Passes(0.001, 0.002),
                                    passes, passes, {"all-reduce": 1e4}, {"all-reduce": 2e4}, 1.0), 0.006)


def test_the_section_8_plot_styles_each_line_apart_with_its_legend_off_its_panels(tmp_path, monkeypatch):
    """Measured and predicted communication per layout: a style each, the legend below the panels, the machine
    in the title, units on the axes."""
    monkeypatch.setitem(TESTS, "ffn", "bench_ffn.py::test_ffn")  # the benches of section 8's kinds
    monkeypatch.setitem(TESTS, "ffn_bandwidth", "bench_ffn.py::test_ffn_bandwidth")
    bandwidth = CollectiveBandwidth(1e-3, 1.0)
    benchmarks = [entry(FFNBandwidthPoint("gloo", ranks, 1.0, BF16),
                        FFNBandwidthMeasured(2**20, bandwidth, bandwidth, bandwidth), 1e-3) for ranks in (2, 4)]
    benchmarks += [ffn(layout, *grid, 1e-3 * sum(grid)) for layout in (FFNLayout.DP, FFNLayout.FSDP)
                   for grid in ((2, 1), (4, 1))] + [ffn(FFNLayout.TP, 1, 2, 1e-3)]
    save_run(tmp_path / "storage", 1, benchmarks)
    figures = []

    def keep(*args, **kwargs):  # what plots._figure draws (None for a figure without lines), before it is saved
        figures.append(_figure(*args, **kwargs))
        return figures[-1]

    monkeypatch.setattr(plots, "_figure", keep)
    assert [path.name for path in build_plots(load_run(next((tmp_path / "storage").rglob("*.json"))), tmp_path)] \
        == ["ffn_communication.png"]
    (fig,) = [fig for fig in figures if fig is not None]
    renderer = FigureCanvasAgg(fig).get_renderer()  # saved and closed: a canvas again, to measure it
    panels = [ax for ax in fig.axes if ax.get_visible()]
    styles = {line.get_label(): (line.get_color(), line.get_marker(), line.get_linestyle())
              for ax in panels for line in ax.get_lines()}
    assert len(styles) == 6 and len(set(styles.values())) == 6  # dp, fsdp, tp: measured and predicted
    (legend,) = fig.legends
    assert all(ax.get_legend() is None for ax in panels)
    assert not any(legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer)) for ax in panels)
    assert "1 x H100, run 0001" in fig.get_suptitle()
    assert all("(" in ax.get_xlabel() and "(" in ax.get_ylabel() for ax in panels)


def test_report_of_every_kind_names_its_points_levers_in_its_tables(tmp_path):
    """A warm-up study at another batch than the grid's says so in its title (the points record it)."""
    save_run(tmp_path / "storage", 1, [entry(WarmupPoint("small", "2025", 2, 128, FP32, "sdpa", n),
                                             WarmupMeasured(None, config("small", 128)), 0.1) for n in (0, 1)])
    code, out = report(tmp_path)
    assert code == 0 and "batch size 2" in (out / "warmup.md").read_text()


def test_a_plot_styles_every_series_apart_keeps_its_legend_off_the_data_and_its_labels_apart():
    """45 series (more than matplotlib's 10 colours, more than the markers) each get a style of their own; the
    legend lies beside the panels, not on them; named points drawn on top of each other get labels that do not
    overlap once rendered; every axis label has its unit."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    lines = {f"series {i:02d}": [(1.0, i + 1.0, None), (10.0, i + 2.0, None)] for i in range(45)}
    # Five schemes at nearly one point, and one far from them: their labels start on top of each other.
    schemes = {"a model": [(100.0 + 0.01 * i, 50.0 + 0.01 * i, f"every{2 * i + 2}") for i in range(5)]
               + [(1000.0, 500.0, "far")]}
    fig = _figure(plt, "Styles", "size (MiB)", [("time (ms)", lines), ("step (ms)", schemes)])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    styles = {line.get_label(): (line.get_color(), line.get_marker(), line.get_linestyle())
              for ax in fig.axes for line in ax.get_lines()}
    assert len(styles) == 46 and len(set(styles.values())) == 46
    (legend,) = fig.legends
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert not any(legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer)) for ax in panels)
    labels = [Text.get_window_extent(text, renderer) for ax in panels for text in ax.texts]  # without leaders
    assert len(labels) == 6
    assert not any(a.overlaps(b) for i, a in enumerate(labels) for b in labels[i + 1:])
    assert all("(" in ax.get_xlabel() and "(" in ax.get_ylabel() for ax in panels)
    plt.close(fig)
