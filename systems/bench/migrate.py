"""Histories saved before the typed schema (systems.bench.schema), or at an older version of it, rewritten into
the current one, once.

    python -m systems.bench.migrate [HISTORY.json ...]   # default: every history under .benchmarks/

Older histories kept a point's fields among its figures, or only in its test id, and their figures under keys
that changed from run to run. This is the one place that still reads them: each benchmark becomes its point and
its measured dataclass, stored whole, under the new test id of its point; its out-of-memory points likewise;
fields an old run did not record are what it ran with (the grid's default, or its sibling points' value), or
None where the schema says a figure may be absent. A history at schema 2 or later gains the fields its points'
kinds have had since (`LATER_FIELDS`: what every run before them ran with); its ids stand. A training point of
schema 4 or before becomes the TrainSpec it ran (`trained_spec`). A history already at the schema is left alone.
The report reads only the schema; for an older file it names this command.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from systems.bench.breakdown import StepBreakdown
from systems.bench.schema import (ATTENTION_SWEEPS, MEASURED, POINT, SCHEMA, AllReduceMeasured, AttentionMeasured,
                                  CheckpointMeasured, ContextSearchMeasured, DDPMeasured, FSDPMeasured,
                                  FullStepMeasured, ModelMeasured, OptimizerMeasured, Phases, Throughput,
                                  WarmupMeasured, from_record, read_point, to_record)
from systems.levers.variant import Variant
from systems.model import get_config
from systems.parallel.spec import TrainSpec

EDITION = "2025"  # every history before the schema named the 2025 edition's presets
# Point fields added after schema 2, by the schema that added them and kind, with what every run before them ran
# with: no fused kernels, eager.
EAGER = {"fused": "none", "compile": False}
LATER_FIELDS = {3: {"fullstep": EAGER, "checkpoint": EAGER}, 4: {"leaderboard": EAGER}}
DEFAULT_BATCH, DEFAULT_ATTENTION = 4, "sdpa"  # the grid's defaults then, where a run did not record its own
# Until schema 5 a training point named its shape and the levers its kind varies; its run took the rest from
# TrainSpec's defaults then, and the kind's bucket sizes: DDPBucketed under the sharded optimizers, beside FSDP, and
# in the layouts.
TRAINED_WITH = {"bucket_size_mb": 25.0, "optimizer": "adamw", "lr": 1e-3, "seed": 0, "checkpoint": "none",
                "loss_chunk": None, "attention": "sdpa", "fused": "none", "compile": False, "fsdp_prefetch": 1,
                "fsdp_gather": "block", "layout": None}
SHARDED_BUCKET_MB, FSDP_DDP_BUCKET_MB, LAYOUT_BUCKET_MB = 25.0, 100.0, 25.0
TRAINING_KINDS = ("ddp", "optimizer", "fsdp", "fullstep", "layout")
KIND_OF_TEST = {"test_model": "model", "test_warmup_study": "warmup", "test_handout_sweep": "attention",
                "test_flash_sweep": "attention", "test_leaderboard": "attention",
                "test_leaderboard_after_a_second_shape": "attention", "test_allreduce": "allreduce",
                "test_ddp_step": "ddp", "test_optimizer_memory": "optimizer", "test_fsdp_step": "fsdp",
                "test_fullstep": "fullstep", "test_checkpoint": "checkpoint", "test_largest_context": "context_search"}
# Test ids of points that left only their id behind (out-of-memory points of early runs).
IDS = {"model": r"(?P<preset>[^-\]]+)-ctx(?P<context>\d+)-(?P<precision>[\w-]+)-(?P<compile>\w+)-(?P<phase>\w+)",
       "attention": r"(?P<impl>\w+)-seq(?P<seq>\d+)-d(?P<d>\d+)-(?P<precision>\w+)-(?P<pass>\w+)",
       "ddp": r"(?P<variant>[a-z]+)(?:-(?P<bucket_size_mb>[\d.]+)MiB)?-(?P<precision>[\w-]+?)-ctx(?P<context>\d+)"
              r"-(?P<world_size>\d+)ranks",
       "optimizer": r"(?P<world_size>\d+)ranks-(?P<optimizer>\w+)"}
NUMBERS = {"context": int, "seq": int, "d": int, "world_size": int, "bucket_size_mb": float}


def migrate(history: dict) -> dict:
    """The history at the schema: its benchmarks and out-of-memory points rewritten, the rest as it was."""
    if isinstance(history.get("systems_lab_schema"), int):
        return _from_schema(history, history["systems_lab_schema"])
    siblings = _siblings(history["benchmarks"])
    benchmarks = [_benchmark(bench, siblings) for bench in history["benchmarks"]]
    oom = [_out_of_memory(entry, siblings) for entry in history.get("out_of_memory", [])]
    return {**history, "benchmarks": benchmarks, "out_of_memory": oom, "systems_lab_schema": SCHEMA}


def later_fields(kind: str, since: int) -> dict:
    """The fields `kind`'s points gained after schema `since`, with what every run before them ran with."""
    return {field: value for schema, kinds in LATER_FIELDS.items() if schema > since
            for field, value in kinds.get(kind, {}).items()}


