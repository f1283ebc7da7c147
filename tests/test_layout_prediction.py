"""systems.accounting.layouts: which layout wins on a cluster, with hand-worked numbers; and the step collectives
of DDPBucketed (systems.accounting.traffic.ddp_collectives), bucket by bucket by hand.

The model by hand: one block, d_model 8, 2 heads, d_ff 16, vocabulary 100. Sharded weights: embedding and LM head
800 each, the block's qkv 192, out 64, w1, w3, w2 128 each (640 in the block); replicated: two norm gains of the
block and the final one, 24; 2264 parameters. fp32, a collective per block.
"""

from __future__ import annotations

import math

import pytest

from systems.accounting import count_parameters
from systems.accounting.layouts import (Cluster, Compute, Links, LayoutStep, fastest, link_of, predict_layouts,
                                        strategy_layout)
from systems.accounting.traffic import ddp_collectives
from systems.levers.layout import Layout
from systems.model import get_config
from systems.precision import PRECISIONS

MODEL = get_config("tiny", vocab_size=100, d_model=8, num_heads=2, d_ff=16, num_layers=1, context_length=16)
FP32 = PRECISIONS["fp32"]
LINKS = Links(intra_bandwidth=1000.0, inter_bandwidth=100.0)  # bytes/s: round numbers for the hand
COMPUTE = Compute(forward_s=10.0, backward_s=20.0, optimizer_s=4.0)


def test_the_hand_model_has_the_parameters_the_docstring_counts():
    assert count_parameters(MODEL) == 2264


def test_two_nodes_of_two_gpus_by_hand():
    """2 nodes x 2 GPUs (ranks 0, 1 on node 0; 2, 3 on node 1).

    DDP, 4 x 1: one bucket of 2264 all-reduced over 4 ranks, across nodes: 2 x 3 x 566 x 4 = 13584 bytes, backward:
    135.84 s against 20 s of backward, 115.84 exposed; step 10 + 20 + 4 + 115.84.
    FSDP, 1 x 4, across nodes: chunks of ceil(n / 4): embedding 200, block 48 + 16 + 3 x 32 = 160, head 200 (560).
    Forward gathers 3 x 560 x 4 = 6720 bytes: 67.2 s, 57.2 exposed; backward gathers all but the embedding,
    3 x 360 x 4 = 4320, reduce-scatters 6720, all-reduces the gains 2 x 3 x 6 x 4 = 144: 11184 bytes, 111.84 s,
    91.84 exposed; the optimizer steps a quarter, 1 s; step 10 + 20 + 1 + 57.2 + 91.84.
    HSDP, 2 x 2: shards inside a node, chunks of ceil(n / 2): 400 + 320 + 400 = 1120. Forward gathers 1120 x 4 =
    4480 bytes intra-node: 4.48 s, hidden. Backward: intra, gathers 720 x 4 = 2880, reduce-scatters 4480, gains
    2 x 12 x 4 = 96: 7456 bytes, 7.456 s; inter, each group's chunks all-reduced over the 2 replicas,
    2 x 1120 / 2 x 4 = 4480, and the gains 96: 4576 bytes, 45.76 s, the busier link: 25.76 exposed; the
    optimizer steps half, 2 s; step 10 + 20 + 2 + 25.76."""
    steps = predict_layouts(MODEL, FP32, Cluster(nodes=2, gpus_per_node=2), LINKS, COMPUTE, gather="block",
                            bucket_size_mb=None)
    ddp, fsdp, hsdp = steps["ddp"], steps["fsdp"], steps["hsdp"]
    assert (ddp.layout, fsdp.layout, hsdp.layout) == (Layout(replicate=4), Layout(shard=4), Layout(2, 2))
    assert (ddp.sent, ddp.links) == ({"replicate": 13584}, {"replicate": "inter"})
    assert ddp.comm_s == {"forward": 0.0, "backward": pytest.approx(135.84)}
    assert ddp.step_s == pytest.approx(10 + 20 + 4 + 115.84)
    assert (fsdp.sent, fsdp.links) == ({"shard": 6720 + 11184}, {"shard": "inter"})
    assert fsdp.comm_s == {"forward": pytest.approx(67.2), "backward": pytest.approx(111.84)}
    assert fsdp.step_s == pytest.approx(10 + 20 + 1 + 57.2 + 91.84)
    assert hsdp.sent == {"shard": 4480 + 7456, "replicate": 4576}
    assert hsdp.links == {"shard": "intra", "replicate": "inter"}
    assert hsdp.comm_s == {"forward": pytest.approx(4.48), "backward": pytest.approx(45.76)}
    assert hsdp.exposed_s == pytest.approx(25.76)
    assert hsdp.step_s == pytest.approx(10 + 20 + 2 + 25.76)
    assert fastest(steps) == "hsdp"


