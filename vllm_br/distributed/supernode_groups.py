"""TP groups inside supernodes, wired into vLLM's group creation (ledger patch
``supernode-tp-groups``; the layout itself: ``vllm_br/distributed/tp_groups.py``).

With ``VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE=1``, when vLLM creates its model
parallel groups every rank sends its supernode id (``VLLM_BR_SUPERNODE_ID`` on
its host; unset, the host is its own supernode, named by its hostname and IP)
to every other over the world group's gloo group. The ids become ints in
first-seen order; ``rank_order`` and ``fit_engines`` give the rank order. When
it is ``range(world_size)`` vLLM runs untouched. Otherwise the one expression
vLLM 0.33's ``initialize_model_parallel`` builds its grid from,
``torch.arange(world_size)``, yields that order for that one call: the
module's ``torch`` name is a stand-in that passes every other attribute and
call through, put back when the function returns. TP, PP, DP, PCP and EP
groups all come from vLLM's reshape of it, so the layout stays a grid.

Installed by ``SUPAWorker.init_device`` before vLLM's distributed set-up;
with the variable unset the wrapper only calls vLLM's function.
"""

from __future__ import annotations

import functools
import inspect
import socket
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

from vllm_br.distributed.tp_groups import fit_engines, rank_order
from vllm_br.errors import SUPAConfigError
from vllm_br.logger import init_logger

logger = init_logger(__name__)

SUPERNODE_ID_VAR = "VLLM_BR_SUPERNODE_ID"
ENABLE_VAR = "VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE"


def enabled() -> bool:
    from vllm_br import envs

    return bool(envs.VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE)


def supernode_id() -> str:
    """This host's supernode: ``VLLM_BR_SUPERNODE_ID``, else the host itself."""
    from vllm_br import envs

    raw = envs.VLLM_BR_SUPERNODE_ID
    if raw is not None:
        return raw
    from vllm.utils.network_utils import get_ip

    return f"host {socket.gethostname()} {get_ip()}"


def supernode_indices(ids: Sequence[Hashable]) -> list[int]:
    """Each rank's supernode id as an int, numbered in first-seen order."""
    index: dict[Hashable, int] = {}
    return [index.setdefault(i, len(index)) for i in ids]


def layout(
    ids: Sequence[Hashable],
    *,
    tp_size: int,
    pp_size: int = 1,
    pcp_size: int = 1,
    dp_size: int = 1,
) -> list[int]:
    """The global rank order for every rank's supernode id (SUPAConfigError
    for a layout that cannot be served)."""
    order = rank_order(tp_size, supernode_indices(ids))
    return fit_engines(
        order, tp_size=tp_size, pp_size=pp_size, pcp_size=pcp_size, dp_size=dp_size
    )


def gather_supernode_ids(cpu_group: Any) -> list[str]:
    """Every rank's supernode id (collective over ``cpu_group``)."""
    import torch.distributed as dist

    ids: list[Any] = [None] * dist.get_world_size(cpu_group)
    dist.all_gather_object(ids, supernode_id(), group=cpu_group)
    return ids


class _ArangeOnce:
    """Stands in for the ``torch`` module: the first ``arange(world_size)``
    returns ``order``; everything else is torch's."""

    def __init__(self, world_size: int, order: Sequence[int]):
        self._world_size = world_size
        self._order = list(order)
        self.used = False

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def arange(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if (
            not self.used
            and not kwargs
            and len(args) == 1
            and type(args[0]) is int
            and args[0] == self._world_size
        ):
            self.used = True
            return torch.tensor(self._order, dtype=torch.long)
        return torch.arange(*args, **kwargs)


@contextmanager
def arange_yields(
    module: ModuleType, world_size: int, order: Sequence[int]
) -> Iterator[_ArangeOnce]:
    """While inside, ``module``'s first ``torch.arange(world_size)`` returns
    ``order``; ``module.torch`` is put back on exit."""
    saved = module.torch
    stand_in = _ArangeOnce(world_size, order)
    module.torch = stand_in  # type: ignore[attr-defined]
    try:
        yield stand_in
    finally:
        module.torch = saved  # type: ignore[attr-defined]


def _log_groups(ids: Sequence[str], order: Sequence[int], tp_size: int) -> None:
    names = list(dict.fromkeys(ids))
    groups = [list(order[i : i + tp_size]) for i in range(0, len(order), tp_size)]
    logger.info(
        "%s=1: %d supernode(s) (%s); TP groups %s%s.",
        ENABLE_VAR,
        len(names),
        ", ".join(names),
        groups,
        " (vLLM's own layout)" if list(order) == list(range(len(order))) else "",
    )


def wrap(original: Callable[..., None]) -> Callable[..., None]:
    """vLLM's ``initialize_model_parallel`` laid out inside supernodes."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize_model_parallel(*args: Any, **kwargs: Any) -> None:
        if not enabled():
            return original(*args, **kwargs)
        from vllm.config import get_current_vllm_config
        from vllm.distributed import parallel_state

        parallel_config = get_current_vllm_config().parallel_config
        if parallel_config.enable_elastic_ep:
            raise SUPAConfigError(
                f"{ENABLE_VAR}=1 cannot lay out elastic expert parallelism's "
                "groups, so drop --enable-elastic-ep or unset the variable."
            )
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        sizes = bound.arguments
        tp_size = sizes["tensor_model_parallel_size"]
        world = parallel_state.get_world_group()
        ids = gather_supernode_ids(world.cpu_group)
        order = layout(
            ids,
            tp_size=tp_size,
            pp_size=sizes["pipeline_model_parallel_size"],
            pcp_size=sizes["prefill_context_model_parallel_size"],
            dp_size=parallel_config.data_parallel_size,
        )
        if order == list(range(len(order))):
            original(*args, **kwargs)
        else:
            with arange_yields(parallel_state, len(order), order) as stand_in:
                original(*args, **kwargs)
            if not stand_in.used:
                raise RuntimeError(
                    "vLLM's initialize_model_parallel no longer builds "
                    "torch.arange(world_size), so the supernode-tp-groups patch "
                    "could not apply its rank order."
                )
        if world.rank == 0:
            _log_groups(ids, order, tp_size)

    initialize_model_parallel._vllm_br = True  # type: ignore[attr-defined]
    return initialize_model_parallel


def install() -> None:
    """Wrap ``vllm.distributed.parallel_state.initialize_model_parallel``
    (idempotent); ``ensure_model_parallel_initialized`` calls it from there."""
    from vllm.distributed import parallel_state

    current = parallel_state.initialize_model_parallel
    if getattr(current, "_vllm_br", False):
        return
    parallel_state.initialize_model_parallel = wrap(current)


def uninstall() -> None:
    from vllm.distributed import parallel_state

    current = parallel_state.initialize_model_parallel
    if getattr(current, "_vllm_br", False):
        parallel_state.initialize_model_parallel = current.__wrapped__
