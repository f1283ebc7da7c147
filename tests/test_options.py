"""The benchmark grids' options: each parsed by its lever's parser into the typed Grid, a bad value or a grid that
selects nothing a usage error at start-up naming the option, and the plugin visible wherever it is installed."""

import dataclasses
import json
import os
from importlib.metadata import entry_points

import pytest

from systems.attention import BENCHED_BACKENDS
from systems.bench.options import OPTIONS, Grid, _list
from systems.levers.checkpointing import Checkpointing
from systems.levers.layout import Layout
from systems.levers.sharding import Gather
from systems.levers.spelling import as_option_type
from systems.levers.variant import Variant
from systems.model import EDITIONS, Attention, Fused
from systems.parallel.__main__ import parse_args
from systems.parallel.spec import Schedule, TrainSpec, lever_parser
from systems.precision import PRECISIONS

NOTHING = "def test_nothing(): pass"
GRID = """
import dataclasses, json, pathlib
from systems.bench.options import grid_of

def test_grid(request):
    grid = grid_of(request.config)
    values = {field.name: repr(getattr(grid, field.name)) for field in dataclasses.fields(grid)}
    pathlib.Path("grid.json").write_text(json.dumps(values))
"""


@pytest.mark.parametrize("option, message", [
    ("--attn-impls=naive,tritno", "--attn-impls: unknown implementation 'tritno'; choose from "
                                  + ", ".join(BENCHED_BACKENDS)),
    ("--attn-precisions=fp8", "--attn-precisions: unknown precision 'fp8'; choose from fp32, bf16, fp16"),
    ("--attn-precisions=bf16-weights", "--attn-precisions: unknown precision 'bf16-weights'"),
    ("--precisions=fp32,fp8", "--precisions: unknown precision 'fp8'"),
    ("--presets=huge", f"--presets: no preset 'huge' in the 2025 edition; choose from {', '.join(EDITIONS['2025'])}"),
    ("--ddp-preset=nope", "--ddp-preset: no preset 'nope' in the 2025 edition"),
    ("--presets=10B", "--presets: no preset '10B' in the 2025 edition"),
    ("--attention=flsh", f"--attention: unknown attention backend 'flsh'; choose from {', '.join(Attention)}"),
    ("--allreduce-backends=mpi", "--allreduce-backends: unknown backend 'mpi'; choose from gloo, nccl"),
    ("--fsdp-gather=blocks", f"--fsdp-gather: unknown gather 'blocks'; choose from {', '.join(Gather)}"),
    ("--fsdp-prefetch=0", "--fsdp-prefetch: prefetch must be at least 1, got 0"),
    ("--fullstep-variants=fsdp,ddp", "--fullstep-variants: unknown variant 'ddp'; choose from " + ", ".join(Variant)),
    ("--fullstep-variants=fsdp,torch-hsdp", "--fullstep-variants: torch-hsdp takes a layout: bench_layouts runs it"),
    ("--layouts=2x2,1x2x2", "--layouts: layout 1x2x2 has a tensor axis: bench_layouts lays out replicas x shards"),
    ("--checkpoint=every0", "--checkpoint: checkpointing 'every0': segment sizes must be positive"),
    ("--checkpoint=4", "--checkpoint: unknown checkpointing '4'"),
    ("--loss-chunk=0", "--loss-chunk: 0 is not positive"),
    ("--loss-chunk=2.5", "--loss-chunk: '2.5' is not a valid"),
    ("--edition=2027", "--edition: unknown edition '2027'; choose from 2025, 2026"),
    ("--world-sizes=0", "--world-sizes: 0 is not positive"),
    ("--world-sizes=2,-2", "--world-sizes: -2 is not positive"),
    ("--contexts=-5", "--contexts: -5 is not positive"),
    ("--compile-contexts=0", "--compile-contexts: 0 is not positive"),
    ("--attn-seqs=0", "--attn-seqs: 0 is not positive"),
    ("--batch-size=0", "--batch-size: 0 is not positive"),
    ("--rounds=0", "--rounds: 0 is not positive"),
    ("--warmup-steps=-1", "--warmup-steps: -1 is not zero or more"),
    ("--allreduce-sizes-mb=0", "--allreduce-sizes-mb: 0.0 is not positive"),
    ("--bucket-sizes-mb=1,nan", "--bucket-sizes-mb: nan is not positive"),
    ("--contexts=,", "--contexts: no values given"),
    ("--contexts=128,12x", "--contexts: '12x' is not a valid int"),
    ("--checkpoint=every1-keep0", "--checkpoint: checkpointing 'every1-keep0': -keepN keeps at least one block"),
    ("--fused=layernorm", "--fused: unknown fused 'layernorm'; choose from none, all, rmsnorm, rope, swiglu, loss"),
    ("--compile-blocks=yes", "--compile-blocks: unknown switch 'yes'; choose from off, on"),
    (["--checkpoint=every1,ops", "--compile-blocks=off,on"], "--checkpoint ops with --compile-blocks on: op-level "
                                                             "selection cannot see inside a compiled block"),
])
def test_a_bad_grid_option_is_a_usage_error_at_start_up(inner_pytest, option, message):
    inner_pytest.makepyfile(test_nothing=NOTHING)
    options = option if isinstance(option, list) else [option]
    ran = inner_pytest.runpytest_inprocess(*options, "--collect-only", "-p", "no:cacheprovider")
    assert ran.ret == pytest.ExitCode.USAGE_ERROR
    assert message in ran.stderr.str()


