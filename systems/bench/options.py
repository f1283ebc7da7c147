"""The benchmark grids' command-line options: each parsed by its lever's one parser (a training run's levers by
TrainSpec's and Schedule's, `lever_parser`, as torchrun's command line), checked at start-up, and handed to the
benches as one typed `Grid`.

A bad value is argparse's usage error naming the option (`--precisions: unknown precision 'fp8'; choose
from ...`); a combination that selects nothing is caught here or, for what only a bench knows, where the bench
builds its points (`points_or_usage_error`).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from systems.attention.backends import BENCHED_BACKENDS
from systems.levers.spelling import as_option_type, name, one_of, positive
from systems.levers.variant import Variant
from systems.model import DEFAULT_EDITION, EDITIONS
from systems.parallel.ranks import GROUP_BACKENDS
from systems.parallel.spec import lever_parser
from systems.parallel.swiglu import FFNLayout
from systems.precision import DTYPES, Precision, get_precision
from systems.recompute import Saves


def _attention_precision(text: str) -> Precision:
    return get_precision(one_of(DTYPES, "precision")(text))


def _leaderboard_model(text: str) -> str:
    return one_of(("ours", "cs336_basics"), "model")(text)


def _world_variant(text: str) -> Variant:
    """A variant that shares the step over every rank: the layouts of hsdp and torch-hsdp are bench_layouts'."""
    variant = Variant(text)
    if variant.meshed:
        raise ValueError(f"{variant} takes a layout: " + ("bench_fullstep shares the step over every rank"
                                                         if variant.tensor_parallel else "bench_layouts runs it"))
    return variant


def _list(parse: Callable[[str], object], empty: bool = False) -> Callable[[str], list]:
    """A comma-separated list of `parse`'s values; empty only where `empty` says it means none."""
    item = as_option_type(parse)

    def parse_list(text: str) -> list:
        values = [item(part) for part in text.split(",") if part.strip()]
        if not values and not empty:
            raise argparse.ArgumentTypeError("no values given")
        return values
    return parse_list


@dataclass(frozen=True)
class Option:
    flag: str
    parse: Callable[[str], object]
    default: str | None  # as it would be typed, so that the default goes through the parser too; None: unset
    help: str
    many: bool = False  # a comma-separated list
    empty: bool = False  # an empty list is a choice: none of these points

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


