"""The report: tables and plots from benchmark histories, a comparison of two runs, and bad histories."""

import dataclasses
import json
import pathlib
import subprocess
import sys

import matplotlib.image
import pytest

from systems.accounting import BucketedAllReduce, count_parameters, peak_memory
from systems.bench.breakdown import StepBreakdown
from systems.bench.schema import (POINT, AllReducePoint, AttentionPoint, DDPPoint, FSDPPoint, FullStepPoint,
                                  ModelPoint, Point, read_point)
from systems.model import get_config
from systems.precision import PRECISIONS
from systems.report import main
from systems.report.runs import load_run

ROOT = pathlib.Path(__file__).resolve().parents[1]
MACHINE = "Linux-CPython-3.12-64bit"
FP32, BF16 = PRECISIONS["fp32"], PRECISIONS["bf16"]
# The tests whose benchmarks hold a point, and its class.
POINTS = {"test_model": ModelPoint, "test_warmup_study": ModelPoint, "test_handout_sweep": AttentionPoint,
          "test_flash_sweep": AttentionPoint, "test_allreduce": AllReducePoint, "test_ddp_step": DDPPoint}


def bench(fullname: str, mean: float, params: dict | None = None, **extra) -> dict:
    """One benchmark entry as pytest-benchmark saves it."""
    name = fullname.split("::")[1]
    return {"group": None, "name": name, "fullname": fullname, "params": params, "param": name.partition("[")[2][:-1],
            "extra_info": extra, "options": {},
            "stats": {"min": 0.9 * mean, "max": 1.1 * mean, "mean": mean, "stddev": 0.05 * mean, "rounds": 5,
                      "median": mean, "iqr": 0.0, "q1": mean, "q3": mean, "iqr_outliers": 0, "stddev_outliers": 0,
                      "outliers": "0;0", "ld15iqr": mean, "hd15iqr": mean, "ops": 1 / mean, "total": 5 * mean,
                      "iterations": 1}}


def save_run(storage: pathlib.Path, number: int, benchmarks: list[dict], oom: tuple[tuple, ...] = (),
             machine: str = MACHINE, stamp: str = "20260101_120000", form: str = "old") -> pathlib.Path:
    """A history as saved before benchmarks held their points (`form` "old": a point's fields among the figures,
    an out-of-memory point as its test id only), or since ("new")."""
    path = storage / machine / f"{number:04d}_abc123_{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    out_of_memory = [{"name": f"{test.split('::')[1]}[{point}]", "fullname": f"{test}[{point}]",
                      "error": "CUDA out of memory"} | ({POINT: point.to_dict()} if form == "new" else {})
                     for test, point in oom]
    history = {"machine_info": {"machine": "x86_64", "systems_lab": {"gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 1,
                                                                       "torch": "2.11.0"}},
               "commit_info": {"id": "abc123"}, "benchmarks": [new_form(b) for b in benchmarks] if form == "new"
               else benchmarks, "datetime": "2026-01-01T12:00:00", "version": "5.2.3", "out_of_memory": out_of_memory}
    path.write_text(json.dumps(history))
    return path


def new_form(bench: dict) -> dict:
    """An old-form benchmark as the benches save it now: its point whole in extra_info["point"], not among the
    figures."""
    test = bench["name"].split("[")[0]
    extra_info = bench["extra_info"]
    if test.startswith("test_leaderboard"):
        point = AttentionPoint("leaderboard", "triton", 16, 16384, 64, BF16, True, bench["params"]["pass_"])
    elif test in POINTS:
        study = {"compile": "eager", "phase": "forward_backward"} if test == "test_warmup_study" else {}
        point = POINTS[test].from_dict({**extra_info, **study})
    else:
        return bench
    figures = {k: v for k, v in extra_info.items() if k not in point.to_dict()}
    return {**bench, "extra_info": {POINT: point.to_dict(), **figures}}


def model_benchmarks(scale: float = 1.0) -> list[dict]:
    out = []
    for context in (128, 256):
        for precision in ("fp32", "bf16", "bf16-weights"):
            for phase, seconds in (("forward", 0.01), ("backward", 0.02), ("forward_backward", 0.03), ("step", 0.04)):
                seconds *= scale * context / 128 * (2 if precision == "fp32" else 1)
                out.append(bench(f"benches/bench_model.py::test_model[small-ctx{context}-{precision}-eager-{phase}]",
                                 seconds, preset="small", context=context, precision=precision, compile="eager",
                                 phase=phase, batch_size=4, attention="sdpa", tflops=100.0 * context / 128,
                                 peak_memory_mb=1000.0 + context))
    out += [bench(f"benches/bench_model.py::test_warmup_study[warmup{n}]", 0.5 / (n + 1), preset="small",
                  context=128, precision="fp32", warmup_steps=n) for n in (0, 1, 2, 5)]
    return out


