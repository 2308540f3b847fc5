"""Device storage layout of linear weights (``VLLM_BR_WEIGHT_TYPE``).

A BR1xx card with more than 16 SPCs has two dies, two NUMA domains. Its
linear kernels read a weight whose output dimension is split per die: die
``d`` owns a contiguous block of output rows and computes those output
channels from its own memory. When one weight fuses several logical outputs
(QKV, gate/up), each die needs its share of *every* part (half the heads of
q, k and v; half of gate and the matching half of up) so the following
per-die work stays local. So the ``NUMA`` layout is, for a weight of shape
``[N, K]`` whose output rows form logical partitions ``P_0 .. P_m`` (the
layer's ``output_partition_sizes``)::

    device rows = [P_0 chunk 0 | P_1 chunk 0 | ... | P_m chunk 0]   <- die 0
                  [P_0 chunk 1 | P_1 chunk 1 | ... | P_m chunk 1]   <- die 1

each partition cut into ``dies`` equal contiguous chunks. It is a row
permutation (shape and dtype unchanged; identity for a single partition,
whose per-die halves are already contiguous). ``UMA`` is the plain layout,
and so is every layout on one die and on the cpu backend.

The exact physical format is the vendor kernel's; everything about it lives
in :func:`_numa_order`, the single place to change. ``to_device_layout`` and
``from_device_layout`` are exact inverses; the ``linear`` op
(``vllm_br.ops.linear``) computes with the device layout and returns outputs
in logical order, bit for bit the same as ``F.linear`` on the plain weight. A
fused ``linear`` kernel from the device backend takes the same arguments and
reads the layout natively.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

UMA = "UMA"
NUMA = "NUMA"


def _sizes(weight: torch.Tensor, partition_sizes: Sequence[int] | None) -> list[int]:
    sizes = (
        [weight.shape[0]]
        if partition_sizes is None
        else [int(s) for s in partition_sizes]
    )
    if sum(sizes) != weight.shape[0]:
        raise ValueError(
            f"partition sizes {sizes} do not add up to the output dimension "
            f"{weight.shape[0]}"
        )
    return sizes


def numa_supported(partition_sizes: Sequence[int], dies: int) -> bool:
    return dies > 1 and all(s % dies == 0 for s in partition_sizes)


def _numa_order(partition_sizes: Sequence[int], dies: int) -> list[int]:
    """Device row ``i`` holds logical output row ``order[i]``."""
    if not numa_supported(partition_sizes, dies):
        raise ValueError(
            f"NUMA layout on {dies} dies needs every output partition divisible "
            f"by {dies}; got {list(partition_sizes)}"
        )
    starts = [sum(partition_sizes[:p]) for p in range(len(partition_sizes))]
    order: list[int] = []
    for d in range(dies):
        for start, size in zip(starts, partition_sizes, strict=True):
            chunk = size // dies
            order.extend(range(start + d * chunk, start + (d + 1) * chunk))
    return order


def _is_plain(layout: str, dies: int) -> bool:
    if layout not in (UMA, NUMA):
        raise ValueError(f"unknown weight layout {layout!r}; expected NUMA or UMA")
    return layout == UMA or dies <= 1


def _row_order(
    weight: torch.Tensor, layout: str, dies: int, partition_sizes: Sequence[int] | None
) -> torch.Tensor | None:
    """Row permutation logical -> device layout, or None where it is the identity."""
    sizes = _sizes(weight, partition_sizes)
    if _is_plain(layout, dies):
        return None
    return torch.tensor(_numa_order(sizes, dies), device=weight.device)


def to_device_layout(
    weight: torch.Tensor,
    layout: str,
    dies: int,
    partition_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """The tensor to store for a logical ``[N, ...]`` weight (or ``[N]`` bias)."""
    order = _row_order(weight, layout, dies, partition_sizes)
    return weight if order is None else weight.index_select(0, order)


def from_device_layout(
    weight: torch.Tensor,
    layout: str,
    dies: int,
    partition_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """The logical weight back from its device layout (inverse of the above)."""
    order = _row_order(weight, layout, dies, partition_sizes)
    return weight if order is None else weight.index_select(0, torch.argsort(order))


@dataclass(frozen=True, eq=False)
class DeviceLayout:
    """How a layer's weight is stored; ``None`` on a layer means plain."""

    layout: str
    dies: int
    partition_sizes: tuple[int, ...]
    #: device row i holds logical row to_device[i]
    to_device: torch.Tensor
    #: logical row j is device row from_device[j]
    from_device: torch.Tensor

    @classmethod
    def make(
        cls,
        layout: str,
        dies: int,
        partition_sizes: Sequence[int],
        device: torch.device,
    ) -> DeviceLayout | None:
        """The layout for these partitions, or None where it is the plain one."""
        sizes = tuple(int(s) for s in partition_sizes)
        if _is_plain(layout, dies) or not numa_supported(sizes, dies):
            return None
        order = _numa_order(sizes, dies)
        if order == list(range(len(order))):
            return None
        to_device = torch.tensor(order, device=device)
        return cls(layout, dies, sizes, to_device, torch.argsort(to_device))


def current_layout() -> tuple[str, int]:
    """(layout, dies) for weights on this process's device."""
    from vllm_br import envs
    from vllm_br.device import get_backend

    backend = get_backend()
    if not backend.numa_weight_layout:
        return UMA, 1
    dies = backend.topology().dies_per_device
    return envs.VLLM_BR_WEIGHT_TYPE, (dies[0] if dies else 1)