GROUPS: dict[str, tuple[str, list[Option]]] = {
    "systems-lab grids": ("what the benchmarks sweep; defaults fit a laptop CPU", [
        Option("--presets", name, "tiny", "model presets (bench_model, bench_checkpoint), or all", many=True),
        Option("--edition", lever_parser("edition"), DEFAULT_EDITION,
               "the CS336 edition whose model table the presets name: 2025 or 2026 (xl differs; 10B is 2026's)"),
        Option("--contexts", lever_parser("context"), "128", "context lengths", many=True),
        Option("--compile-contexts", lever_parser("context"), "",
               "context lengths at which bench_model also runs under "
               "torch.compile", many=True, empty=True),
        Option("--compile-mode", one_of(("regional", "cudagraphs"), "compile mode"), "regional",
               "torch.compile block by block (compile time independent of depth), or the whole model with CUDA "
               "graphs (no launch overhead; compile time grows with depth)"),
        Option("--precisions", lever_parser("precision"), "fp32,bf16",
               "fp32, bf16 (autocast), fp16, bf16-weights (bf16 weights, fp32 master copies in AdamW)", many=True),
        Option("--batch-size", lever_parser("batch_size"), "4",
               "sequences per step (per rank in the distributed benches)"),
        Option("--attention", lever_parser("attention"), "sdpa", "attention backend of the model: naive, sdpa, flash"),
        Option("--warmup-steps", lever_parser("warmup"), "2", "untimed steps before each timed benchmark"),
        Option("--rounds", lever_parser("steps"), "5", "timed rounds per benchmark"),
        Option("--memory-snapshot-dir", str, None, "bench_model: write CUDA memory snapshots of a forward pass and "
               "a training step here"),
        Option("--checkpoint", lever_parser("checkpoint"), "none,every1,nested",
               "checkpointing schemes (bench_checkpoint, bench_fullstep): none, everyK (segments of K blocks), "
               "KxK (two levels, e.g. 6x1), nested (the two levels of least peak memory), attn or ops (blocks keeping "
               "attention's outputs, or those and the matmuls'); -keepN after any but none leaves the top N blocks "
               "out (every1-keep8)", many=True),
        Option("--fused", lever_parser("fused"), "none",
               "the model's fused Triton kernels (bench_checkpoint, bench_fullstep, "
               "bench_leaderboard's ours): none, all, or one of rmsnorm, rope, swiglu, loss", many=True),
        Option("--compile-blocks", lever_parser("compile"), "off",
               "torch.compile of each block (bench_checkpoint, bench_fullstep, "
               "bench_leaderboard's ours): off and/or on", many=True),
        Option("--max-context", lever_parser("context"), None,
               "bench_checkpoint's context search doubles from the first of --contexts up to this (default: twice "
               "the first of --contexts)"),
    ]),
    "attention benchmarks": ("bench_attention.py; defaults fit a laptop CPU", [
        Option("--attn-grid", one_of(("tiny", "full"), "grid"), "tiny",
               "tiny: seq 128,256 x d 16,32 in fp32; full: the GPU grids (handout sweep d 16-128 x seq "
               "256-16384; FlashAttention sweep d 16-128 x seq 128-65536 in bf16 and fp32)"),
        Option("--attn-seqs", positive(int), "", "sequence lengths, instead of --attn-grid's", many=True,
               empty=True),
        Option("--attn-dims", positive(int), "", "head dims, instead of --attn-grid's", many=True, empty=True),
        Option("--attn-precisions", _attention_precision, "", "fp32/bf16/fp16 for the FlashAttention sweep, "
               "instead of --attn-grid's", many=True, empty=True),
        Option("--attn-impls", one_of(BENCHED_BACKENDS, "implementation"), "",
               "from naive, compiled (torch.compile'd naive), pytorch (FlashAttentionPytorch), triton, gluon (the "
               "Gluon forward, Hopper only), sdpa (as torch picks), sdpa-flash and sdpa-cudnn (SDPA held to that "
               "kernel), sdpa-fa3 and sdpa-fa4 (SDPA's flash kernel replaced by torch's registered FA3/FA4, where "
               "installed), flex (FlexAttention, compiled); default on CUDA naive,compiled,triton,gluon (sm90 "
               "only),sdpa,sdpa-flash,sdpa-cudnn,sdpa-fa3/sdpa-fa4 (where installed),flex, and naive,pytorch,sdpa "
               "on CPU", many=True, empty=True),
    ]),
    "distributed benchmarks": ("bench_allreduce, bench_ddp, bench_fsdp, bench_layouts, bench_fullstep; defaults fit "
                               "a laptop CPU (gloo, 2 ranks; bench_layouts 4)", [
        Option("--world-sizes", positive(int), "2", "numbers of ranks, e.g. 2,4,8", many=True),
        Option("--allreduce-backends", one_of(GROUP_BACKENDS, "backend"), "gloo",
               "gloo (CPU tensors) and/or nccl (one GPU per rank)", many=True),
        Option("--allreduce-sizes-mb", positive(float), "1,10", "float32 tensor sizes in MiB, e.g. 1,10,100,1024",
               many=True),
        Option("--ddp-preset", lever_parser("preset"), "tiny", "model preset of bench_ddp (with --batch-size per rank, "
               "--contexts, --precisions)"),
        Option("--bucket-sizes-mb", lever_parser("bucket_size_mb"), "1,10",
               "DDPBucketed bucket sizes in MiB, e.g. 1,10,100,1000",
               many=True),
        Option("--fsdp-preset", lever_parser("preset"), "tiny", "model preset of bench_fsdp; the full-size point: xl"),
        Option("--fsdp-prefetch", lever_parser("fsdp_prefetch"), "1",
               "all-gathers our FSDP keeps in flight ahead of the computing "
               "layer, e.g. 1,2,5", many=True),
        Option("--fsdp-gather", lever_parser("fsdp_gather"), "block",
               "what one of our FSDP's collectives covers: layer (each weight, "
               "the handout's) and/or block (a Transformer block's weights, FSDP2's)", many=True),
        Option("--layouts", lever_parser("layout"), "2x2",
               "bench_layouts' replicas x shards (HSDP, ours and torch's), e.g. "
               "2x2,2x4; each layout's N ranks also run as DDP (N x 1) and FSDP (1 x N)", many=True),
        Option("--layout-preset", lever_parser("preset"), "tiny",
               "model preset of bench_layouts; the full-size point: xl on 4 GPUs"),
        Option("--fullstep-preset", lever_parser("preset"), "leaderboard-2026-tiny",
               "bench_fullstep's model; full size: leaderboard-2026 (with --contexts 32768 --batch-size 1 "
               "--precisions bf16 --loss-chunk 4096)"),
        Option("--fullstep-variants", _world_variant, "fsdp", "how bench_fullstep's ranks share the step, e.g. "
               "fsdp,fsdp2 (ours and torch's FSDP2 in one run); from "
               + ", ".join(variant for variant in Variant if not variant.meshed), many=True),
        Option("--loss-chunk", lever_parser("loss_chunk"), "48",
               "tokens per chunk of bench_fullstep's and bench_leaderboard's "
               "cross-entropy (ours), or full"),
    ]),
    "2026 edition benchmarks": ("bench_ffn (section 8's layouts of one SwiGLU layer, measured) and bench_leaderboard "
                                "(the leaderboard's step, timed as the course times it); defaults fit a laptop CPU", [
        Option("--ffn-layouts", FFNLayout, ",".join(FFNLayout), "layouts of the layer: " + ", ".join(FFNLayout)
               + " (fsdp-tp: every grid of a world size with both axes above one)", many=True),
        Option("--ffn-world-sizes", positive(int), "1,2,4", "ranks (GPUs under NCCL); single runs on 1", many=True),
        Option("--ffn-batches", positive(int), "8", "B: rows of the layer's input, the whole batch", many=True),
        Option("--ffn-d-models", positive(int), "16", "D: the layer's width", many=True),
        Option("--ffn-d-ffs", positive(int), "32", "D_FF: the layer's hidden width", many=True),
        Option("--ffn-precisions", _attention_precision, "fp32", "fp32/bf16/fp16: weights, activations and "
               "collectives (the handout's b: 2 bytes)", many=True),
        Option("--ffn-bandwidth-mb", positive(float), "4", "MiB of the collectives that calibrate W ("
               "100 or more on GPUs)", many=True),
        Option("--leaderboard-models", _leaderboard_model, "ours,cs336_basics", "ours (our FSDP, with --attention, "
               "--loss-chunk, --leaderboard-checkpoint, --fused, --compile-blocks) and/or cs336_basics (the course's "
               "reference model, skipped where it is not importable)", many=True),
        Option("--leaderboard-preset", lever_parser("preset"), "leaderboard-2026-tiny",
               "the model; the handout's: leaderboard-2026"),
        Option("--leaderboard-context", lever_parser("context"), "64", "sequence length; the handout's: 32768"),
        Option("--leaderboard-batch", positive(int), "2", "sequences in the whole batch (the handout's 2), split "
               "over the ranks"),
        Option("--leaderboard-world-size", positive(int), "2", "ranks (GPUs under NCCL); the handout's: 2"),
        Option("--leaderboard-precision", lever_parser("precision"), "bf16", "the handout's: bf16"),
        Option("--leaderboard-checkpoint", lever_parser("checkpoint"), "none", "checkpointing schemes of our model",
               many=True),
        Option("--leaderboard-rep-ms", positive(float), None, "do_bench's rep budget, ms; default the handout's "
               "30000 on a GPU, 20 on a CPU"),
        Option("--leaderboard-warmup-ms", positive(float), None, "do_bench's warmup budget, ms; default the "
               "handout's 10000 on a GPU, 10 on a CPU"),
    ]),
}
OPTIONS = {option.dest: option for _, options in GROUPS.values() for option in options}
PRESET_OPTIONS = ("presets", "ddp_preset", "fsdp_preset", "layout_preset", "fullstep_preset", "leaderboard_preset")


