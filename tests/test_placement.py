"""Ranks onto Ray's placement bundles: every tensor-parallel group (and every colocated vLLM engine) on one
node, whatever order Ray reserved the bundles in (``trainer.group.ranks_to_bundles``)."""

from __future__ import annotations

import random

import pytest

from megareason.config import ConfigError
from megareason.trainer.group import ranks_to_bundles


def _assert_groups_on_one_node(bundle_nodes: list[str], block: int, bundles: list[int]) -> None:
    assert sorted(bundles) == list(range(len(bundle_nodes))), bundles  # every bundle used once
    for g in range(0, len(bundles), block):
        group = bundles[g:g + block]
        assert len({bundle_nodes[b] for b in group}) == 1, (g // block, [bundle_nodes[b] for b in group])


# Hand-written bundle -> node maps: Ray reserves a PACK group's equal bundles in no fixed order
# (ray-project/ray#51117 shows a 64-GPU group's bundle indices interleaved over its 8 nodes).
SCRAMBLED = {
    "alternating": list("ABABABAB"),
    "halves swapped": list("BBBBAAAA"),
    "outer and inner": list("AABBBBAA"),
    "three nodes": list("CABCABCABCAB"),
    "two per node, interleaved": list("ABCDDCBA"),
}


@pytest.mark.parametrize(("name", "block"), [(name, block) for name, nodes in SCRAMBLED.items() for block in (1, 2, 4)
                                             if all(nodes.count(n) % block == 0 for n in nodes)])
def test_scrambled_bundles_give_each_group_one_node(name, block):
    nodes = SCRAMBLED[name]
    _assert_groups_on_one_node(nodes, block, ranks_to_bundles(nodes, block, "parallel.tensor_model_parallel_size=2"))


def test_a_64_gpu_group_scrambled_over_8_nodes_keeps_tp8_on_one_node():
    nodes = [f"node{i // 8}" for i in range(64)]
    random.Random(51117).shuffle(nodes)
    bundles = ranks_to_bundles(nodes, 8, "parallel.tensor_model_parallel_size=8")
    _assert_groups_on_one_node(nodes, 8, bundles)
    assert bundles[0] == 0  # rank 0 stays in bundle 0 (the node Ray put first)
    assert ranks_to_bundles(["n"] * 8, 8, "x") == list(range(8))  # one node: the identity


def test_a_node_that_cannot_hold_whole_groups_is_refused_naming_the_fields():
    what = "parallel.tensor_model_parallel_size=2 with rollout.tensor_parallel_size=4"
    with pytest.raises(ConfigError, match=r"rollout\.tensor_parallel_size=4.*multiple of 4 GPUs"):
        ranks_to_bundles(list("AAAAAABB"), 4, what)
    assert len(ranks_to_bundles(list("AAAAAABB"), 2, what)) == 8  # groups of 2 fit 6 + 2


def test_ray_places_each_tp4_group_on_one_of_two_fake_nodes(monkeypatch):
    """A real Ray cluster of two loopback nodes of 4 logical GPUs each, made to reserve the 8 bundles
    alternately on its two nodes (the order #51117 reports, forced here with node labels): each rank's
    bundle, as ``WorkerGroup`` schedules it, is on the node of its TP-4 group; TP 8 is refused."""
    import sys

    import ray
    import ray._private.ray_constants as ray_constants
    from ray.cluster_utils import Cluster

    from megareason.trainer.group import rank_placement

    # Ray resolves a loopback address to the machine's own IP (services.resolve_ip_for_localhost) unless
    # it runs as a single-machine cluster; the nodes here listen on 127.0.0.1 only.
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    pg_module = sys.modules["ray.util.placement_group"]
    plain = pg_module.placement_group

    def alternating(bundles, strategy):
        return plain(bundles, strategy=strategy,
                     bundle_label_selector=[{"fake-node": "ab"[i % 2]} for i in range(len(bundles))])

    monkeypatch.setattr(pg_module, "placement_group", alternating)
    node = {"num_cpus": 1, "num_gpus": 4, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args=dict(node, labels={"fake-node": "a"}))
    try:
        cluster.add_node(**node, labels={"fake-node": "b"})
        ray.init(address=cluster.address, include_dashboard=False, configure_logging=False, log_to_driver=False)

        @ray.remote(num_cpus=0, num_gpus=1)
        def node_id() -> str:
            return ray.get_runtime_context().get_node_id()

        placement = rank_placement(8, gpus=True, block=4, what="parallel.tensor_model_parallel_size=4")
        table = pg_module.placement_group_table(placement.pg)["bundles_to_node_id"]
        assert table[0] != table[1]  # Ray did scramble them: rank i in bundle i would split every group
        nodes = ray.get([node_id.options(scheduling_strategy=placement.strategy(r)).remote() for r in range(8)])
        assert sorted(placement.bundles) == list(range(8))
        assert len(set(nodes[:4])) == 1 and len(set(nodes[4:])) == 1 and nodes[0] != nodes[4], nodes
        ray.util.remove_placement_group(placement.pg)  # the cluster holds one group of 8 at a time
        with pytest.raises(ConfigError, match="parallel.tensor_model_parallel_size=8"):
            rank_placement(8, gpus=True, block=8, what="parallel.tensor_model_parallel_size=8")
    finally:
        ray.shutdown()
        cluster.shutdown()
