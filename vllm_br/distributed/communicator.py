"""SUPACommunicator: vLLM's device communicator on SUPA devices.

vLLM builds one per group of more than one rank, next to a gloo ``cpu_group``
and a ``device_group`` on the platform's distributed backend (``sccl`` on a
card, ``gloo`` on the cpu backend, where tensors already live on the host).

- On a card the tensor collectives go through SCCL's own communicator
  (``vllm_br.device.sccl``, one per group, its unique id sent over the gloo
  group), as vLLM's CUDA communicator uses pynccl; dtypes SCCL lacks (64-bit
  integers) and ``gather`` use ``torch.distributed`` on the device group.
- On the cpu backend every collective is ``torch.distributed`` on the gloo
  device group.

The allreduce strategy (``allreduce.startup_decision``) is applied in
``all_reduce``: host reduce over the gloo group, and float32 reduction of
bfloat16 tensors. Expert parallelism uses vLLM's all-gather/reduce-scatter
all2all manager, as vLLM's CPU communicator does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from vllm.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)

from vllm_br.device import get_backend, sccl
from vllm_br.distributed.allreduce import AllReduceDecision, startup_decision
from vllm_br.logger import init_logger

logger = init_logger(__name__)

#: dtypes VLLM_BR_USE_FP32_ALL_REDUCE reduces in float32
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class SUPACommunicator(DeviceCommunicatorBase):
    def __init__(
        self,
        cpu_group: ProcessGroup,
        device: torch.device | None = None,
        device_group: ProcessGroup | None = None,
        unique_name: str = "",
        use_all2all: bool = False,
    ):
        super().__init__(
            cpu_group, device, device_group, unique_name, use_all2all=use_all2all
        )
        backend = get_backend()
        if backend.torch_device_type == "cpu":
            # vLLM names the device "cpu:<local rank>"; on the host it is the CPU.
            self.device = torch.device("cpu")
        self.strategy: AllReduceDecision = startup_decision()
        self.sccl = self._init_sccl() if backend.uses_sccl else None
        if self.use_all2all:
            self.all2all_manager = _all2all_manager(
                self.cpu_group, self.all2all_backend
            )

    def _init_sccl(self) -> sccl.SCCLComm:
        # The library loads here (not on import): a missing one stops start-up.
        lib = sccl.load()
        uid = [lib.unique_id() if self.rank_in_group == 0 else None]
        dist.broadcast_object_list(uid, src=self.ranks[0], group=self.cpu_group)
        comm = sccl.SCCLComm(lib, self.world_size, self.rank_in_group, uid[0])
        logger.info("SCCL communicator for %s from %s.", self.unique_name, lib.path)
        return comm

    # ---- transport: SCCL when it takes the dtype, else torch.distributed --
    def _stream(self):
        return get_backend().current_stream()

    def _use_sccl(self, t: torch.Tensor) -> bool:
        return self.sccl is not None and sccl.supports(t.dtype)

    def _reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` (contiguous) in place across the group."""
        if self._use_sccl(t):
            self.sccl.all_reduce(t, t, stream=self._stream())
        else:
            dist.all_reduce(t, group=self.device_group)

    def _gather_into(self, out: torch.Tensor, t: torch.Tensor) -> None:
        if self._use_sccl(t):
            self.sccl.all_gather(out, t, stream=self._stream())
        else:
            dist.all_gather_into_tensor(out, t, group=self.device_group)

    def _reduce_scatter_into(self, out: torch.Tensor, t: torch.Tensor) -> None:
        if self._use_sccl(t):
            self.sccl.reduce_scatter(out, t, stream=self._stream())
        else:
            dist.reduce_scatter_tensor(out, t, group=self.device_group)

    # ---- collectives ---------------------------------------------------------
    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        # In place, as vLLM's base communicator, and returned.
        upcast = self.strategy.fp32_reduce and input_.dtype in _LOW_PRECISION
        if self.strategy.host_reduce:
            work = input_.to(
                "cpu", torch.float32 if upcast else input_.dtype
            ).contiguous()
            dist.all_reduce(work, group=self.cpu_group)
        else:
            work = input_.float() if upcast else input_.contiguous()
            self._reduce(work)
        if work is not input_:
            input_.copy_(work)
        return input_

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if dim < 0:
            dim += input_.dim()
        input_ = input_.contiguous()
        size = input_.size()
        out = torch.empty(
            (size[0] * self.world_size,) + size[1:],
            dtype=input_.dtype,
            device=input_.device,
        )
        self._gather_into(out, input_)
        # [world * d0, ...] -> concatenated along dim
        out = out.reshape((self.world_size,) + size).movedim(0, dim)
        return out.reshape(
            size[:dim] + (self.world_size * size[dim],) + size[dim + 1 :]
        )

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return input_
        if dim < 0:
            dim += input_.dim()
        # Scatter along dim: bring it to the front (vLLM's base moves dim 0
        # to dim instead, which is only the same for 2-D tensors).
        moved = input_.movedim(dim, 0).contiguous()
        assert moved.shape[0] % self.world_size == 0, (
            f"reduce_scatter: dim {dim} of {tuple(input_.shape)} is not a multiple of {self.world_size}"
        )
        out = torch.empty(
            (moved.shape[0] // self.world_size,) + moved.shape[1:],
            dtype=moved.dtype,
            device=moved.device,
        )
        self._reduce_scatter_into(out, moved)
        return out.movedim(0, dim).contiguous()

    def all_gatherv(
        self,
        input_: torch.Tensor | list[torch.Tensor],
        dim: int = 0,
        sizes: list[int] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        if dim != 0:
            raise NotImplementedError("only dim 0 all-gatherv is supported")
        if isinstance(input_, torch.Tensor):
            return self._all_gatherv(input_, sizes)
        return [self._all_gatherv(t, sizes) for t in input_]

    def _all_gatherv(self, t: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
        if sizes is None or all(s == sizes[0] for s in sizes):
            return self.all_gather(t, 0)
        assert len(sizes) == self.world_size and t.shape[0] == sizes[self.rank_in_group]
        # Pad every rank to the largest size, gather, drop the padding.
        longest = max(sizes)
        padded = t.new_zeros((longest,) + t.shape[1:])
        padded[: t.shape[0]] = t
        parts = self.all_gather(padded, 0).reshape(
            (self.world_size, longest) + t.shape[1:]
        )
        return torch.cat([parts[r, :n] for r, n in enumerate(sizes)])

    def reduce_scatterv(
        self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
    ) -> torch.Tensor:
        if sizes is None or all(s == sizes[0] for s in sizes):
            return self.reduce_scatter(input_, dim)
        if dim < 0:
            dim += input_.dim()
        assert len(sizes) == self.world_size and input_.shape[dim] == sum(sizes)
        # Unequal chunks: reduce everything, keep this rank's slice.
        work = input_.contiguous().clone()
        self._reduce(work)
        start = sum(sizes[: self.rank_in_group])
        return work.narrow(dim, start, sizes[self.rank_in_group]).contiguous()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        if self._use_sccl(tensor) and tensor.is_contiguous():
            self.sccl.broadcast(tensor, src, stream=self._stream())
            return tensor
        return super().broadcast(tensor, src)

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        if dst is None:
            dst = (self.rank_in_group + 1) % self.world_size
        if self._use_sccl(tensor):
            self.sccl.send(tensor.contiguous(), dst, stream=self._stream())
        else:
            dist.send(tensor.contiguous(), self.ranks[dst], self.device_group)

    def recv(
        self, size: torch.Size, dtype: torch.dtype, src: int | None = None
    ) -> torch.Tensor:
        if src is None:
            src = (self.rank_in_group - 1) % self.world_size
        tensor = torch.empty(size, dtype=dtype, device=self.device)
        if self._use_sccl(tensor):
            self.sccl.recv(tensor, src, stream=self._stream())
        else:
            dist.recv(tensor, self.ranks[src], self.device_group)
        return tensor

    # ---- expert parallelism: vLLM's all-gather / reduce-scatter manager ----
    def dispatch_router_logits(
        self,
        hidden_states,
        router_logits,
        is_sequence_parallel=False,
        extra_tensors=None,
    ):
        if self.all2all_manager is None:
            return super().dispatch_router_logits(
                hidden_states, router_logits, is_sequence_parallel, extra_tensors
            )
        return self.all2all_manager.dispatch_router_logits(
            hidden_states, router_logits, is_sequence_parallel, extra_tensors
        )

    def dispatch(
        self,
        hidden_states,
        topk_weights,
        topk_ids,
        is_sequence_parallel=False,
        extra_tensors=None,
    ):
        if self.all2all_manager is None:
            return super().dispatch(
                hidden_states,
                topk_weights,
                topk_ids,
                is_sequence_parallel,
                extra_tensors,
            )
        return self.all2all_manager.dispatch(
            hidden_states,
            topk_weights,
            topk_ids,
            is_sequence_parallel,
            extra_tensors=extra_tensors,
        )

    def combine(
        self, hidden_states: torch.Tensor, is_sequence_parallel: bool = False
    ) -> torch.Tensor:
        if self.all2all_manager is None:
            return super().combine(hidden_states, is_sequence_parallel)
        return self.all2all_manager.combine(hidden_states, is_sequence_parallel)

    def destroy(self) -> None:
        if self.all2all_manager is not None:
            self.all2all_manager.destroy()
            self.all2all_manager = None
        if self.sccl is not None:
            self.sccl.destroy()
            self.sccl = None


def _all2all_manager(cpu_group: ProcessGroup, requested: str | None):
    from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager

    if requested not in (None, "naive", "allgather_reducescatter"):
        logger.warning(
            "All2all backend %s is not available on SUPA; using allgather_reducescatter.",
            requested,
        )
    return AgRsAll2AllManager(cpu_group)
