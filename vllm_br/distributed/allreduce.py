"""Allreduce strategy: a pure function of the device topology and the settings.

Decided once per process, when the first communicator is built, and logged.

- Fused allreduce (a P2P kernel over B-Link / PCIe P2P) needs every pair of
  participating devices to reach each other directly. Detected: the devices
  ``0..n-1`` that are pairwise P2P-connected, where ``n`` is the largest such
  count (TP groups use consecutive devices); fewer than 2 means no fused
  allreduce. ``VLLM_BR_USE_FUSED_ALLREDUCE=n`` overrides the detection (``0``
  disables it; ``n`` is capped at the visible devices).
- ``VLLM_BR_USE_FP32_ALL_REDUCE=1``: bfloat16/float16 tensors are reduced in
  float32 and cast back (a sum of many bf16 partials loses bits otherwise).
- ``VLLM_BR_USE_CPU_ALL_REDUCE=1``: tensors are copied to the host and reduced
  there over gloo; this replaces the device (and fused) allreduce.

No fused kernel is bound yet: ``uses_fused`` is what a fused GEMM+allreduce or
P2P kernel will consult; until one exists the reduce itself runs on SCCL (card)
or gloo (cpu backend) either way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from vllm_br import envs
from vllm_br.device.base import Topology
from vllm_br.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class AllReduceSettings:
    #: VLLM_BR_USE_FUSED_ALLREDUCE: None = detect, 0 = off, n = n devices
    fused_devices: int | None = None
    #: VLLM_BR_USE_FP32_ALL_REDUCE
    fp32_reduce: bool = False
    #: VLLM_BR_USE_CPU_ALL_REDUCE
    host_reduce: bool = False

    @classmethod
    def from_env(cls) -> AllReduceSettings:
        return cls(
            fused_devices=envs.VLLM_BR_USE_FUSED_ALLREDUCE,
            fp32_reduce=envs.VLLM_BR_USE_FP32_ALL_REDUCE,
            host_reduce=envs.VLLM_BR_USE_CPU_ALL_REDUCE,
        )


@dataclass(frozen=True)
class AllReduceDecision:
    fused: bool
    #: devices 0..fused_devices-1 take the fused path (0 when not fused)
    fused_devices: int
    fp32_reduce: bool
    host_reduce: bool
    #: why, in words, for the start-up log
    reason: str

    def uses_fused(self, group_size: int) -> bool:
        """A group of ``group_size`` consecutive devices takes the fused path."""
        return self.fused and 2 <= group_size <= self.fused_devices

    def describe(self) -> str:
        """What runs, for the start-up log. No fused kernel exists yet, so a
        fused decision says where one would apply and that SCCL runs."""
        if self.host_reduce:
            where = f"on the host (gloo) ({self.reason})"
        elif self.fused:
            where = (
                "on the device collective library; a fused P2P allreduce would "
                f"apply to groups within devices 0..{self.fused_devices - 1} "
                f"({self.reason}) but none is implemented yet"
            )
        else:
            where = f"on the device collective library (fused: no, {self.reason})"
        precision = "; bfloat16 reduced in float32" if self.fp32_reduce else ""
        return f"SUPA allreduce: {where}{precision}."


def p2p_clique_prefix(topology: Topology) -> int:
    """Largest n such that devices 0..n-1 are pairwise P2P-connected."""
    n = 0
    for k in range(topology.device_count):
        if all(topology.p2p[i][k] and topology.p2p[k][i] for i in range(k)):
            n = k + 1
        else:
            break
    return n


def decide(topology: Topology, settings: AllReduceSettings) -> AllReduceDecision:
    """The allreduce strategy for ``topology`` under ``settings``."""
    fp32 = settings.fp32_reduce
    if settings.host_reduce:
        return AllReduceDecision(False, 0, fp32, True, "VLLM_BR_USE_CPU_ALL_REDUCE=1")
    visible = topology.device_count
    if settings.fused_devices is not None:
        n = min(settings.fused_devices, visible)
        reason = f"VLLM_BR_USE_FUSED_ALLREDUCE={settings.fused_devices}"
        if n != settings.fused_devices:
            reason += f", capped at the {visible} visible devices"
        if n < 2:
            return AllReduceDecision(False, 0, fp32, False, reason)
        return AllReduceDecision(True, n, fp32, False, reason)
    n = p2p_clique_prefix(topology)
    if n < 2:
        reason = "one device" if visible < 2 else "devices 0 and 1 have no P2P link"
        return AllReduceDecision(False, 0, fp32, False, reason)
    reason = f"devices 0..{n - 1} are P2P-connected (of {visible} visible)"
    return AllReduceDecision(True, n, fp32, False, reason)


@functools.cache
def startup_decision() -> AllReduceDecision:
    """This process's decision: the device layer's topology and the
    environment, decided and logged once."""
    from vllm_br.device import get_backend

    decision = decide(get_backend().topology(), AllReduceSettings.from_env())
    logger.info(decision.describe())
    return decision