def _value_type(option: Option) -> object:
    """What the option's value is: its parser's result (a list of them for a list), None where it may be unset."""
    parse = option.parse
    kind = parse if isinstance(parse, type) else typing.get_type_hints(parse)["return"]
    if option.many:
        return list[kind]
    return kind | None if option.default is None else kind


def _check_value(name: str, value, kind) -> None:
    """`value` is a `kind` (a class, `list[T]` or a union of them): a bench reads the objects, never text."""
    if isinstance(kind, types.GenericAlias):
        _check_value(name, value, list)
        for item in value:
            _check_value(name, item, typing.get_args(kind)[0])
    elif not isinstance(value, typing.get_args(kind) or kind):
        raise TypeError(f"grid option {name} must be {kind}, got {value!r}")


def _check_fields(grid) -> None:
    for field in dataclasses.fields(grid):
        _check_value(field.name, getattr(grid, field.name), field.type)


# One typed field per option, named as the option's dest (`grid.precisions`: a list of Precision).
Grid = dataclasses.make_dataclass("Grid", [(option.dest, _value_type(option)) for option in OPTIONS.values()],
                                  namespace={"__post_init__": _check_fields}, frozen=True)
Grid.__module__, Grid.__doc__ = __name__, "Every grid option's parsed value, in a typed field named as its dest."


