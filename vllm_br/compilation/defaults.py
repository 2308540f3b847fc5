"""The default compilation and graph modes of each SUPA device backend.

A default applies only where the user set nothing (``-cc.mode``,
``-cc.cudagraph_mode``, ``-O``); ``--enforce-eager`` always wins. A default is
to be the fastest correct configuration measured by
``benchmarks/graph_modes.py``; see ``docs/graphs.md`` for what has been
measured so far.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: backend -> (compilation mode name, cudagraph mode name)
GRAPH_DEFAULTS: dict[str, tuple[str, str]] = {
    # Emulation: inductor's fused C++ code beats eager by 1.13-1.24x at batch
    # 1/8/32 on SmolLM2-135M bf16, the fastest of the six configurations
    # not slower than eager anywhere; graphs add nothing on top, since an
    # emulated replay re-runs the same host work (benchmarks/graph_modes.py,
    # 2026-12-02, docs/graphs.md).
    "cpu": ("VLLM_COMPILE", "NONE"),
    # On a card, vLLM's own default (graphs remove per-kernel launch cost).
    # Not measured here: no SUPA card is reachable from CI.
    "supa": ("VLLM_COMPILE", "FULL_AND_PIECEWISE"),
}


def apply_graph_defaults(vllm_config: VllmConfig, backend_name: str) -> None:
    from vllm.config import CompilationMode, CUDAGraphMode
    from vllm.config.vllm import OptimizationLevel

    # An -O level other than vLLM's default O2 is the user's choice: let vLLM
    # resolve it (an explicit -O2 cannot be told apart and gets ours).
    if vllm_config.optimization_level != OptimizationLevel.O2:
        return
    mode_name, graph_name = GRAPH_DEFAULTS[backend_name]
    cc = vllm_config.compilation_config
    if cc.mode is None:
        cc.mode = CompilationMode[mode_name]
    if cc.cudagraph_mode is None:
        cc.cudagraph_mode = CUDAGraphMode[graph_name]
