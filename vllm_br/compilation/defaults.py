"""Applying a SUPA device backend's default compilation and graph modes
(``DeviceBackend.default_graph_modes``).

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


def apply_graph_defaults(vllm_config: VllmConfig, modes: tuple[str, str]) -> None:
    """Fill the compilation and cudagraph modes the user left unset with
    ``modes`` (a device backend's ``default_graph_modes``)."""
    from vllm.config import CompilationMode, CUDAGraphMode
    from vllm.config.vllm import OptimizationLevel

    # An -O level other than vLLM's default O2 is the user's choice: let vLLM
    # resolve it (an explicit -O2 cannot be told apart and gets ours).
    if vllm_config.optimization_level != OptimizationLevel.O2:
        return
    mode_name, graph_name = modes
    cc = vllm_config.compilation_config
    if cc.mode is None:
        cc.mode = CompilationMode[mode_name]
    if cc.cudagraph_mode is None:
        cc.cudagraph_mode = CUDAGraphMode[graph_name]