def test_options_become_their_levers_in_one_typed_grid(inner_pytest):
    """The benches get objects, not text: a precision, a checkpointing scheme, a gather, a variant, a layout."""
    inner_pytest.makepyfile(test_grid=GRID)
    ran = inner_pytest.runpytest_inprocess("--presets=all", "--compile-contexts=", "--precisions=bf16-weights",
                                            "--checkpoint=none,every4,6x1,nested,every1-keep2",
                                            "--fused=all,rope", "--compile-blocks=on", "--fsdp-gather=layer,block",
                                            "--fullstep-variants=fsdp,fsdp2", "--loss-chunk=full",
                                            "--attn-impls=" + ",".join(BENCHED_BACKENDS), "--warmup-steps=0",
                                            "--bucket-sizes-mb=0.5,100", "--layouts=2x2,1X4", "-p",
                                            "no:cacheprovider")
    assert ran.ret == pytest.ExitCode.OK, ran.stderr.str()
    grid = json.loads((inner_pytest.path / "grid.json").read_text())
    assert grid["presets"] == repr(list(EDITIONS["2025"]))
    assert grid["precisions"] == repr([PRECISIONS["bf16-weights"]])
    assert grid["checkpoint"] == repr([Checkpointing.parse(text)
                                       for text in ("none", "every4", "6x1", "nested", "every1-keep2")])
    assert grid["fused"] == repr([Fused.ALL, Fused.ROPE]) and grid["compile_blocks"] == "[True]"
    assert grid["fsdp_gather"] == repr([Gather.LAYER, Gather.BLOCK])
    assert grid["fullstep_variants"] == repr([Variant.FSDP, Variant.FSDP2]) and grid["loss_chunk"] == "None"
    assert grid["compile_contexts"] == "[]" and grid["bucket_sizes_mb"] == "[0.5, 100.0]"
    assert grid["layouts"] == repr([Layout(replicate=2, shard=2), Layout(shard=4)])


@pytest.mark.parametrize("bench, options, message", [
    ("bench_fsdp.py", ["--world-sizes=1"], "--world-sizes select no point of test_fsdp_step: FSDP needs 2 ranks"),
    ("bench_allreduce.py", ["--world-sizes=1"], "--world-sizes select no point of test_allreduce"),
    ("bench_ddp.py", ["--world-sizes=1", "-k", "optimizer"], "--world-sizes select no point of "
                                                              "test_optimizer_memory"),
    ("bench_checkpoint.py", ["--max-context=16"], "--max-context 16 is below the first of --contexts (128): the "
                                                  "context search would run nothing"),
])
def test_a_grid_that_selects_no_point_of_a_bench_is_an_error_naming_the_options(inner_pytest, bench, options,
                                                                               message):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ran = inner_pytest.runpytest_inprocess(os.path.join(root, "benches", bench), *options, "--collect-only",
                                            "-p", "no:cacheprovider", "-o", "python_files=bench_*.py")
    assert ran.ret != pytest.ExitCode.OK
    assert message in ran.stdout.str() + ran.stderr.str()


def test_an_option_of_one_bench_does_not_stop_another(inner_pytest):
    """The context search's bound is bench_checkpoint's: bench_layouts at a longer context collects."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ran = inner_pytest.runpytest_inprocess(os.path.join(root, "benches", "bench_layouts.py"), "--contexts=512",
                                            "--collect-only", "-p", "no:cacheprovider", "-o", "python_files=bench_*.py")
    assert ran.ret == pytest.ExitCode.OK, ran.stdout.str() + ran.stderr.str()


@pytest.mark.skipif(not any(ep.name == "systems.bench.plugin" for ep in entry_points(group="pytest11")),
                    reason="the package is not installed (pip install -e .), so no entry point registers the plugin")
def test_installed_the_plugin_is_in_any_projects_pytest(pytester):
    """A course repository gets the options without a conftest of ours and without -p: the pytest11 entry point
    loads it (into a pytest run in this process, whose plugins are its own)."""
    help_text = pytester.runpytest_inprocess("--help").stdout.str()
    assert "what the benchmarks sweep" in help_text and "--presets=PRESETS" in help_text
    assert "--benchmark-gate-against=REV" in help_text


@pytest.mark.parametrize("bench, options, points", [
    ("bench_fullstep.py", ["--checkpoint=every1,attn-keep2", "--fused=none,all", "--precisions=fp32,bf16",
                           "--fsdp-prefetch=1,2"], 16),
    ("bench_checkpoint.py", ["-k", "test_checkpoint", "--checkpoint=none,ops", "--fused=none,rope",
                             "--compile-blocks=off", "--precisions=bf16"], 4),
])
def test_a_bench_grid_is_every_combination_of_its_options(inner_pytest, bench, options, points):
    """bench_fullstep: 2 schemes x 2 fused x 2 precisions x 2 prefetches; bench_checkpoint's steps: 2 x 2."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ran = inner_pytest.runpytest_inprocess(os.path.join(root, "benches", bench), *options, "--collect-only", "-q",
                                           "-p", "no:cacheprovider", "-o", "python_files=bench_*.py")
    assert ran.ret == pytest.ExitCode.OK, ran.stderr.str()
    assert sum("::test_" in line for line in ran.stdout.lines) == points


