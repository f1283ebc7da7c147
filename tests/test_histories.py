"""Saved histories: points and their measurements read back whole and typed; a history of another schema, or a
broken one, is a one-line error that names it; histories saved before the schema migrate into it once."""

import dataclasses
import importlib.util
import json
import pathlib
import runpy
import sys

import pytest

from histories import allreduce_measured, config, entry, phases, rate, save_run, step_breakdown
from systems.bench import migrate
from systems.bench.schema import (KINDS, MEASURED, POINT, SCHEMA, AllReducePoint, CheckpointPoint, DDPMeasured,
                                  DDPPoint, FSDPMeasured, FSDPPoint, FullStepPoint, LayoutPoint, LeaderboardPoint,
                                  ModelMeasured, ModelPoint, OptimizerPoint, Point, SchemaError, read_measured,
                                  read_point, to_record)
from systems.levers.checkpointing import Checkpointing
from systems.levers.layout import Layout
from systems.levers.sharding import Gather
from systems.levers.variant import Variant
from systems.model import Attention, Fused
from systems.parallel.spec import TrainSpec
from systems.precision import PRECISIONS
from systems.report import main
from systems.report.runs import load_run

ROOT = pathlib.Path(__file__).resolve().parents[1]
FP32, BF16 = PRECISIONS["fp32"], PRECISIONS["bf16"]
MODEL = ModelPoint("small", "2025", 4, 128, FP32, Attention.SDPA, "eager", "forward")
XL = dict(preset="xl", precision=BF16, batch_size=16, context=512)  # bench_fsdp's full-size shape


def model_entry(point: ModelPoint = MODEL, seconds: float = 0.01) -> dict:
    return entry(point, ModelMeasured(1, 4e3, rate(1.0), None, config(point.preset, point.context)), seconds)


def test_a_point_kind_is_registered_once():
    """A new point class names its kind, which read_point dispatches on: a kind taken twice would make one of
    the two classes unreadable, so declaring it is an error."""
    with pytest.raises(ValueError, match="'fsdp' is taken by FSDPPoint"):
        class Copy(Point, kind="fsdp", measured=FSDPMeasured):
            variant: str


@pytest.mark.parametrize("point", [
    MODEL, ModelPoint("2.7b", "2026", 2, 1024, PRECISIONS["bf16-weights"], Attention.FLASH, "regional", "step"),
    AllReducePoint("nccl", 8, 1.0), AllReducePoint("gloo", 2, 0.5),
    DDPPoint(TrainSpec(**XL, variant=Variant.INDIVIDUAL, bucket_size_mb=None), 4),
    FSDPPoint(TrainSpec(**XL, variant=Variant.FSDP, fsdp_gather=Gather.BLOCK, fsdp_prefetch=3), 2),
    FSDPPoint(TrainSpec(**XL, variant=Variant.FSDP2), 2),
], ids=str)
def test_a_point_reads_back_whole_and_typed_from_its_record(point):
    back = read_point(json.loads(json.dumps(point.to_record())))
    assert back == point
    assert all(type(getattr(back, f.name)) is type(getattr(point, f.name)) for f in dataclasses.fields(point))


@pytest.mark.parametrize("broken, error", [
    ({"context": "many"}, "model point.context: 'many' is not a int"),
    ({"context": True}, "model point.context: True is not a int"),
    ({"precision": "fp8"}, "unknown precision 'fp8'"),
    ({"phase": None}, "model point.phase: null"),
    ({"kind": "fsdp"}, "fsdp point: unknown fields attention, batch, compile, context, edition, phase, precision, "
                       "preset"),
], ids=["context-not-a-number", "bool-for-int", "unknown-precision", "phase-null", "wrong-kind"])
def test_a_broken_point_is_an_error_naming_its_field(broken, error):
    with pytest.raises(SchemaError, match=error):
        read_point({**MODEL.to_record(), **broken})


def test_a_measured_record_is_read_with_its_kinds_types():
    measured = DDPMeasured("nccl", phases(0.1, gather_wait=None), 1e4, rate(50.0, 0.05), {"after_step": 1.0},
                           config("small", 128), 0.0, 0.1)
    record = json.loads(json.dumps(to_record(measured)))
    point = DDPPoint(TrainSpec(preset="small", variant=Variant.BUCKETED, bucket_size_mb=1.0), 2)
    assert read_measured(point, record) == measured
    with pytest.raises(SchemaError, match="missing field comm_share"):
        read_measured(point, {k: v for k, v in record.items() if k != "comm_share"})


