"""Supernode TP group layout (VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE=1)."""

from __future__ import annotations

import pytest
import torch

from vllm_br.distributed.tp_groups import (
    contiguous_supernodes,
    rank_order,
    tp_groups,
    vllm_tp_groups,
)
from vllm_br.errors import SUPAConfigError


def _hosts(supernode_of_host: list[int], devices_per_host: int) -> list[int]:
    """Supernode of every rank when ranks are numbered host by host."""
    return [s for s in supernode_of_host for _ in range(devices_per_host)]


@pytest.mark.parametrize(
    ("world", "tp", "per_supernode"),
    [(8, 1, 8), (8, 2, 8), (8, 8, 8), (16, 4, 8), (32, 16, 16), (16, 8, 16), (6, 3, 6)],
)
def test_contiguous_supernodes_give_vllms_layout(world, tp, per_supernode):
    supernodes = contiguous_supernodes(world, per_supernode)
    assert rank_order(tp, supernodes) == list(range(world))
    assert tp_groups(tp, supernodes) == vllm_tp_groups(world, tp)


def test_vllm_layout_matches_vllms_reshape():
    # what initialize_model_parallel computes for the TP dimension
    world, tp = 16, 4
    expected = [x.tolist() for x in torch.arange(world).view(-1, tp).unbind(0)]
    assert vllm_tp_groups(world, tp) == expected


def test_hosts_out_of_order_stay_inside_their_supernode():
    # 4 hosts of 8 devices; supernodes {host 0, host 2} and {host 1, host 3}
    supernodes = _hosts([0, 1, 0, 1], 8)
    groups = tp_groups(16, supernodes)
    assert groups == [
        list(range(0, 8)) + list(range(16, 24)),
        list(range(8, 16)) + list(range(24, 32)),
    ]
    # vLLM's layout would straddle both supernodes
    assert {supernodes[r] for r in vllm_tp_groups(32, 16)[0]} == {0, 1}


def test_every_group_is_inside_one_supernode_and_covers_the_world():
    supernodes = _hosts([2, 0, 1, 0, 2, 1], 4)  # 6 hosts of 4, three supernodes of 8
    for tp in (1, 2, 4, 8):
        groups = tp_groups(tp, supernodes)
        assert all(len({supernodes[r] for r in g}) == 1 for g in groups)
        assert all(g == sorted(g) for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(24))
        assert all(len(g) == tp for g in groups)


def test_order_is_a_grid_for_the_other_dimensions():
    # PP/DP groups come from the same order through vLLM's reshape: each
    # PP group takes the same TP position from consecutive TP groups.
    supernodes = _hosts([0, 1, 0, 1], 2)  # 8 ranks, supernodes {0,1,4,5} {2,3,6,7}
    order = torch.tensor(rank_order(2, supernodes))
    grid = order.reshape(-1, 1, 2, 1, 2)  # ExternalDP x DP x PP x PCP x TP
    tp = [x.tolist() for x in grid.view(-1, 2).unbind(0)]
    pp = [x.tolist() for x in grid.transpose(2, 4).reshape(-1, 2).unbind(0)]
    assert tp == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert pp == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize(
    ("tp", "supernodes", "words"),
    [
        (4, contiguous_supernodes(12, 6), "supernode 0 holds 6"),
        (16, contiguous_supernodes(16, 8), "supernode 0 holds 8"),
        (3, contiguous_supernodes(8, 8), "does not divide the world size 8"),
    ],
)
def test_refused_layouts_say_why(tp, supernodes, words):
    with pytest.raises(SUPAConfigError, match=words):
        rank_order(tp, supernodes)


def test_refusal_names_the_variable():
    with pytest.raises(
        SUPAConfigError, match="VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE=1"
    ):
        tp_groups(4, [0, 0, 0, 0, 0, 0, 1, 1])


def test_bad_supernode_size():
    with pytest.raises(ValueError):
        contiguous_supernodes(8, 0)
