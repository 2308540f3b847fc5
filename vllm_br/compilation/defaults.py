"""Applying a SUPA device backend's default compilation and graph modes
(``DeviceBackend.default_graph_modes``).

A default applies only where the user set nothing (``-cc.mode``,
``-cc.cudagraph_mode``, ``-O``); ``--enforce-eager`` always wins. A default is
to be the fastest correct configuration measured by
``benchmarks/graph_modes.py``; see ``docs/graphs.md`` for what has been
measured so far.

MoE models also get a default largest graph size
(:func:`cap_moe_capture_size`): a captured batch must take the static-shape
MoE path, which serves up to ``VLLM_BR_STATIC_MOE_DECODER_MAX_LEN`` tokens.
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


def moe_capture_limit(vllm_config: VllmConfig) -> int | None:
    """The most tokens a graph of this model may capture: None where it
    routes no experts or captures no graphs, else
    ``VLLM_BR_STATIC_MOE_DECODER_MAX_LEN``. Above it ``fused_experts`` groups
    tokens by expert with counts read on the host, which a graph cannot hold
    (the capture fails with "a SUPA graph cannot synchronize with the
    host")."""
    from vllm.config import CUDAGraphMode

    from vllm_br import envs
    from vllm_br.hf_config import routes_to_experts

    model_config = vllm_config.model_config
    cc = vllm_config.compilation_config
    if (
        model_config is None
        or model_config.enforce_eager
        or cc.cudagraph_mode in (None, CUDAGraphMode.NONE)
        or not routes_to_experts(model_config.hf_config)
    ):
        return None
    return envs.VLLM_BR_STATIC_MOE_DECODER_MAX_LEN


def cap_moe_capture_size(vllm_config: VllmConfig) -> None:
    """Where the user set no graph sizes, cap a MoE model's largest graph at
    :func:`moe_capture_limit` (vLLM's default is up to 512 tokens); larger
    batches run without a graph. Runs before vLLM derives the sizes."""
    limit = moe_capture_limit(vllm_config)
    cc = vllm_config.compilation_config
    if (
        limit is None
        or cc.max_cudagraph_capture_size is not None
        or cc.cudagraph_capture_sizes is not None
    ):
        return
    # vLLM's own default (VllmConfig._set_cudagraph_sizes), then the cap.
    tokens_per_seq = getattr(vllm_config, "uniform_decode_query_len", 1)
    vllm_default = min(
        vllm_config.scheduler_config.max_num_seqs * tokens_per_seq * 2, 512
    )
    cc.max_cudagraph_capture_size = min(vllm_default, limit)