def test_the_grid_holds_each_options_objects_and_refuses_text():
    """Grid's fields are typed from the options' parsers and checked: the parsed defaults make a Grid, and text
    where a bench reads objects (a precision's name, a number as text) is a TypeError naming the field."""
    defaults = {option.dest: None if option.default is None else
                (_list(option.parse, option.empty) if option.many else as_option_type(option.parse))(option.default)
                for option in OPTIONS.values()}
    grid = Grid(**defaults)
    assert grid.precisions == [PRECISIONS["fp32"], PRECISIONS["bf16"]] and grid.rounds == 5
    for name, text in [("precisions", ["bf16"]), ("rounds", "5"), ("loss_chunk", "48"), ("checkpoint", "none")]:
        with pytest.raises(TypeError, match=f"grid option {name} must be"):
            Grid(**defaults | {name: text})


# Grid options that sweep a training run's lever, by the TrainSpec or Schedule field they set.
LEVER_OPTIONS = {"precisions": "precision", "batch_size": "batch_size", "attention": "attention",
                 "warmup_steps": "warmup", "rounds": "steps", "checkpoint": "checkpoint", "fused": "fused",
                 "compile_blocks": "compile",
                 "bucket_sizes_mb": "bucket_size_mb", "fsdp_prefetch": "fsdp_prefetch", "fsdp_gather": "fsdp_gather",
                 "layouts": "layout", "loss_chunk": "loss_chunk", "edition": "edition", "contexts": "context"}


@pytest.mark.parametrize("dest, field", LEVER_OPTIONS.items())
def test_a_grid_option_and_torchruns_flag_parse_a_lever_with_its_one_parser(dest, field):
    assert OPTIONS[dest].parse is lever_parser(field)


def test_a_lever_is_the_field_of_one_dataclass():
    """What a run trains (TrainSpec) and how long it is timed (Schedule) share no name: lever_parser finds one."""
    trained, timed = ({field.name for field in dataclasses.fields(levers)} for levers in (TrainSpec, Schedule))
    assert trained and timed and not trained & timed


@pytest.mark.parametrize("flags, field, value", [
    (["--loss-chunk", "none"], "loss_chunk", None), (["--loss-chunk", "full"], "loss_chunk", None),
    (["--loss-chunk", "64"], "loss_chunk", 64), (["--fsdp-prefetch", "3"], "fsdp_prefetch", 3),
    (["--compile", "on"], "compile", True), (["--checkpoint", "every2-keep1"], "checkpoint", Checkpointing((2,), 1)),
    (["--variant", "hsdp", "--layout", "2x2"], "layout", Layout(replicate=2, shard=2)),
    (["--precision", "bf16"], "precision", PRECISIONS["bf16"])])
def test_torchruns_flags_are_the_specs_fields(flags, field, value):
    launch, spec, schedule = parse_args(["--backend", "gloo", *flags])
    assert getattr(spec, field) == value


def test_torchruns_warmup_and_steps_are_the_schedules():
    launch, spec, schedule = parse_args(["--backend", "gloo", "--warmup", "0", "--steps", "3"])
    assert schedule == Schedule(warmup=0, steps=3) and spec == parse_args(["--backend", "gloo"])[1]
    assert parse_args(["--backend", "gloo"])[2] == Schedule()


@pytest.mark.parametrize("flags, message", [(["--fsdp-prefetch", "0"], "--fsdp-prefetch: prefetch must be at least 1"),
                                            (["--loss-chunk", "-4"], "--loss-chunk: -4 is not positive"),
                                            (["--variant", "fsdp2x"], "--variant: unknown variant"),
                                            (["--steps", "0"], "--steps: 0 is not positive"),
                                            (["--warmup", "-1"], "--warmup: -1 is not zero or more")])
def test_a_bad_torchrun_flag_is_a_usage_error_naming_it(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--backend", "gloo", *flags])
    assert message in capsys.readouterr().err


def test_torchruns_command_line_resolves_nested_checkpointing_where_the_run_starts():
    launch, spec, schedule = parse_args(["--backend", "gloo", "--preset", "small", "--checkpoint", "nested"])
    assert spec.checkpoint.levels is not None and len(spec.config().checkpoint) == 2