def _from_schema(history: dict, since: int) -> dict:
    """Points of schema `since` (2 or later) with the fields added after it, as they ran, and training points as
    the TrainSpec they ran."""
    def complete(point: dict) -> dict:
        return trained_spec({**point, **later_fields(point["kind"], since)})

    benchmarks = [{**bench, "extra_info": {**bench["extra_info"], POINT: complete(bench["extra_info"][POINT])}}
                  if POINT in (bench.get("extra_info") or {}) else bench for bench in history["benchmarks"]]
    oom = [{**entry, POINT: complete(entry[POINT])} for entry in history.get("out_of_memory", [])]
    return {**history, "benchmarks": benchmarks, "out_of_memory": oom, "systems_lab_schema": SCHEMA}


def _siblings(benchmarks: list[dict]) -> dict:
    """What a run's points share, for those that did not record it: the model points' batch and attention for
    the warm-up study's; the DDP points' preset, context and batch for the optimizer's and out-of-memory ones, the
    optimizer points' preset and precision for theirs."""
    found = {}
    for bench in benchmarks:
        info = bench.get("extra_info") or {}
        if "optimizer" in info:
            found.setdefault("optimizer", {"preset": info["preset"], "precision": info["precision"]})
        elif "batch_size_per_rank" in info:
            found.setdefault("ddp", {"preset": info["preset"], "context": info["context"],
                                     "batch": info["batch_size_per_rank"]})
        elif "batch_size" in info and "attention" in info:
            found.setdefault("model", {"batch": info["batch_size"], "attention": info["attention"]})
    return found


def _benchmark(bench: dict, siblings: dict) -> dict:
    test = bench["name"].split("[")[0]
    kind = KIND_OF_TEST[test]
    info = dict(bench.get("extra_info") or {})
    old = info.pop(POINT, None)
    point = read_point(trained_spec(_point(kind, test, old or {**(bench.get("params") or {}), **info}, bench["name"],
                                           siblings)))
    measured = MEASURED_OF[kind](info, point)
    if not isinstance(measured, point.measured):
        raise TypeError(f"{bench['name']}: {type(measured).__name__} for a {kind} point")
    module, _ = bench["fullname"].split("::")
    name = f"{test if kind != 'attention' or point.sweep != 'leaderboard' else 'test_leaderboard'}[{point}]"
    return {**bench, "name": name, "fullname": f"{module}::{name}", "param": str(point),
            "params": {"point": str(point)}, "extra_info": {POINT: point.to_record(), MEASURED: to_record(measured)}}


def _out_of_memory(entry: dict, siblings: dict) -> dict:
    test = entry["name"].split("[")[0]
    kind = KIND_OF_TEST[test]
    point = read_point(trained_spec(_point(kind, test, entry.get(POINT) or _from_id(kind, entry["name"]),
                                           entry["name"], siblings)))
    module, _ = entry["fullname"].split("::")
    name = f"{test}[{point}]"
    return {"name": name, "fullname": f"{module}::{name}", "error": entry["error"], POINT: point.to_record()}


