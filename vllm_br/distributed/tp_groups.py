"""Tensor-parallel group layout inside supernodes
(``VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE=1``).

A supernode is a set of SUPA devices, possibly on several hosts, joined by the
card-to-card fabric (B-Link) rather than the host network; a TP group, whose
allreduce runs every layer, must not span two of them.

vLLM numbers ranks ExternalDP x DP x PP x PCP x TP (TP innermost) and cuts
``range(world_size)`` into consecutive TP groups. That is right when ranks are
numbered supernode by supernode with a multiple of the TP size in each; it
silently straddles supernodes otherwise (hosts placed out of order, or a
supernode size that TP does not divide).

The layout here: given the supernode of every global rank, the rank order is
each supernode's ranks in ascending order, supernodes ordered by their smallest
rank; consecutive ``tp_size`` entries of that order form a TP group. Every
other group (PP, DP, EP) comes from vLLM's reshape of the same order instead of
``range(world_size)``, so the layout stays a consistent grid. When the
supernodes are already contiguous the order is ``range(world_size)``: exactly
vLLM's layout. A supernode whose rank count TP does not divide is refused.

Example, 4 hosts of 8 devices, supernodes {host 0, host 2} and {host 1, host
3}, TP 16: TP groups are ranks 0-7 + 16-23 and 8-15 + 24-31.

vLLM's executors assume two things of global ranks that a new order must keep
(``fit_engines``): each data-parallel engine spawns its own workers, ranks
d*W .. (d+1)*W - 1 with W = TP x PP x PCP, so with data parallelism no group
may take ranks of two engines (refused); and each engine takes a step's output
from its rank W - TP x PCP, taken to be in the last pipeline stage, so with
PP > 1 the stage holding that rank is moved to the end (stages are whole
slices of the order: the TP groups stay the same). In the example with PP 2,
stage 0 is then ranks 8-15 + 24-31 and stage 1 ranks 0-7 + 16-23; a PP group
then lists a higher rank first, which vLLM's pipeline sends allow (they name
peers by global rank). With PCP > 1 a TP x PCP slice that is not in ascending
rank order is refused: the PCP and EP groups' collectives would misread it.

Wiring (``vllm_br/distributed/supernode_groups.py``, ledger patch
``supernode-tp-groups``): vLLM 0.33's ``initialize_model_parallel`` builds
``torch.arange(world_size)`` inline, with no extension point; the worker wraps
that function so, while the variable is set and the order is not
``range(world_size)``, that one expression yields this order. Every rank's
supernode comes from ``VLLM_BR_SUPERNODE_ID`` on its host (unset: the host
alone), gathered over the world group.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_br.errors import SUPAConfigError


def contiguous_supernodes(world_size: int, ranks_per_supernode: int) -> list[int]:
    """Supernode of each rank when ranks are numbered supernode by supernode."""
    if ranks_per_supernode < 1:
        raise ValueError("ranks_per_supernode must be >= 1")
    return [r // ranks_per_supernode for r in range(world_size)]


def rank_order(tp_size: int, supernode_of_rank: Sequence[int]) -> list[int]:
    """Global ranks in the order vLLM's layout should consume them (see the
    module docstring); ``supernode_of_rank[r]`` is rank r's supernode id."""
    world_size = len(supernode_of_rank)
    if tp_size < 1 or world_size % tp_size:
        raise SUPAConfigError(
            f"--tensor-parallel-size {tp_size} does not divide the world size "
            f"{world_size}."
        )
    members: dict[int, list[int]] = {}
    for rank, node in enumerate(supernode_of_rank):
        members.setdefault(node, []).append(rank)
    for node, ranks in members.items():
        if len(ranks) % tp_size:
            raise SUPAConfigError(
                "VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE=1 needs every supernode to "
                f"hold a multiple of --tensor-parallel-size {tp_size} ranks, but "
                f"supernode {node} holds {len(ranks)}; choose a TP size that "
                "divides it or unset the variable."
            )
    # dicts keep insertion order: supernodes ordered by their smallest rank
    return [rank for ranks in members.values() for rank in ranks]


def tp_groups(tp_size: int, supernode_of_rank: Sequence[int]) -> list[list[int]]:
    """TP groups, each inside one supernode, in ascending rank order."""
    order = rank_order(tp_size, supernode_of_rank)
    return [order[i : i + tp_size] for i in range(0, len(order), tp_size)]


def vllm_tp_groups(world_size: int, tp_size: int) -> list[list[int]]:
    """vLLM's own layout (the variable unset): consecutive ranks."""
    return [list(range(i, i + tp_size)) for i in range(0, world_size, tp_size)]


def fit_engines(
    order: Sequence[int],
    *,
    tp_size: int,
    pp_size: int = 1,
    pcp_size: int = 1,
    dp_size: int = 1,
) -> list[int]:
    """``order`` adjusted to what vLLM's executors and communicators assume of
    global ranks (see the module docstring): with data parallelism a group
    that would take ranks of two engines is refused, with PCP > 1 a TP x PCP
    slice out of rank order is refused, and with PP > 1 each engine's
    pipeline stage that holds its output rank is moved to the end."""
    order = list(order)
    stage = tp_size * pcp_size
    engine = stage * pp_size
    if engine < 1 or len(order) % engine:
        return order  # vLLM's own reshape reports the sizes
    for start in range(0, len(order), engine):
        block = order[start : start + engine]
        stages = [block[i : i + stage] for i in range(0, engine, stage)]
        if pcp_size > 1 and any(s != sorted(s) for s in stages):
            raise SUPAConfigError(
                "VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE=1 would list a "
                "prefill-context-parallel group out of rank order with these "
                "supernodes, so use --prefill-context-parallel-size 1 or unset "
                "the variable."
            )
        if sorted(block) != list(range(start, start + engine)):
            if dp_size > 1:
                raise SUPAConfigError(
                    "VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE=1 would put ranks of "
                    f"two data-parallel engines into one group (ranks {start}-"
                    f"{start + engine - 1} are one engine's workers), so place "
                    "each data-parallel rank's hosts inside one supernode or "
                    "unset the variable."
                )
            continue  # external DP only: no executor output rank to keep
        output = start + engine - stage  # the executor's output rank
        stages.append(stages.pop(block.index(output) // stage))
        order[start : start + engine] = [r for s in stages for r in s]
    return order