GRID = pytest.StashKey[Grid]()


def add_options(parser) -> None:
    for name, (description, options) in GROUPS.items():
        group = parser.getgroup(name, description)
        for option in options:
            parse = _list(option.parse, option.empty) if option.many else as_option_type(option.parse)
            default = None if option.default is None else parse(option.default)
            group.addoption(option.flag, type=parse, default=default, help=option.help)


def configure_grid(config) -> Grid:
    """The options as one Grid, checked as a whole; kept in the config's stash for `grid_of`."""
    values = {dest: config.getoption(dest) for dest in OPTIONS}
    presets = EDITIONS[values["edition"]]
    if values["presets"] == ["all"]:
        values["presets"] = list(presets)
    for dest in PRESET_OPTIONS:
        for name in values[dest] if isinstance(values[dest], list) else [values[dest]]:
            if name not in presets:
                raise pytest.UsageError(f"{OPTIONS[dest].flag}: no preset {name!r} in the {values['edition']} "
                                        f"edition; choose from {', '.join(presets)} (--edition chooses the table)")
    for dest in ("checkpoint", "leaderboard_checkpoint"):
        selective = [str(scheme) for scheme in values[dest] if scheme.saves != Saves.INPUTS]
        if selective and True in values["compile_blocks"]:
            raise pytest.UsageError(f"{OPTIONS[dest].flag} {','.join(selective)} with --compile-blocks on: op-level "
                                    "selection cannot see inside a compiled block; compile only with the other "
                                    "schemes")
    for layout in values["layouts"]:
        if layout.tensor > 1:
            raise pytest.UsageError(f"--layouts: layout {layout} has a tensor axis: bench_layouts lays out replicas x "
                                    f"shards (DDP, FSDP, HSDP); tensor parallelism trains as --variant fsdp-tp")
    grid = config.stash[GRID] = Grid(**values)
    return grid


def grid_of(config) -> Grid:
    return config.stash[GRID]


def points_or_usage_error(points: list, test: str, options: str, why: str) -> list:
    """A bench's points, or a usage error naming the options that left none."""
    if not points:
        raise pytest.UsageError(f"{options} select no point of {test}: {why}")
    return points