def _from_id(kind: str, name: str) -> dict:
    match = re.search(rf"\[{IDS[kind]}\]", name)
    if match is None:
        raise ValueError(f"{name}: not a {kind} point's id")
    return {key: NUMBERS.get(key, str)(value) for key, value in match.groupdict().items() if value is not None}


def _point(kind: str, test: str, old: dict, name: str, siblings: dict) -> dict:
    """The schema's record of an old point: its fields as they were, with what it ran with added."""
    old = {key: value for key, value in old.items() if key != "kind"}
    common = {"edition": EDITION}
    if kind in ("model", "warmup"):
        run = siblings.get("model", {"batch": DEFAULT_BATCH, "attention": DEFAULT_ATTENTION})
        common |= {"batch": old.get("batch_size", run["batch"]), "attention": old.get("attention", run["attention"])}
        fields = ("warmup_steps",) if kind == "warmup" else ("compile", "phase")
        return {"kind": kind, **common, **{key: old[key] for key in ("preset", "context", "precision", *fields)}}
    if kind == "attention":
        if test.startswith("test_leaderboard"):
            first = 1024 if test == "test_leaderboard_after_a_second_shape" else None
            shape = ATTENTION_SWEEPS["leaderboard"]
            return {"kind": kind, "sweep": "leaderboard", "impl": "triton", "batch": shape.batch, "seq": 16384,
                    "d": 64, "precision": "bf16", "is_causal": True,
                    "pass": old.get("pass", old.get("pass_")), "first_seq": first}
        sweep = old.get("sweep") or test.removeprefix("test_").removesuffix("_sweep")
        shape = ATTENTION_SWEEPS[sweep]
        return {"kind": kind, "sweep": sweep, "impl": old["impl"], "batch": old.get("batch", shape.batch),
                "seq": old["seq"], "d": old["d"], "precision": old["precision"],
                "is_causal": old.get("is_causal", shape.is_causal), "pass": old.get("pass", old.get("pass_")),
                "first_seq": None}
    if kind == "allreduce":
        return {"kind": kind, **{key: old[key] for key in ("backend", "world_size", "size_mb")}}
    if kind == "ddp":
        run = siblings["ddp"]
        return {"kind": kind, **common, "variant": old["variant"], "bucket_size_mb": old.get("bucket_size_mb"),
                "preset": old.get("preset", run["preset"]), "precision": old["precision"],
                "batch": old.get("batch_size_per_rank", run["batch"]), "context": old["context"],
                "world_size": old["world_size"]}
    if kind == "optimizer":
        run, optimizers = siblings["ddp"], siblings["optimizer"]
        return {"kind": kind, **common, "optimizer": old["optimizer"],
                "preset": old.get("preset", optimizers["preset"]),
                "precision": old.get("precision", optimizers["precision"]), "batch": run["batch"],
                "context": run["context"], "world_size": old["world_size"]}
    if kind in ("fsdp", "fullstep"):
        ours = old["variant"] == "fsdp"
        levers = {"gather": old.get("gather", "layer") if ours else None,
                  "prefetch": old.get("prefetch", 1) if ours else None}
        fields = {key: old[key] for key in ("variant", "preset", "precision", "context", "world_size")}
        record = {"kind": kind, **common, **fields, "batch": old["batch_size"], **levers}
        if kind == "fullstep":
            blocks = old["checkpoint_blocks"]
            record |= {"attention": old["attention"], "loss_chunk": old["loss_chunk"],
                       "checkpoint": "none" if blocks is None else f"every{blocks}", **later_fields(kind, 2)}
        return record
    scheme = f"every{old['blocks']}" if old["scheme"] == "blocks" else old["scheme"]
    fields = ("preset", "batch", "precision", "attention") + (("context",) if kind == "checkpoint" else
                                                              ("start", "limit"))
    return {"kind": kind, **common, "scheme": scheme, **{key: old[key] for key in fields},
            **later_fields(kind, 2)}


