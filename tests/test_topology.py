"""The topology's rank layout: replicas of cp * tp ranks, tp innermost, and the groups over it."""

from __future__ import annotations

import pytest

from graphc.errors import GraphcError
from graphc.topology import Topology


def test_tp_is_innermost_and_cp_groups_stride_over_it():
    topology = Topology(cp=2, ep=4, dp=2, tp=2)  # 8 ranks: 2 replicas of 2 cp x 2 tp
    assert topology.world == 8 and topology.replica == 4
    assert topology.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topology.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topology.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [(topology.dp_rank(r), topology.cp_rank(r), topology.tp_rank(r)) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert [topology.replica_leader(r) for r in range(2)] == [0, 4]
    # Only the replica's first rank samples; the tp coordinate is no input (the weights are the shard).
    assert [topology.coordinates(r) for r in (0, 1, 2, 5)] == [[0, 0, 1], [0, 1, 0], [1, 2, 0], [0, 1, 0]]
    assert topology.tokens_replicated  # an EP group of 4 is one replica


def test_every_rank_lies_in_one_group_of_each_name_and_groups_meet_in_one_rank():
    topology = Topology(cp=2, ep=2, dp=1, tp=4)
    for name in ("cp", "tp", "ep"):
        ranks = sorted(r for group in topology.groups(name) for r in group)
        assert ranks == list(range(topology.world)), name
    for cp_group in topology.groups("cp"):
        for tp_group in topology.groups("tp"):
            assert len(set(cp_group) & set(tp_group)) == 1


def test_weight_shards_pair_the_expert_and_tensor_parallel_ranks():
    topology = Topology(cp=1, ep=2, dp=2, tp=2)  # EP groups span the tp pair of one replica
    assert [topology.weight_shard(r) for r in range(4)] == [(0, 0), (1, 1), (0, 0), (1, 1)]
    assert Topology(cp=1, ep=4, dp=2, tp=2).tokens_replicated is False  # ep 4 over two replicas of 2


def test_ep_divides_the_world_of_dp_cp_and_tp():
    with pytest.raises(GraphcError, match=r"^topology\.ep: 4 must divide the world size \(dp \* cp \* tp = 6\)"):
        Topology(cp=1, ep=4, dp=3, tp=2)