def attention_benchmarks() -> list[dict]:
    out = []
    for seq in (256, 1024):
        for pass_ in ("forward", "backward"):
            out.append(bench(f"benches/bench_attention.py::test_handout_sweep[naive-seq{seq}-d16-fp32-{pass_}]",
                             seq * 1e-6, sweep="handout", impl="naive", batch=8, seq=seq, d=16, precision="fp32",
                             is_causal=False, **{"pass": pass_}, ms=seq * 1e-3, tflops=1.0,
                             memory_before_backward_mb=float(seq)))
        for impl, speed in (("triton", 4), ("sdpa", 5), ("naive", 1)):
            kernels = dict(device_ms=seq / 5e3, sdpa_device_ms=seq / 4e3, vs_sdpa=0.8) if impl == "triton" else {}
            out.append(bench(f"benches/bench_attention.py::test_flash_sweep[{impl}-seq{seq}-d64-bf16-forward]",
                             seq * 1e-6 / speed, sweep="flash", impl=impl, batch=1, seq=seq, d=64, precision="bf16",
                             is_causal=True, **{"pass": "forward"}, tflops=10.0 * speed, **kernels))
    out.append(bench("benches/bench_attention.py::test_leaderboard[forward]", 0.002, params={"pass_": "forward"},
                     do_bench_ms=1.9, sdpa_do_bench_ms=1.5, vs_sdpa=1.9 / 1.5))
    out.append(bench("benches/bench_attention.py::test_leaderboard_after_a_second_shape[forward]", 0.003,
                     params={"pass_": "forward"}, first_seq=1024, do_bench_ms=2.9, sdpa_do_bench_ms=1.45,
                     vs_sdpa=2.9 / 1.45))
    return out


OOM = (("benches/bench_attention.py::test_handout_sweep",
        AttentionPoint("handout", "naive", 8, 16384, 16, FP32, False, "forward")),
       ("benches/bench_attention.py::test_flash_sweep", AttentionPoint("flash", "naive", 1, 1024, 128, BF16, True,
                                                                      "forward")),
       ("benches/bench_ddp.py::test_ddp_step", DDPPoint("bucketed", 100.0, FP32, 128, 2)))


def distributed_benchmarks() -> list[dict]:
    out = [bench(f"benches/bench_allreduce.py::test_allreduce[nccl-2ranks-{mb}MiB]", 1.0, backend="nccl",
                 world_size=2, size_mb=float(mb), bytes=mb * 2**20, latency_s=1e-5 + mb * 2**20 / 100e9,
                 latency_busbw_gbps=100.0 * mb / (mb + 1), loop_time_s=mb * 2**20 / 200e9, algbw_gbps=200.0,
                 busbw_gbps=200.0, bare_busbw_gbps=210.0, loop_vs_bare=200 / 210) for mb in (1, 10, 100)]
    steps = [("single", None, 1, 0.100, 0.0), ("torch", 25.0, 2, 0.110, 0.0), ("naive", None, 2, 0.150, 0.040),
             ("bucketed", 1.0, 2, 0.120, 0.012), ("bucketed", 10.0, 2, 0.115, 0.008)]
    for variant, bucket, ranks, step, wait in steps:
        name = f"{variant}{f'-{bucket:g}MiB' if variant == 'bucketed' else ''}-fp32-ctx128-{ranks}ranks"
        out.append(bench(f"benches/bench_ddp.py::test_ddp_step[{name}]", 5.0, preset="small", variant=variant,
                         bucket_size_mb=bucket, precision="fp32", context=128, batch_size_per_rank=4,
                         world_size=ranks, backend="nccl", forward_s=0.03, backward_s=0.06, comm_wait_s=wait,
                         optimizer_s=0.01, step_s=step, comm_share=wait / step))
    for optimizer, share in (("adamw", 1.0), ("sharded", 0.5)):
        out.append(bench(f"benches/bench_ddp.py::test_optimizer_memory[2ranks-{optimizer}]", 5.0,
                         params={"world_size": 2, "optimizer": optimizer}, preset="small", optimizer=optimizer,
                         world_size=2, precision="fp32", state_mb=[981.0 * share] * 2, unsharded_state_mb=981.0,
                         state_fraction=share, ideal_fraction=0.5, optimizer_s=0.01, step_s=0.2,
                         memory_before_step_mb=3000.0 - 500 * (1 - share)))
    return out