def trained_spec(point: dict) -> dict:
    """A training point's record of schema 4 or before (its shape and its kind's levers) as the schema's: the
    TrainSpec it ran, and its ranks (a layout point's layout); any other point's as it is."""
    kind = point["kind"]
    if kind not in TRAINING_KINDS:
        return point
    variant = point.get("variant", "bucketed")  # the sharded optimizers' points ran under DDPBucketed
    levers = {"preset": point["preset"], "edition": point["edition"], "precision": point["precision"],
              "batch_size": point["batch"], "context": point["context"], "variant": variant}
    if kind == "ddp":
        levers["bucket_size_mb"] = point["bucket_size_mb"]
    elif kind == "optimizer":
        levers |= {"bucket_size_mb": SHARDED_BUCKET_MB, "optimizer": point["optimizer"]}
    elif kind == "layout":
        levers |= {"bucket_size_mb": LAYOUT_BUCKET_MB, "layout": point["layout"] if Variant(variant).meshed else None}
    if kind == "fsdp" and variant == "bucketed":
        levers["bucket_size_mb"] = FSDP_DDP_BUCKET_MB
    if kind == "fullstep":
        levers |= {key: point[key] for key in ("attention", "checkpoint", "loss_chunk", "fused", "compile")}
    if kind in ("fsdp", "fullstep") and variant == "fsdp":
        levers |= {"fsdp_gather": point["gather"], "fsdp_prefetch": point["prefetch"]}
    spec = to_record(from_record(TrainSpec, TRAINED_WITH | levers, f"{kind} point's spec"))
    ranks = {"layout": point["layout"]} if kind == "layout" else {"world_size": point["world_size"]}
    return {"kind": kind, "spec": spec, **ranks}


def _config(point) -> dict:
    return to_record(get_config(point.preset, point.edition, context_length=point.context, attention=point.attention))


def _throughput(info: dict) -> Throughput | None:
    if info.get("tflops") is None:
        return None
    return Throughput(info["tflops"], info.get("peak_tflops"), info.get("mfu"))


def _memory(info: dict) -> dict | None:
    moments = {key.removeprefix("memory_").removesuffix("_mb"): value for key, value in info.items()
               if key.startswith("memory_") and key.endswith("_mb") and key != "memory_before_backward_mb"}
    return moments or None


def _phases(info: dict) -> Phases:
    return Phases(**{f"{phase}_s": info.get(f"{phase}_s") for phase in
                     ("step", "forward", "backward", "comm_wait", "optimizer", "gather_wait")})


def _training(info: dict, point) -> dict:
    spec = point.spec
    levers = {"loss_chunk": spec.loss_chunk, "attention": spec.attention} if point.kind == "fullstep" else {}
    config = get_config(spec.preset, spec.edition, context_length=spec.context, **levers)
    return dict(backend=info["backend"], phases=_phases(info), tokens_per_s=info["tokens_per_s"],
                throughput=_throughput(info), memory_mb=_memory(info), config=to_record(config))


def _breakdowns(info: dict) -> list | None:
    records = info.get("breakdown_per_rank")
    return None if records is None else [from_record(StepBreakdown, record) for record in records]


def _checkpoint_measured(info: dict, point, context: int) -> CheckpointMeasured:
    return CheckpointMeasured(
        levels=tuple(info["checkpoint"]), parameters=info["parameters"], state_mb=info["state_mb"],
        predicted_peak_mb=info["predicted_peak_mb"], predicted_activation_mb=info["predicted_activation_mb"],
        peak_memory_mb=info.get("peak_memory_mb"), activation_mb=info.get("activation_mb"),
        recomputed_tflop=info["recomputed_tflop"], tokens_per_s=info.get("tokens_per_s"),
        throughput=_throughput(info), config=to_record(get_config(point.preset, point.edition, context_length=context,
                                                                  attention=point.attention,
                                                                  checkpoint=tuple(info["checkpoint"]))))


