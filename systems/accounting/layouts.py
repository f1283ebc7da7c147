"""Which layout runs a training step fastest on a cluster of nodes: DDP, FSDP and HSDP, predicted from one GPU's
measured compute, the bytes each layout's collectives send on each axis (traffic.py), a measured intra-node
bandwidth and an assumed inter-node one.

`predict_layouts(config, precision, cluster, links, compute)` gives each strategy's `LayoutStep` on a `Cluster`, from
a measured `Compute` and the `Links`' bus bandwidths inside and across nodes; `predict_step` is one layout's,
`strategy_layout` and `link_of` say where its groups lie, and `fastest` picks the shortest step. Bandwidth only, no
latency: step = forward + backward + optimizer (/ S when sharded) + the communication each pass does not hide.
docs/design-notes.md has the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from systems.accounting.traffic import PASSES, StepCollective, ddp_collectives, fsdp_collectives
from systems.levers.layout import Layout
from systems.levers.sharding import DEFAULT_GATHER, Gather
from systems.model import TransformerConfig
from systems.precision import Precision

STRATEGIES = ("ddp", "fsdp", "hsdp")
LINKS = ("intra", "inter")


def _check_positive(name: str, value, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'zero or more' if allow_zero else 'positive'}, got {value}")


@dataclass(frozen=True)
class Compute:
    """One GPU's training step alone at the batch each GPU keeps, seconds by phase (measured)."""

    forward_s: float
    backward_s: float
    optimizer_s: float

    def __post_init__(self):
        for name in ("forward_s", "backward_s", "optimizer_s"):
            _check_positive(name, getattr(self, name), allow_zero=True)

    def of(self, pass_: str) -> float:
        return self.forward_s if pass_ == "forward" else self.backward_s


@dataclass(frozen=True)
class Links:
    """Bytes/s a GPU sends in a ring inside a node and across nodes (bus bandwidth)."""

    intra_bandwidth: float
    inter_bandwidth: float

    def __post_init__(self):
        _check_positive("intra_bandwidth", self.intra_bandwidth)
        _check_positive("inter_bandwidth", self.inter_bandwidth)

    def bandwidth(self, link: str) -> float:
        return self.intra_bandwidth if link == "intra" else self.inter_bandwidth


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Cluster's {name} must be a positive int, got {value!r}")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class LayoutStep:
    """A layout's predicted step, per GPU: bytes sent on each axis, each axis's link, each pass's communication
    (its busiest link's seconds) and what of it is exposed, and the step."""

    strategy: str
    layout: Layout
    sent: dict[str, int]  # axis -> bytes
    links: dict[str, str]  # axis -> "intra" or "inter"
    comm_s: dict[str, float]  # pass -> seconds
    exposed_s: float
    step_s: float


def strategy_layout(strategy: str, cluster: Cluster) -> Layout:
    """DDP and FSDP over every GPU, HSDP sharded inside each node and replicated across nodes."""
    layouts = {"ddp": Layout(replicate=cluster.gpus), "fsdp": Layout(shard=cluster.gpus),
               "hsdp": Layout(replicate=cluster.nodes, shard=cluster.gpus_per_node)}
    if strategy not in layouts:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    return layouts[strategy]


def link_of(layout: Layout, axis: str, gpus_per_node: int) -> str:
    """"inter" if a group of `axis` holds ranks of two nodes (rank r on node r // gpus_per_node), else "intra"."""
    spans = any(len({rank // gpus_per_node for rank in group}) > 1 for group in layout.groups((axis,)))
    return "inter" if spans else "intra"


def predict_step(strategy: str, layout: Layout, collectives: list[StepCollective], gpus_per_node: int,
                 links: Links, compute: Compute) -> LayoutStep:
    """The step of `collectives` (a step of `layout`, traffic.py) on nodes of `gpus_per_node` GPUs."""
    axes = sorted({c.axis for c in collectives})
    link = {axis: link_of(layout, axis, gpus_per_node) for axis in axes}
    comm = {pass_: max([sum(c.bytes_sent for c in collectives if c.pass_ == pass_ and link[c.axis] == kind)
                        / links.bandwidth(kind) for kind in LINKS])
            for pass_ in PASSES}
    exposed = sum(max(0.0, comm[pass_] - compute.of(pass_)) for pass_ in PASSES)
    optimizer = compute.optimizer_s / layout.shard  # sharded by FSDP and HSDP; DDP's shard axis is 1
    return LayoutStep(strategy, layout, {axis: sum(c.bytes_sent for c in collectives if c.axis == axis)
                                         for axis in axes},
                      link, comm, exposed, compute.forward_s + compute.backward_s + optimizer + exposed)


def predict_layouts(config: TransformerConfig, precision: Precision, cluster: Cluster, links: Links,
                    compute: Compute, gather: Gather = DEFAULT_GATHER,
                    bucket_size_mb: float | None = 25.0) -> dict[str, LayoutStep]:
    """{strategy: its predicted step} on `cluster`: DDPBucketed (buckets of `bucket_size_mb`), our FSDP and HSDP
    (gathering by `gather`), each GPU computing as `compute` measured."""
    steps = {}
    for strategy in STRATEGIES:
        layout = strategy_layout(strategy, cluster)
        collectives = (ddp_collectives(config, precision, cluster.gpus, bucket_size_mb) if strategy == "ddp"
                       else fsdp_collectives(config, precision, layout, gather))
        steps[strategy] = predict_step(strategy, layout, collectives, cluster.gpus_per_node, links, compute)
    return steps


def fastest(steps: dict[str, LayoutStep]) -> str:
    """The strategy of the shortest predicted step (the first of STRATEGIES among equals)."""
    return min(steps, key=lambda strategy: steps[strategy].step_s)