def report(tmp_path, *args) -> tuple[int, pathlib.Path]:
    out = tmp_path / "report"
    return main(["--storage", str(tmp_path / "storage"), "--out", str(out), *args]), out


def table_rows(path: pathlib.Path) -> list[list[str]]:
    lines = [line for line in path.read_text().splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


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
    assert ["naive", "16", "1024", "1.024 ± 0.051", "1.024 ± 0.051", "1024"] in handout
    assert ["naive", "16", "16384", "OOM", ""] in [row[:5] for row in handout]
    flash = (out / "attention_flash.md").read_text()
    assert "| precision | d | seq | pass | naive | sdpa | triton |" in flash
    assert "| bf16 | 64 | 1024 | forward | 1.024 | 0.2048 | 0.256 |" in flash
    assert "| bf16 | 128 | 1024 | forward | OOM |" in flash
    assert table_rows(out / "attention_forward_kernels.md") == [["bf16", "64", "256", "0.0512", "0.064", "0.8"],
                                                               ["bf16", "64", "1024", "0.2048", "0.256", "0.8"]]
    assert table_rows(out / "attention_leaderboard.md") == [["forward", "16384", "2", "1.9", "1.5", "1.267"],
                                                          ["forward", "1024", "3", "2.9", "1.45", "2"]]

    assert ["nccl", "2", "100", f"{(1e-5 + 100 * 2**20 / 100e9) * 1e3:.4g}", f"{100 * 100 / 101:.4g}",
            f"{100 * 2**20 / 200e9 * 1e3:.4g}", "200", "200", "210", "0.9524"] in table_rows(out / "allreduce.md")
    ddp = table_rows(out / "ddp.md")
    assert [row[3] for row in ddp] == ["single", "torch", "naive", "bucketed", "bucketed", "bucketed"]
    assert ddp[-1][:6] == ["fp32", "128", "2", "bucketed", "100", "OOM"]
    assert ddp[2][:10] == ["fp32", "128", "2", "naive", "", "150", "30", "60", "40", "10"]
    assert [row[:7] for row in table_rows(out / "ddp_buckets.md")] == [
        ["fp32", "128", "2", "1", "120", "60", "12"], ["fp32", "128", "2", "10", "115", "60", "8"]]
    optimizers = table_rows(out / "sharded_optimizer.md")
    assert ["2", "sharded", "490.5", "981", "0.5", "0.5", "2750", "10", "200"] in optimizers

    for name in ("model_forward", "model_step", "attention_handout_forward_fp32", "attention_flash_forward_bf16",
                 "allreduce_bandwidth", "ddp_buckets"):
        image = matplotlib.image.imread(out / f"{name}.png")
        assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0
        assert f"({name}.png)" in (out / "report.md").read_text()


def test_new_histories_give_the_tables_of_old_ones(tmp_path):
    """The same run saved as the benches save it now and as they did before points were saved whole."""
    everything = model_benchmarks() + attention_benchmarks() + distributed_benchmarks()
    tables = {}
    for form in ("old", "new"):
        save_run(tmp_path / form, 1, everything, oom=OOM, form=form)
        assert main(["--storage", str(tmp_path / form), "--out", str(tmp_path / f"{form}-report")]) == 0
        tables[form] = {path.name: path.read_text() for path in (tmp_path / f"{form}-report").glob("*.md")
                        if path.name != "report.md"}
    assert len(tables["new"]) == 12 and tables["new"] == tables["old"]
    assert "OOM" in tables["new"]["ddp.md"] and "OOM" in tables["new"]["attention_flash.md"]


def test_a_point_kind_is_registered_once():
    """A new point class names its kind, which read_point dispatches on: a kind taken twice would make one of
    the two classes unreadable, so declaring it is an error."""
    assert read_point(FSDPPoint("fsdp", "tiny", BF16, 128, 4, 2, 3).to_dict()).prefetch == 3
    with pytest.raises(ValueError, match="'fsdp' is taken by FSDPPoint"):
        class Copy(Point, kind="fsdp"):
            variant: str


@pytest.mark.parametrize("test, point", OOM + (
    ("benches/bench_model.py::test_model", ModelPoint("2.7b", 1024, PRECISIONS["bf16-weights"], "regional", "step")),
    ("benches/bench_allreduce.py::test_allreduce", AllReducePoint("nccl", 8, 1.0)),
    ("benches/bench_allreduce.py::test_allreduce", AllReducePoint("gloo", 2, 0.5)),
    ("benches/bench_ddp.py::test_ddp_step", DDPPoint("individual", None, BF16, 512, 4)),
), ids=lambda x: str(x).split("::")[-1])
def test_a_point_reads_back_whole_from_its_record_and_from_its_old_test_id(tmp_path, test, point):
    record = json.loads(json.dumps(point.to_dict()))
    back = read_point(record)
    assert back == point
    assert all(type(getattr(back, f.name)) is type(getattr(point, f.name)) for f in dataclasses.fields(point))
    module, name = pathlib.Path(test.split("::")[0]).stem, test.split("::")[1]
    for form in ("old", "new"):
        run = load_run(save_run(tmp_path / form, 1, [], oom=((test, point),), form=form))
        assert [oom.point for oom in run.out_of_memory] == [point]
        assert [{k: type(v) for k, v in fields.items()} for fields in run.oom(module, name)] == [
            {k: type(v) for k, v in record.items()}]


def test_out_of_memory_points_are_read_from_their_record_not_their_id(tmp_path):
    """An out-of-memory entry names its point whole: its test id need not spell it."""
    point = ModelPoint("small", 256, BF16, "eager", "step")
    entry = {"name": "test_model[renamed]", "fullname": "benches/bench_model.py::test_model[renamed]",
             "error": "CUDA out of memory", POINT: point.to_dict()}
    result = new_form(model_benchmarks()[0])
    path = save_run(tmp_path / "storage", 1, [result])
    history = json.loads(path.read_text())
    path.write_text(json.dumps({**history, "out_of_memory": [entry]}))
    code, out = report(tmp_path)
    assert code == 0
    assert table_rows(out / "model.md")[-1] == ["small", "256", "bf16", "eager", "", "OOM"]


@pytest.mark.parametrize("broken", [{"context": "many"}, {"precision": "fp8"}, {"kind": "fsdp"}, {"phase": None}],
                         ids=["context-not-a-number", "unknown-precision", "unknown-kind", "phase-missing"])
def test_a_broken_point_is_a_bad_history(tmp_path, capsys, broken):
    result = new_form(model_benchmarks()[0])
    record = {k: v for k, v in {**result["extra_info"][POINT], **broken}.items() if v is not None}
    save_run(tmp_path / "storage", 1, [{**result, "extra_info": {**result["extra_info"], POINT: record}}])
    code, _ = report(tmp_path)
    assert code == 2 and "is not a pytest-benchmark history" in capsys.readouterr().err


def test_bucket_sweep_shows_the_bucket_model(tmp_path):
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


def fsdp(variant: str, step: float, prefetch: int = 1, gather: str = "layer", **figures) -> dict:
    """A bench_fsdp benchmark of the xl model at context 512, as the bench saves it."""
    point = FSDPPoint(variant, "xl", BF16, 512, 16, 1 if variant == "single" else 2, prefetch, gather)
    return bench(f"benches/bench_fsdp.py::test_fsdp_step[{point}]", step,
                 **{POINT: point.to_dict(), "step_s": step, "forward_s": step / 3, **figures})


def fullstep(attention: str, step: float, checkpoint_blocks: int | None = 1, gather: str = "block",
             **figures) -> dict:
    """A bench_fullstep benchmark of the leaderboard's point on 2 ranks, as the bench saves it."""
    point = FullStepPoint("fsdp", "leaderboard-2026", BF16, 32768, 1, 2, attention, checkpoint_blocks, 4096, gather)
    return bench(f"benches/bench_fullstep.py::test_fullstep[{point}]", step,
                 **{POINT: point.to_dict(), "step_s": step, "forward_s": step / 3, **figures})


def step_breakdown(span: float, busy: float) -> dict:
    """One rank's breakdown as the benches record it, the busy time split in fixed shares."""
    shares = dict(matmul_s=0.4, attention_forward_s=0.15, attention_backward_s=0.25, communication_s=0.1,
                  communication_exposed_s=0.02, other_s=0.1, optimizer_s=0.01, loss_s=0.02, recompute_s=0.2)
    return StepBreakdown(span_s=span, busy_s=busy, **{k: share * busy for k, share in shares.items()}).to_dict()


def saved_before_levers(benchmark: dict) -> dict:
    """A benchmark of ours as saved before its point had a prefetch depth and a gather (ours always prefetched
    one layer)."""
    record = {k: v for k, v in benchmark["extra_info"][POINT].items() if k not in ("prefetch", "gather")}
    return {**benchmark, "extra_info": {**benchmark["extra_info"], POINT: record}}


def test_fsdp_table_puts_each_variant_beside_one_process_with_its_peak_against_the_prediction(tmp_path):
    """Saved out of order, the FSDP points come back in the comparison's order (one process, DDP, ours by prefetch
    depth and group, torch's), with the step and all-gather wait in ms, the largest of the recorded peaks, and
    that peak over the prediction. A point saved before the depth was recorded is ours at depth 1, gathering
    layers."""
    benchmarks = [fsdp("fsdp2", 0.5, vs_single=1.25, memory_before_step_mb=900.0, memory_after_step_mb=950.0),
                  fsdp("fsdp", 0.41, gather="block"), fsdp("fsdp", 0.44, prefetch=5, gather_wait_s=0.002),
                  saved_before_levers(fsdp("fsdp", 0.48, vs_single=1.2, gather_wait_s=0.0123,
                                             memory_before_step_mb=1200.0, memory_after_step_mb=1100.0,
                                             predicted_peak_mb=1000.0, peak_gathered_mb=64.0)),
                  fsdp("single", 0.4), fsdp("bucketed", 0.45, vs_single=1.125)]
    oom = (("benches/bench_fsdp.py::test_fsdp_step", FSDPPoint("fsdp", "xl", BF16, 1024, 16, 2, 2)),)
    save_run(tmp_path / "storage", 1, benchmarks, oom, form="new")
    code, out = report(tmp_path)
    assert code == 0
    rows = table_rows(out / "fsdp.md")
    assert [row[4:7] for row in rows] == [["single", "", ""], ["bucketed", "", ""], ["fsdp", "1", "block"],
                                          ["fsdp", "1", "layer"], ["fsdp", "5", "layer"], ["fsdp2", "", ""],
                                          ["fsdp", "2", "layer"]]
    columns = [cell.strip() for cell in (out / "fsdp.md").read_text().split("\n")[4].strip("|").split("|")]
    assert dict(zip(columns, rows[2]))["step"] == "410"
    ours = dict(zip(columns, rows[3]))
    assert (ours["step"], ours["forward"], ours["all-gather wait"]) == ("480", "160", "12.3")
    assert (ours["peak"], ours["predicted peak"], ours["peak / predicted"]) == ("1200", "1000", "1.20")
    assert (ours["vs single"], ours["gathered weights"]) == ("1.2", "64")
    assert dict(zip(columns, rows[4]))["all-gather wait"] == "2"
    assert dict(zip(columns, rows[5]))["peak"] == "950"
    assert rows[6][2:8] == ["1024", "2", "fsdp", "2", "layer", "OOM"]


def columns_and_rows(path: pathlib.Path) -> list[dict[str, str]]:
    """A table's rows, each as {column: cell}."""
    header = next(line for line in path.read_text().splitlines() if line.startswith("|"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    return [dict(zip(columns, row)) for row in table_rows(path)]


def test_fullstep_table_is_compact_and_replaces_the_dump_of_every_figure(tmp_path):
    """The leaderboard's figures per point (do_bench step, MFU, tokens/s, each rank's peak against the
    prediction, cold start), points in order, an out-of-memory point as a row, and no generic table."""
    figures = dict(do_bench_s=6.5, mfu=0.3939, tokens_per_s=10123.5, peak_memory_mb_per_rank=[70535.6, 70000.0],
                   predicted_peak_mb=70200.5, cold_start_s=115.45)
    oom = (("benches/bench_fullstep.py::test_fullstep",
            FullStepPoint("fsdp", "leaderboard-2026", BF16, 65536, 1, 2, "sdpa", 1, 4096)),)
    save_run(tmp_path / "storage", 1, [fullstep("sdpa", 6.53, **figures),
                                       saved_before_levers(fullstep("flash", 7.03, None))], oom, form="new")
    code, out = report(tmp_path)
    assert code == 0
    rows = columns_and_rows(out / "fullstep.md")
    assert [(row["context"], row["attention"], row["checkpoint every"], row["gather"]) for row in rows] == [
        ("32768", "flash", "none", "layer"), ("32768", "sdpa", "1", "block"), ("65536", "sdpa", "1", "layer")]
    assert {k: rows[1][k] for k in ("step", "do_bench step", "MFU", "tokens/s", "peak per rank", "predicted peak",
                                    "peak / predicted", "cold start (s)")} == {
        "step": "6.53", "do_bench step": "6.5", "MFU": "39.4%", "tokens/s": "10,124", "peak per rank": "68.88, 68.36",
        "predicted peak": "68.56", "peak / predicted": "1.00", "cold start (s)": "115.5"}
    assert rows[2]["step"] == "OOM"
    assert not (out / "bench_fullstep_test_fullstep.md").exists()


def test_breakdown_table_has_a_row_per_point_and_rank_with_idle_the_span_less_busy(tmp_path):
    """Bench by bench, points in their tables' order, ranks in order; a point without breakdowns has no rows."""
    spans = {"flash": [(0.5, 0.45), (0.5, 0.4)], "sdpa": [(0.4, 0.4), (0.42, 0.3)], "fsdp": [(0.2, 0.15), (0.2, 0.1)]}
    benchmarks = [fullstep(attention, 1.0, breakdown_per_rank=[step_breakdown(*s) for s in spans[attention]])
                  for attention in ("sdpa", "flash")]
    benchmarks += [fsdp("fsdp", 0.2, breakdown_per_rank=[step_breakdown(*s) for s in spans["fsdp"]]),
                   fsdp("single", 0.1)]
    save_run(tmp_path / "storage", 1, benchmarks, form="new")
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


@pytest.mark.parametrize("benchmarks", [[fsdp("fsdp", 0.2)], [fullstep("sdpa", 6.5)], []],
                         ids=["fsdp", "fullstep", "neither"])
def test_points_without_breakdowns_have_no_breakdown_table(tmp_path, benchmarks):
    save_run(tmp_path / "storage", 1, benchmarks + distributed_benchmarks()[:1], form="new")
    code, out = report(tmp_path)
    assert code == 0
    assert not (out / "breakdown.md").exists() and "GPU time goes" not in (out / "report.md").read_text()


@pytest.mark.parametrize("broken", [{"recompute_s": None}, {"gpu_s": 0.4}], ids=["field-missing", "unknown-field"])
def test_a_breakdown_that_is_not_a_step_breakdown_is_a_bad_history(tmp_path, capsys, broken):
    record = {k: v for k, v in {**step_breakdown(0.5, 0.4), **broken}.items() if v is not None}
    save_run(tmp_path / "storage", 1, [fullstep("sdpa", 6.5, breakdown_per_rank=[record])], form="new")
    code, _ = report(tmp_path)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("report: error: test_fullstep[") and "breakdown_per_rank" in err


def test_runs_saved_before_the_back_to_back_figures_show_their_figures_as_per_call(tmp_path):
    """Their time_s and busbw_gbps were timed one call at a time: not nccl-tests' figures."""
    save_run(tmp_path / "storage", 1, [bench("benches/bench_allreduce.py::test_allreduce[nccl-2ranks-1MiB]", 1.0,
                                             backend="nccl", world_size=2, size_mb=1.0, bytes=2**20, time_s=4e-5,
                                             time_spread_s=1e-6, algbw_gbps=26.0, busbw_gbps=26.0,
                                             bare_busbw_gbps=34.0, busbw_vs_bare=26 / 34)])
    code, out = report(tmp_path)
    assert code == 0
    assert ("| backend | ranks | MiB | per call, sync each (ms) | spread across ranks (ms) | per call busbw (GB/s) "
            "| bare loop busbw (GB/s) |") in (out / "allreduce.md").read_text()
    assert table_rows(out / "allreduce.md") == [["nccl", "2", "1", "0.04", "0.001", "26", "34"]]


def test_absent_benchmarks_are_absent_from_the_report(tmp_path):
    save_run(tmp_path / "storage", 1, distributed_benchmarks()[:3])
    code, out = report(tmp_path)
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["allreduce.md", "allreduce_bandwidth.png", "report.md"]


def test_unknown_benchmarks_get_a_table_of_their_own(tmp_path):
    save_run(tmp_path / "storage", 1, [bench("benches/bench_new.py::test_thing[a-1]", 0.003, params={"x": 1},
                                             kind="a", score=0.5)])
    code, out = report(tmp_path)
    assert code == 0
    assert table_rows(out / "bench_new_test_thing.md") == [["a", "0.5", "1", "3 ± 0.15"]]


def test_compare_flags_regressions(tmp_path):
    storage = tmp_path / "storage"
    save_run(storage, 1, model_benchmarks(), stamp="20260101_120000")
    slower = model_benchmarks()
    slower[0]["stats"]["mean"] *= 2  # small ctx128 fp32 forward
    slower[1]["stats"]["mean"] *= 0.5
    save_run(storage, 2, slower[:-1], stamp="20260102_120000")  # without warmup5
    code, out = report(tmp_path, "--compare", "1")
    assert code == 0
    rows = table_rows(out / "comparison.md")
    assert rows[0] == ["bench_model::test_model[small-ctx128-fp32-eager-forward]", "20", "40", "2.000", "1.000",
                       "REGRESSION"]
    assert rows[-1][3:] == ["0.500", "1.000", "faster"]
    assert all(row[-1] == "" for row in rows[1:-1])
    text = (out / "comparison.md").read_text()
    assert "1 of 27 benchmarks slower by more than 10%" in text and "Only in run 0001: 1 of bench_model" in text


def test_latest_run_and_machine_by_default(tmp_path):
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


def test_runs_saved_in_chunks_merge_and_later_runs_win(tmp_path):
    storage = tmp_path / "storage"
    save_run(storage, 1, attention_benchmarks(), oom=OOM[1:2], stamp="20260101_120000")  # naive d128 ran out
    save_run(storage, 2, model_benchmarks(), stamp="20260102_120000")
    rerun = [bench("benches/bench_attention.py::test_flash_sweep[naive-seq1024-d128-bf16-forward]", 0.004,
                   sweep="flash", impl="naive", batch=1, seq=1024, d=128, precision="bf16", is_causal=True,
                   **{"pass": "forward"}),
             bench("benches/bench_attention.py::test_flash_sweep[sdpa-seq1024-d64-bf16-forward]", 0.003,
                   sweep="flash", impl="sdpa", batch=1, seq=1024, d=64, precision="bf16", is_causal=True,
                   **{"pass": "forward"})]
    save_run(storage, 3, rerun, oom=OOM[:1], stamp="20260103_120000")  # and a handout point runs out
    code, out = report(tmp_path, "--run", "1-3")
    assert code == 0
    text = (out / "report.md").read_text()
    assert text.startswith("# Benchmark report: run 0001+0002+0003") and text.count("_abc123_") == 3
    assert (out / "model.md").exists()
    flash = (out / "attention_flash.md").read_text()
    assert "| bf16 | 64 | 1024 | forward | 1.024 | 3 | 0.256 |" in flash  # run 3's sdpa replaced run 1's
    assert "| bf16 | 128 | 1024 | forward | 4 |" in flash and "| OOM |" not in flash
    assert ["naive", "16", "16384", "OOM", ""] in [row[:5] for row in table_rows(out / "attention_handout.md")]
    assert report(tmp_path, "--run", "3,1")[0] == 0  # the order decides: run 1's sdpa point wins now
    assert "| bf16 | 64 | 1024 | forward | 1.024 | 0.2048 | 0.256 |" in (out / "attention_flash.md").read_text()


@pytest.mark.parametrize("history, args, message", [
    (None, (), "no benchmark history at"),
    ("{not json", (), "is not a pytest-benchmark history"),
    ('{"machine_info": {}}', (), "is not a pytest-benchmark history (KeyError"),
    ('{"benchmarks": [{"name": "test_x", "fullname": "b.py::test_x"}]}', (), "(KeyError: 'stats')"),
    ('{"benchmarks": [], "out_of_memory": 3}', (), "is not a pytest-benchmark history (TypeError"),
    ('{"benchmarks": []}', ("--run", "7"), "run '7' matches 0 files"),
    ('{"benchmarks": []}', ("--machine", "elsewhere"), "no saved runs for machine 'elsewhere'"),
    ('{"benchmarks": []}', ("--run", "1-2"), "run '2' matches 0 files"),
    ('{"benchmarks": []}', ("--run", "5-3"), "run range '5-3' counts down; write 3-5"),
    ('{"benchmarks": []}', ("--run", "1,,2"), "empty run id in '1,,2'"),
], ids=["no-storage", "not-json", "no-benchmarks", "no-stats", "bad-oom", "unknown-run", "unknown-machine",
        "run-range-past-the-end", "run-range-counting-down", "empty-run-id"])
def test_bad_history_is_a_one_line_error(tmp_path, capsys, history, args, message):
    if history is not None:
        path = tmp_path / "storage" / MACHINE / "0001_abc_20260101_120000.json"
        path.parent.mkdir(parents=True)
        path.write_text(history)
    code, out = report(tmp_path, *args)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("report: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("out, message", [("report", "is a file; name a folder"),
                                          ("report/tables", "cannot write into")], ids=["a-file", "under-a-file"])
def test_an_out_folder_that_cannot_be_written_is_a_one_line_error(tmp_path, capsys, out, message):
    save_run(tmp_path / "storage", 1, distributed_benchmarks()[:3])
    (tmp_path / "report").write_text("not a folder")
    code = main(["--storage", str(tmp_path / "storage"), "--out", str(tmp_path / out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("report: error: ") and message in err and err.count("\n") == 1
    assert (tmp_path / "report").read_text() == "not a folder"


@pytest.mark.parametrize("args", [("--run", "{bad}"), ("--run", "5-3"), ("--out", "{bad}")],
                         ids=["bad-history", "run-range-counting-down", "out-is-a-file"])
def test_command_line_error_has_no_traceback(tmp_path, args):
    save_run(tmp_path / "storage", 5, distributed_benchmarks()[:3])
    bad = tmp_path / "0001_abc_20260101_120000.json"
    bad.write_text('{"benchmarks": [{"fullname": 1}]}')
    command = ["--storage", str(tmp_path / "storage"), "--out", str(tmp_path / "o")]
    command += [arg.format(bad=bad) for arg in args]
    proc = subprocess.run([sys.executable, "-m", "systems.report", *command], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("report: error: ") and proc.stderr.count("\n") == 1


BENCH = """
import pytest
import torch

from systems.bench.schema import POINT, ModelPoint
from systems.precision import PRECISIONS

POINTS = [ModelPoint("tiny", context, PRECISIONS["fp32"], "eager", phase)
          for context in (64, 128, 256) for phase in ("forward", "step")]

@pytest.mark.parametrize("point", POINTS, ids=str)
def test_model(benchmark, skip_on_oom, point):
    benchmark.extra_info[POINT] = point.to_dict()
    with skip_on_oom:
        if point.context == 256 and point.phase == "step":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        benchmark.pedantic(sum, args=(range(point.context),), rounds=3)
    benchmark.extra_info.update(batch_size=4, tflops=float(point.context))
"""


def test_report_of_a_real_benchmark_run(inner_pytest, tmp_path):
    """pytest-benchmark and the root conftest write the history; the report reads it, OOM point included."""
    inner_pytest.makeconftest((ROOT / "conftest.py").read_text())
    inner_pytest.mkdir("benches")
    (inner_pytest.path / "benches" / "bench_model.py").write_text(BENCH)
    ran = inner_pytest.runpytest_subprocess("benches/bench_model.py", "-p", "no:cacheprovider", "-o",
                                            "python_files=bench_*.py", "--benchmark-autosave")
    ran.assert_outcomes(passed=5, skipped=1)
    [history] = (inner_pytest.path / ".benchmarks").glob("*/*.json")
    [oom] = json.loads(history.read_text())["out_of_memory"]
    assert oom[POINT] == {"kind": "model", "preset": "tiny", "context": 256, "precision": "fp32", "compile": "eager",
                          "phase": "step"}
    assert main(["--storage", str(inner_pytest.path / ".benchmarks"), "--out", str(tmp_path)]) == 0
    rows = table_rows(tmp_path / "model.md")
    assert [row[:4] for row in rows] == [["tiny", str(c), "fp32", "eager"] for c in (64, 128, 256)]
    assert rows[-1][-1] == "OOM" and all(cell.count("±") == 1 for row in rows for cell in row[4:] if cell != "OOM")
    assert (tmp_path / "model_forward.png").exists()