def _allreduce(info: dict, point) -> AllReduceMeasured:
    if "latency_s" in info:
        return AllReduceMeasured(**{key: info[key] for key in (
            "bytes", "warmup_calls", "rounds", "loop_calls", "latency_s", "latency_spread_s", "latency_busbw_gbps",
            "loop_time_s", "loop_spread_s", "algbw_gbps", "busbw_gbps", "bare_time_s", "bare_busbw_gbps",
            "loop_vs_bare")})
    # Before the back-to-back figures: one call at a time, its time and bandwidth under the plain names.
    return AllReduceMeasured(bytes=info["bytes"], warmup_calls=info["warmup_calls"], rounds=info["calls"],
                             loop_calls=None, latency_s=info["time_s"], latency_spread_s=info["time_spread_s"],
                             latency_busbw_gbps=info["busbw_gbps"], loop_time_s=None, loop_spread_s=None,
                             algbw_gbps=None, busbw_gbps=None, bare_time_s=info.get("bare_time_s"),
                             bare_busbw_gbps=info.get("bare_busbw_gbps"), loop_vs_bare=None)


MEASURED_OF = {
    "model": lambda info, point: ModelMeasured(info["parameters"], info.get("tokens_per_s"), _throughput(info),
                                               info.get("peak_memory_mb"), _config(point)),
    "warmup": lambda info, point: WarmupMeasured(info.get("peak_memory_mb"), _config(point)),
    "attention": lambda info, point: AttentionMeasured(
        ms=info["ms"], throughput=_throughput(info), peak_memory_mb=info.get("peak_memory_mb"),
        memory_before_backward_mb=info.get("memory_before_backward_mb"), device_ms=info.get("device_ms"),
        sdpa_device_ms=info.get("sdpa_device_ms"), do_bench_ms=info.get("do_bench_ms"),
        sdpa_do_bench_ms=info.get("sdpa_do_bench_ms")),
    "allreduce": _allreduce,
    "ddp": lambda info, point: DDPMeasured(**_training(info, point), step_spread_s=info["step_spread_s"],
                                           comm_share=info["comm_share"]),
    "optimizer": lambda info, point: OptimizerMeasured(
        state_mb=info["state_mb"], unsharded_state_mb=info["unsharded_state_mb"],
        state_fraction=info["state_fraction"], ideal_fraction=info["ideal_fraction"],
        optimizer_s=info["optimizer_s"], step_s=info["step_s"], memory_mb=_memory(info)),
    "fsdp": lambda info, point: FSDPMeasured(**_training(info, point), predicted_peak_mb=info["predicted_peak_mb"],
                                             peak_gathered_mb=info.get("peak_gathered_mb"),
                                             breakdown_per_rank=_breakdowns(info)),
    "fullstep": lambda info, point: FullStepMeasured(
        **_training(info, point), predicted_peak_mb=info["predicted_peak_mb"],
        peak_gathered_mb=info.get("peak_gathered_mb"), breakdown_per_rank=_breakdowns(info),
        do_bench_s=info.get("do_bench_s"), cold_start_s=info.get("cold_start_s"), step_pflop=info["step_pflop"],
        recomputed_tflop=info["recomputed_tflop"], peak_memory_mb_per_rank=info.get("peak_memory_mb_per_rank")),
    "checkpoint": lambda info, point: _checkpoint_measured(info, point, point.context),
    "context_search": lambda info, point: ContextSearchMeasured(
        largest_context=info["largest_context"], first_oom_context=info["first_oom_context"],
        predicted_largest_context=info["predicted_largest_context"],
        at_longest=_checkpoint_measured(info, point, info["largest_context"] or point.start)),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m systems.bench.migrate", description=__doc__.splitlines()[0])
    parser.add_argument("histories", nargs="*", type=Path, help="default: every .benchmarks/*/*.json")
    paths = parser.parse_args(argv).histories or sorted(Path(".benchmarks").glob("*/*.json"))
    for path in paths:
        history = json.loads(path.read_text())
        if history.get("systems_lab_schema") == SCHEMA:
            continue
        path.write_text(json.dumps(migrate(history), indent=4) + "\n")
        print(f"migrated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