@pytest.mark.parametrize("edit, message", [
    (lambda h: h["benchmarks"][0]["extra_info"][POINT].update(kind="pipeline"), "unknown point kind 'pipeline'"),
    (lambda h: h["benchmarks"][0]["extra_info"][POINT].update(shard_group=2), "unknown field shard_group"),
    (lambda h: h["benchmarks"][0]["extra_info"][MEASURED].update(gpu_s=2.0), "unknown field gpu_s"),
    (lambda h: h.update(systems_lab_schema=SCHEMA + 1),
     f"saved with schema {SCHEMA + 1} (this code reads {SCHEMA}): a newer schema"),
    (lambda h: h.pop("systems_lab_schema"), "python -m systems.bench.migrate"),
    (lambda h: h["benchmarks"][0]["extra_info"].pop(MEASURED), "a point without its measurements"),
], ids=["unknown-kind", "unknown-point-field", "unknown-measured-field", "newer-schema", "older-schema",
        "no-measurements"])
def test_a_history_of_another_schema_is_a_one_line_error_that_says_so(tmp_path, capsys, edit, message):
    """Never a row merged across a field the report does not know, nor a silent blank: one line naming it."""
    path = save_run(tmp_path / "storage", 1, [model_entry(), model_entry(dataclasses.replace(MODEL, batch=8))])
    history = json.loads(path.read_text())
    edit(history)
    path.write_text(json.dumps(history))
    assert main(["--storage", str(tmp_path / "storage"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("report: error: ") and message in err and err.count("\n") == 1
    assert str(path) in err


def test_a_breakdown_that_is_not_a_step_breakdown_is_a_bad_history(tmp_path, capsys):
    point = FSDPPoint(TrainSpec(**XL, variant=Variant.FSDP, fsdp_gather=Gather.BLOCK, fsdp_prefetch=1), 2)
    measured = FSDPMeasured("nccl", phases(0.4), 1e4, rate(1.0), None, config("xl", 512), None, None,
                            [step_breakdown(0.5, 0.4)])
    benchmark = entry(point, measured, 0.4)
    del benchmark["extra_info"][MEASURED]["breakdown_per_rank"][0]["recompute_s"]
    save_run(tmp_path / "storage", 1, [benchmark])
    assert main(["--storage", str(tmp_path / "storage"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "breakdown_per_rank[0]: missing field recompute_s" in err and err.count("\n") == 1


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
        path = tmp_path / "storage" / "machine" / "0001_abc_20260101_120000.json"
        path.parent.mkdir(parents=True)
        path.write_text(history)
    code = main(["--storage", str(tmp_path / "storage"), "--out", str(tmp_path / "out"), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("report: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("out, message", [("report", "is a file; name a folder"),
                                          ("report/tables", "cannot write into")], ids=["a-file", "under-a-file"])
def test_an_out_folder_that_cannot_be_written_is_a_one_line_error(tmp_path, capsys, out, message):
    save_run(tmp_path / "storage", 1, [model_entry()])
    (tmp_path / "report").write_text("not a folder")
    code = main(["--storage", str(tmp_path / "storage"), "--out", str(tmp_path / out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("report: error: ") and message in err and err.count("\n") == 1
    assert (tmp_path / "report").read_text() == "not a folder"


def test_command_line_error_has_no_traceback(tmp_path, capsys, monkeypatch):
    """`python -m systems.report` itself, its `__main__` run in this process (pytest's import hook, which rewrites
    the package's asserts, cannot hand runpy a module's code): main()'s one-line errors are checked above."""
    save_run(tmp_path / "storage", 5, [model_entry()])
    bad = tmp_path / "0001_abc_20260101_120000.json"
    bad.write_text('{"benchmarks": [{"fullname": 1}]}')
    command = ["--storage", str(tmp_path / "storage"), "--out", str(tmp_path / "o"), "--run", str(bad)]
    monkeypatch.setattr(sys, "argv", ["systems.report", *command])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(importlib.util.find_spec("systems.report.__main__").origin, run_name="__main__")
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("report: error: ") and err.count("\n") == 1


# The same benchmarks as saved before the schema: fields among the figures, levers missing, old names.
OLD_BENCHMARKS = [
    {"name": "test_model[small-ctx128-fp32-eager-forward]",
     "fullname": "benches/bench_model.py::test_model[small-ctx128-fp32-eager-forward]",
     "extra_info": dict(preset="small", context=128, precision="fp32", compile="eager", phase="forward", batch_size=4,
                        attention="sdpa", parameters=1, tokens_per_s=4e3, tflops=1.0)},
    {"name": "test_allreduce[nccl-2ranks-1MiB]",
     "fullname": "benches/bench_allreduce.py::test_allreduce[nccl-2ranks-1MiB]",
     "extra_info": dict(backend="nccl", world_size=2, size_mb=1.0, bytes=2**20, warmup_calls=5, calls=20, time_s=4e-5,
                        time_spread_s=1e-6, busbw_gbps=2**20 / 4e-5 / 1e9, bare_busbw_gbps=210.0)},
    {"name": "test_fsdp_step[fsdp-xl-bf16-ctx512-b16-2ranks]",
     "fullname": "benches/bench_fsdp.py::test_fsdp_step[fsdp-xl-bf16-ctx512-b16-2ranks]",
     "extra_info": {POINT: dict(kind="fsdp", variant="fsdp", preset="xl", precision="bf16", context=512, batch_size=16,
                                world_size=2),
                    **dict(backend="nccl", step_s=0.4, forward_s=0.03, backward_s=0.06, comm_wait_s=0.0,
                           optimizer_s=0.01, gather_wait_s=0.002, tokens_per_s=1e4, tflops=1.0,
                           predicted_peak_mb=1000.0, memory_after_step_mb=900.0)}},
]


def test_a_history_saved_before_the_schema_migrates_into_it_once(tmp_path):
    """Its report after migration is the report of the same benchmarks saved the schema's way; a migrated
    history is left alone."""
    old = save_run(tmp_path / "old", 1, [{**b, "group": None, "params": {}, "param": "", "options": {},
                                          "stats": entry(MODEL, ModelMeasured(1, None, None, None, {}), 0.4)["stats"]}
                                         for b in OLD_BENCHMARKS])
    history = json.loads(old.read_text())
    del history["systems_lab_schema"]
    history["out_of_memory"] = [{"name": "test_model[small-ctx256-fp32-eager-step]", "error": "CUDA out of memory",
                                 "fullname": "benches/bench_model.py::test_model[small-ctx256-fp32-eager-step]"}]
    old.write_text(json.dumps(history))
    assert migrate.main([str(old)]) == 0
    migrated = old.read_text()
    assert migrate.main([str(old)]) == 0 and old.read_text() == migrated

    ours = TrainSpec(**XL, variant=Variant.FSDP, fsdp_gather=Gather.LAYER, fsdp_prefetch=1)  # what it ran with then
    fsdp = FSDPPoint(ours, 2)
    new = [entry(MODEL, ModelMeasured(1, 4e3, rate(1.0), None, config("small", 128)), 0.4),
           entry(AllReducePoint("nccl", 2, 1.0), allreduce_measured(2**20, 4e-5, None), 0.4),
           entry(fsdp, FSDPMeasured("nccl", phases(0.4, gather_wait=0.002), 1e4, rate(1.0), {"after_step": 900.0},
                                    config("xl", 512), 1000.0, None, None), 0.4)]
    save_run(tmp_path / "new", 1, new, oom=[dataclasses.replace(MODEL, context=256, phase="step")])
    assert [b["name"] for b in json.loads(migrated)["benchmarks"]] == [b["name"] for b in new]
    tables = {}
    for form in ("old", "new"):
        assert main(["--storage", str(tmp_path / form), "--out", str(tmp_path / f"{form}-report")]) == 0
        tables[form] = {path.name: path.read_text() for path in (tmp_path / f"{form}-report").glob("*.md")
                        if path.name != "report.md"}
    assert tables["old"] == tables["new"] and "OOM" in tables["new"]["model.md"]


LEVERED = {  # points of kinds that gained the fused kernels and compilation, as they ran before: without them
    "checkpoint": (2, CheckpointPoint("small", "2025", 4, 256, FP32, Attention.SDPA, Checkpointing.parse("every1")),
                   "[small-2025-b4-ctx256-fp32-sdpa-every1]"),
    "leaderboard": (3, LeaderboardPoint("ours", "leaderboard-2026", "2026", PRECISIONS["bf16"], 2, 32768, 2,
                                        Attention.SDPA, Checkpointing.parse("attn-keep4"), 4096, 30000.0, 10000.0),
                    "[ours-leaderboard-2026-2026-bf16-b2-ctx32768-2ranks-sdpa-attn-keep4-loss4096-rep30000"
                    "-warmup10000]"),
}


@pytest.mark.parametrize("kind", LEVERED)
def test_an_older_history_gains_the_levers_added_since(tmp_path, kind):
    """Its points ran without fused kernels or compilation: they read back so, under the same ids."""
    schema, point, test_id = LEVERED[kind]
    path = save_run(tmp_path, 1, [], oom=[point])
    history = json.loads(path.read_text())
    for field in migrate.later_fields(kind, schema):
        del history["out_of_memory"][0][POINT][field]
    history["systems_lab_schema"] = schema
    path.write_text(json.dumps(history))
    assert migrate.main([str(path)]) == 0
    (oom,) = json.loads(path.read_text())["out_of_memory"]
    assert read_point(oom[POINT]) == point and oom["name"].endswith(test_id)
    assert "-fused-all-compiled" in str(dataclasses.replace(point, fused=Fused.ALL, compile=True))


def test_migration_knows_every_kind():
    """Every kind an older history's tests made has its migration, and is a kind of the schema."""
    assert set(migrate.KIND_OF_TEST.values()) == migrate.MEASURED_OF.keys() <= KINDS.keys()


def old_shape(batch: int, **fields) -> dict:
    """A point's shape of the xl model as schema 4 recorded it."""
    return {"preset": "xl", "edition": "2025", "precision": "bf16", "batch": batch, "context": 512, **fields}


# Training points as the committed histories held them at schema 4 (run 0007's DDP and optimizer points, 0051's
# FSDP, 0067's full step, 0066's layout), beside the point of the run each trained, with the id they were saved under.
SCHEMA_4 = {
    "ddp": ({"kind": "ddp", "variant": "torch", "bucket_size_mb": 25.0, **old_shape(8, world_size=2)},
            DDPPoint(TrainSpec(**XL | {"batch_size": 8}, variant="torch", bucket_size_mb=25.0), 2),
            "torch-25MiB-xl-2025-bf16-b8-ctx512-2ranks"),
    "ddp-single": ({"kind": "ddp", "variant": "single", "bucket_size_mb": None, **old_shape(8, world_size=1)},
                   DDPPoint(TrainSpec(**XL | {"batch_size": 8}, variant="single", bucket_size_mb=None), 1),
                   "single-xl-2025-bf16-b8-ctx512-1ranks"),
    "optimizer": ({"kind": "optimizer", "optimizer": "zero", **old_shape(8, world_size=2)},
                  OptimizerPoint(TrainSpec(**XL | {"batch_size": 8}, variant="bucketed", bucket_size_mb=25.0,
                                           optimizer="zero"), 2),
                  "zero-xl-2025-bf16-b8-ctx512-2ranks"),
    "fsdp-bucketed": ({"kind": "fsdp", "variant": "bucketed", **old_shape(16, world_size=2), "gather": None,
                       "prefetch": None},
                      FSDPPoint(TrainSpec(**XL, variant="bucketed", bucket_size_mb=100.0), 2),
                      "bucketed-xl-2025-bf16-b16-ctx512-2ranks"),
    "fsdp": ({"kind": "fsdp", "variant": "fsdp", **old_shape(16, world_size=2), "gather": "layer", "prefetch": 1},
             FSDPPoint(TrainSpec(**XL, variant="fsdp", fsdp_gather="layer", fsdp_prefetch=1), 2),
             "fsdp-xl-2025-bf16-b16-ctx512-2ranks-layer-prefetch1"),
    "fullstep": ({"kind": "fullstep", "preset": "leaderboard-2026", "edition": "2025", "precision": "bf16", "batch": 1,
                  "context": 32768, "world_size": 2, "variant": "fsdp", "attention": "sdpa", "checkpoint": "attn-keep4",
                  "loss_chunk": 4096, "gather": "block", "prefetch": 1, "fused": "all", "compile": False},
                 FullStepPoint(TrainSpec(preset="leaderboard-2026", precision="bf16", batch_size=1, context=32768,
                                         variant="fsdp", attention="sdpa", checkpoint="attn-keep4", loss_chunk=4096,
                                         fsdp_gather="block", fsdp_prefetch=1, fused="all"), 2),
                 "fsdp-leaderboard-2026-2025-bf16-b1-ctx32768-2ranks-sdpa-ckpt-attn-keep4-loss-chunk4096-block"
                 "-prefetch1-fused-all"),
    "layout": ({"kind": "layout", "variant": "hsdp", "layout": {"replicate": 2, "shard": 2, "tensor": 1},
                **old_shape(4)},
               LayoutPoint(TrainSpec(**XL | {"batch_size": 4}, variant="hsdp", layout="2x2", bucket_size_mb=25.0),
                           Layout(2, 2)),
               "hsdp-2x2-xl-2025-bf16-b4-ctx512"),
}


@pytest.mark.parametrize("name", SCHEMA_4)
def test_a_training_point_of_schema_4_becomes_the_spec_it_ran(name):
    """Its kind's levers and TrainSpec's defaults then, whole in its spec, under the id it was saved with; the
    benchmark's figures stand."""
    old, point, test_id = SCHEMA_4[name]
    history = {"systems_lab_schema": 4, "benchmarks": [{"name": f"test_x[{test_id}]",
                                                        "extra_info": {POINT: old, MEASURED: {"step_s": 1.0}}}],
               "out_of_memory": [{"name": f"test_x[{test_id}]", "error": "CUDA out of memory", POINT: old}]}
    migrated = migrate.migrate(history)
    (bench,), (oom,) = migrated["benchmarks"], migrated["out_of_memory"]
    assert migrated["systems_lab_schema"] == SCHEMA and bench["extra_info"][MEASURED] == {"step_s": 1.0}
    for record in (bench["extra_info"][POINT], oom[POINT]):
        assert record == point.to_record() and read_point(record) == point
    assert str(point) == test_id


COMMITTED = sorted((ROOT / ".benchmarks").glob("*/*.json"))


def test_every_committed_point_is_the_point_its_benchmark_is_named_after():
    """Each committed history is at the schema, and each of its points, benchmarks' and out-of-memory ones, reads
    back to the point whose id names it: a point's key in every history."""
    assert COMMITTED
    for path in COMMITTED:
        history = json.loads(path.read_text())
        assert history["systems_lab_schema"] == SCHEMA, path
        for bench in history["benchmarks"]:
            point = read_point(bench["extra_info"][POINT])
            assert bench["name"] == f"{named_test(bench)}[{point}]" and bench["param"] == str(point), path
        for entry in history.get("out_of_memory", []):
            assert entry["name"] == f"{named_test(entry)}[{read_point(entry[POINT])}]", path


def named_test(entry: dict) -> str:
    return entry["name"].split("[")[0]


BENCH = """
import pytest
import torch

from systems.bench.schema import ModelMeasured, ModelPoint
from systems.bench.timing import record_measured, record_point
from systems.precision import PRECISIONS

POINTS = [ModelPoint("tiny", "2025", 4, context, PRECISIONS["fp32"], "sdpa", "eager", phase)
          for context in (64, 128, 256) for phase in ("forward", "step")]

@pytest.mark.parametrize("point", POINTS, ids=str)
def test_model(benchmark, skip_on_oom, point):
    record_point(benchmark, point)
    with skip_on_oom:
        if point.context == 256 and point.phase == "step":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        benchmark.pedantic(sum, args=(range(point.context),), rounds=3)
    record_measured(benchmark, ModelMeasured(1, None, None, None, {}))
"""


def test_report_of_a_real_benchmark_run(inner_pytest, tmp_path):
    """pytest-benchmark and the plugin write the history; the report reads it, out-of-memory point included."""
    inner_pytest.mkdir("benches")
    (inner_pytest.path / "benches" / "bench_model.py").write_text(BENCH)
    ran = inner_pytest.runpytest_inprocess("benches/bench_model.py", "-p", "no:cacheprovider", "-o",
                                           "python_files=bench_*.py", "--benchmark-autosave")
    ran.assert_outcomes(passed=5, skipped=1)
    [history] = (inner_pytest.path / ".benchmarks").glob("*/*.json")
    [oom] = json.loads(history.read_text())["out_of_memory"]
    assert read_point(oom[POINT]) == ModelPoint("tiny", "2025", 4, 256, FP32, "sdpa", "eager", "step")
    assert main(["--storage", str(inner_pytest.path / ".benchmarks"), "--out", str(tmp_path)]) == 0
    run = load_run(history)
    assert {r.point.context for r in run.results} == {64, 128, 256}
    rows = [line for line in (tmp_path / "model.md").read_text().splitlines() if line.startswith("| tiny")]
    assert [row.split(" | ")[1] for row in rows] == ["64", "128", "256"] and rows[-1].endswith("| OOM |")
    assert (tmp_path / "model_forward.png").exists()


def test_recording_another_kinds_measurements_is_an_error(inner_pytest):
    inner_pytest.makepyfile(test_wrong="""
        from systems.bench.schema import AllReducePoint, WarmupMeasured
        from systems.bench.timing import record_measured, record_point

        def test_wrong(benchmark):
            record_point(benchmark, AllReducePoint("gloo", 2, 1.0))
            benchmark(sum, [1])
            record_measured(benchmark, WarmupMeasured(None, {}))
    """)
    # Timed briefly: what is checked is the record made after the timing.
    ran = inner_pytest.runpytest_inprocess("-p", "no:cacheprovider", "--benchmark-max-time=0.05")
    ran.assert_outcomes(failed=1)
    ran.stdout.fnmatch_lines(["*AllReducePoint measures AllReduceMeasured, not WarmupMeasured*"])
