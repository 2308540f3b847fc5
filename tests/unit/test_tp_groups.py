"""Supernode TP group layout (VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE=1)."""

from __future__ import annotations

import pytest
import torch

from vllm_br.distributed.tp_groups import (
    contiguous_supernodes,
    fit_engines,
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


# ---- fit_engines: what vLLM's executors assume of global ranks ----------------
def _stages(order: list[int], stage: int) -> list[list[int]]:
    return [order[i : i + stage] for i in range(0, len(order), stage)]


def test_pp_moves_the_stage_with_the_output_rank_last():
    # the module docstring's example with PP 2: the executor reads rank 32 - 16
    supernodes = _hosts([0, 1, 0, 1], 8)
    order = rank_order(16, supernodes)
    fitted = fit_engines(order, tp_size=16, pp_size=2)
    assert _stages(fitted, 16) == [
        list(range(8, 16)) + list(range(24, 32)),
        list(range(0, 8)) + list(range(16, 24)),
    ]
    assert 16 in fitted[-16:]
    # the TP groups are the same ones
    assert sorted(_stages(fitted, 16)) == sorted(_stages(order, 16))


@pytest.mark.parametrize(
    ("tp", "pp", "supernodes"),
    [
        (16, 2, contiguous_supernodes(32, 16)),  # vLLM's layout: already last
        (2, 1, _hosts([0, 1, 0, 1], 2)),  # PP 1: nothing to move
        (2, 2, [0, 0, 1, 1, 1, 1, 0, 0]),  # output rank 4 is in the last stage
    ],
)
def test_orders_that_already_fit_are_kept(tp, pp, supernodes):
    order = rank_order(tp, supernodes)
    assert fit_engines(order, tp_size=tp, pp_size=pp) == order


def test_data_parallel_engines_keep_their_own_ranks():
    # DP 2 of TP 2 x PP 2: each engine's 4 ranks inside its own supernodes
    supernodes = [0, 1, 0, 1, 2, 3, 2, 3]
    order = rank_order(2, supernodes)
    assert order == [0, 2, 1, 3, 4, 6, 5, 7]
    fitted = fit_engines(order, tp_size=2, pp_size=2, dp_size=2)
    assert fitted == [1, 3, 0, 2, 5, 7, 4, 6]
    grid = torch.tensor(fitted).reshape(-1, 2, 2, 1, 2)  # ExtDP x DP x PP x PCP x TP
    dp = [x.tolist() for x in grid.transpose(1, 4).reshape(-1, 2).unbind(0)]
    assert sorted(dp) == [[0, 4], [1, 5], [2, 6], [3, 7]]  # each engine the same slot


def test_a_group_across_data_parallel_engines_is_refused():
    order = rank_order(2, [0, 1, 0, 1])  # [0, 2, 1, 3]: engine 0 is ranks 0, 1
    with pytest.raises(SUPAConfigError) as e:
        fit_engines(order, tp_size=2, dp_size=2)
    msg = str(e.value)
    assert "two data-parallel engines" in msg and "ranks 0-1" in msg
    assert "VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE=1" in msg
    assert msg.endswith(".") and ". " not in msg
    # without vLLM's DP (external DP replicas) there is no engine to keep
    assert fit_engines(order, tp_size=2) == order


def test_pcp_slice_out_of_rank_order_is_refused():
    supernodes = _hosts([0, 1, 0, 1, 0, 1], 2)  # 12 ranks, two supernodes of 6
    order = rank_order(2, supernodes)
    assert _stages(order, 4)[1] == [8, 9, 2, 3]
    with pytest.raises(SUPAConfigError, match="--prefill-context-parallel-size 1"):
        fit_engines(order, tp_size=2, pcp_size=2)
    # a TP x PCP slice in rank order is served
    ok = rank_order(2, _hosts([0, 1, 0, 1], 2))  # [0, 1, 4, 5, 2, 3, 6, 7]
    assert fit_engines(ok, tp_size=2, pcp_size=2) == ok


def test_sizes_vllm_refuses_are_left_to_vllm():
    assert fit_engines([0, 2, 1, 3], tp_size=2, pp_size=3) == [0, 2, 1, 3]
