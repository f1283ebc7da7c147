"""The tables of bench_layouts: each layout's step beside what each of its axes carries, as measured; and which
layout wins at 2, 8 and 64 nodes, as systems.accounting.layouts predicts it from this run's figures."""

from __future__ import annotations

from systems.accounting.layouts import Cluster, Compute, Links, fastest, predict_layouts
from systems.bench.schema import LAYOUT_BUCKET_MB, LAYOUT_VARIANTS
from systems.bench.schema.distributed import SHAPE
from systems.levers.variant import Variant
from systems.model import get_config
from systems.report.markdown import BATCH, Table, mib, ms, number, order
from systems.report.runs import Result, Run

AXES = ("shard", "replicate")
GPUS_PER_NODE = 8  # an H100 node
NODES = (2, 8, 64)
INTER_GBPS = (25, 50)  # GB/s a GPU sends across nodes: its InfiniBand NIC at 200 or 400 Gb/s


def _shape(result: Result) -> tuple:
    return tuple(getattr(result.point.spec, key) for key in SHAPE)


def _sorted(results: list[Result]) -> list[Result]:
    rank = {variant: i for i, variant in enumerate(LAYOUT_VARIANTS)}
    return sorted(results, key=lambda r: (tuple(map(order, _shape(r))), r.point.world_size,
                                          rank[r.point.spec.variant], str(r.point.layout)))


def layout_tables(run: Run) -> list[Table]:
    results, oom = _sorted(run.select("layout")), run.oom("layout")
    if not results and not oom:
        return []
    columns = ["preset", "precision", "context", "ranks", "variant", "layout", "step", "forward", "backward",
               "comm wait", "all-gather wait", "vs single"]
    columns += [f"{axis} {figure}" for axis in AXES for figure in ("ranks", "MiB sent", "alone (ms)", "GB/s")]
    table = Table("layouts", f"Layouts of the same ranks{BATCH} per rank: step (ms; mean over ranks of "
                             "their medians) and what each axis carries per step", columns,
                  note="Layouts are replicas x shards: bucketed is DDP (N x 1), fsdp shards over every rank (1 x N), "
                       "hsdp and torch-hsdp shard inside a node and replicate across nodes. Per axis: the bytes a "
                       "rank sends (systems.accounting.traffic, ring bytes), the time that axis's collectives of a "
                       "step take alone, back to back (torch-hsdp's timed with ours of the same sizes), and its bus "
                       "bandwidth. Comm wait and all-gather wait are what the step waited for: the communication "
                       "not hidden (torch's waits fall inside its backward).",
                  batches={r.point.spec.batch_size for r in results})
    for r in results:
        m, point, spec = r.measured, r.point, r.point.spec
        single = next((s for s in run.select("layout") if s.point.spec.variant == Variant.SINGLE
                       and _shape(s) == _shape(r)), None)
        versus = m.phases.step_s / single.measured.phases.step_s if single and spec.variant != Variant.SINGLE else None
        row = [number(spec.preset), number(spec.precision), number(spec.context), number(point.world_size),
               number(spec.variant), number(point.layout)]
        row += [ms(getattr(m.phases, f"{phase}_s")) for phase in ("step", "forward", "backward", "comm_wait",
                                                                 "gather_wait")] + [number(versus)]
        for axis in AXES:
            comm = m.axes.get(axis)
            row += ["", "", "", ""] if comm is None else [number(comm.ranks), mib(comm.sent_mb), ms(comm.seconds),
                                                          number(comm.busbw_gbps)]
        table.add(row, r, *filter(None, (single,)))
    for entry in oom:
        p, spec = entry.point, entry.point.spec
        table.add([number(spec.preset), number(spec.precision), number(spec.context), number(p.world_size),
                   number(spec.variant), number(p.layout), "OOM"] + [""] * (len(columns) - 7), entry)
    return [table] + _prediction_tables(results)


def _prediction_tables(results: list[Result]) -> list[Table]:
    """Per shape with a one-process point and an FSDP point: DDP, FSDP and HSDP at NODES nodes of GPUS_PER_NODE."""
    table = Table("layout_prediction", f"Which layout wins on {GPUS_PER_NODE}-GPU nodes: predicted step (ms) and its "
                                       "exposed communication, per GPU, from this run's compute and intra-node "
                                       "bandwidth",
                  ["preset", "precision", "context", "intra GB/s (measured)", "inter GB/s (assumed)", "nodes",
                   "GPUs", "ddp", "fsdp", "hsdp", "ddp exposed", "fsdp exposed", "hsdp exposed", "fastest"],
                  note="systems.accounting.layouts: every GPU keeps this run's batch and computes as its one-process "
                       "point did (forward, backward, optimizer; sharding divides the optimizer by the shards); an "
                       "axis runs at its slowest link's bus bandwidth, inside a node at the shard axis's measured on "
                       "this run's largest FSDP point, across nodes at the assumed figure; each pass's communication "
                       "beyond its compute is exposed. DDP buckets of "
                       f"{LAYOUT_BUCKET_MB:g} MiB, FSDP by blocks. Bandwidth only: ring latency, which grows with "
                       "the ring, would favour HSDP further.")
    for shape in dict.fromkeys(map(_shape, results)):
        here = [r for r in results if _shape(r) == shape]
        single = next((r for r in here if r.point.spec.variant == Variant.SINGLE), None)
        fsdp = max((r for r in here if r.point.spec.variant == Variant.FSDP and "shard" in r.measured.axes),
                   key=lambda r: r.point.world_size, default=None)
        if single is None or fsdp is None:
            continue
        preset, edition, precision, batch, context = shape
        config = get_config(preset, edition, context_length=context)
        phases = single.measured.phases
        compute = Compute(phases.forward_s, phases.backward_s, phases.optimizer_s)
        intra = fsdp.measured.axes["shard"].busbw_gbps
        for inter in INTER_GBPS:
            links = Links(intra_bandwidth=intra * 1e9, inter_bandwidth=inter * 1e9)
            for nodes in NODES:
                cluster = Cluster(nodes, GPUS_PER_NODE)
                steps = predict_layouts(config, precision, cluster, links, compute, bucket_size_mb=LAYOUT_BUCKET_MB)
                table.add([number(preset), number(precision), number(context), number(intra), number(inter),
                           number(nodes), number(cluster.gpus)]
                          + [ms(step.step_s) for step in steps.values()]
                          + [ms(step.exposed_s) for step in steps.values()] + [fastest(steps)], single, fsdp)
    return [table] if table.rows else []