def test_on_one_node_every_axis_is_intra_node_and_hsdp_is_fsdp():
    """1 node of 4 GPUs: DDP's 13584 bytes at 1000 B/s, 13.584 s, hidden behind the 20 s backward; FSDP's
    forward 6.72 s and backward 11.184 s hidden too, and its optimizer a quarter: it wins, 31 s to DDP's 34."""
    steps = predict_layouts(MODEL, FP32, Cluster(nodes=1, gpus_per_node=4), LINKS, COMPUTE, gather="block",
                            bucket_size_mb=None)
    assert steps["hsdp"].layout == steps["fsdp"].layout == Layout(shard=4)
    assert steps["hsdp"] == LayoutStep(**{**steps["fsdp"].__dict__, "strategy": "hsdp"})
    assert all(link == "intra" for step in steps.values() for link in step.links.values())
    assert steps["ddp"].step_s == pytest.approx(34.0) and steps["fsdp"].step_s == pytest.approx(31.0)
    assert fastest(steps) == "fsdp"


def test_a_fast_enough_inter_node_link_hides_everything_and_sharding_wins_by_its_optimizer():
    """At 1e9 B/s everywhere no pass's communication outlasts its compute: the steps differ only by the optimizer,
    4 s for DDP, 4/64 for FSDP over 64 GPUs, 4/8 for HSDP's 8 shards."""
    steps = predict_layouts(MODEL, FP32, Cluster(nodes=8, gpus_per_node=8), Links(1e9, 1e9), COMPUTE,
                            gather="block", bucket_size_mb=None)
    assert {name: step.exposed_s for name, step in steps.items()} == {"ddp": 0.0, "fsdp": 0.0, "hsdp": 0.0}
    assert steps["ddp"].step_s == 34.0 and steps["fsdp"].step_s == 30 + 4 / 64 and steps["hsdp"].step_s == 30.5


@pytest.mark.parametrize("layout, axis, gpus_per_node, link", [
    (Layout(2, 2), "shard", 2, "intra"), (Layout(2, 2), "replicate", 2, "inter"),
    (Layout(2, 2), "replicate", 4, "intra"), (Layout(shard=4), "shard", 2, "inter"),
    (Layout(4, 2), "replicate", 4, "inter"),  # groups (0, 2, 4, 6): two of node 0, two of node 1
])
def test_an_axis_crosses_nodes_where_one_of_its_groups_holds_ranks_of_two(layout, axis, gpus_per_node, link):
    assert link_of(layout, axis, gpus_per_node) == link


def test_strategies_lay_out_a_cluster_and_refuse_unknown_names():
    cluster = Cluster(nodes=8, gpus_per_node=8)
    assert [strategy_layout(s, cluster) for s in ("ddp", "fsdp", "hsdp")] == [
        Layout(replicate=64), Layout(shard=64), Layout(replicate=8, shard=8)]
    with pytest.raises(ValueError, match="unknown strategy 'tp'"):
        strategy_layout("tp", cluster)


@pytest.mark.parametrize("build", [lambda: Links(0.0, 1.0), lambda: Links(1.0, float("inf")),
                                   lambda: Compute(-1.0, 1.0, 1.0), lambda: Cluster(0, 8), lambda: Cluster(2, 1.5)])
def test_inputs_are_checked_when_made(build):
    with pytest.raises((ValueError, TypeError)):
        build()


@pytest.mark.parametrize("bucket_size_mb, buckets", [
    (None, [2264]),
    # 4194.3 bytes, 1048.6 elements: head 800 and the final gain 8, w2 128 (936; w3 would make 1064); w3, w1
    # 128 each, the gain 8, out 64, qkv 192, the gain 8 (528); the embedding 800.
    (0.004, [936, 528, 800]),
    # 262.1 elements: the head alone, bigger than a bucket; gain + w2 (136); w3 + w1 (256); gain + out (72);
    # qkv + gain (200); the embedding.
    (0.001, [800, 136, 256, 72, 200, 800]),
])
def test_ddp_collectives_are_ddp_bucketeds_buckets_by_hand(bucket_size_mb, buckets):
    """DDPBucketed fills buckets with the parameters last first (lm_head, final_norm, the block's w2, w3, w1,
    ffn_norm, out, qkv, attn_norm, the embedding), up to the bucket size; one all-reduce each, 2 (n - 1)
    ceil(m / n) x 4 bytes over n = 4 ranks."""
    collectives = ddp_collectives(MODEL, FP32, 4, bucket_size_mb)
    assert [c.numel for c in collectives] == buckets
    assert [c.bytes_sent for c in collectives] == [2 * 3 * math.ceil(m / 4) * 4 for m in buckets]
    assert {(c.axis, c.kind, c.pass_, c.ranks) for c in collectives} == {("replicate", "all_reduce", "backward", 4)}
    assert ddp_collectives(MODEL, FP32, 1, bucket_size_mb) == []
