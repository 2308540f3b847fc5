"""What the plugin's MoE methods share, for a vLLM ``RoutedExperts`` layer:
the check of settings SUPA serves, and the routing vLLM's router factory
would pick (``router_factory.py``) on the plugin's routing ops. The
unquantized method (``vllm_br.layers.moe``) and the int8 methods
(``vllm_br.quantization.moe``) both route here and run ``fused_experts``.
"""

from __future__ import annotations

import torch

from vllm_br.errors import SUPAConfigError
from vllm_br.ops.moe import ACTIVATIONS
from vllm_br.ops.registry import get_op


def check_supported(moe) -> None:
    activation = moe.activation.value
    if activation not in ACTIVATIONS:
        raise SUPAConfigError(
            f"MoE activation {activation!r} of this model is not supported on "
            f"SUPA; supported: {', '.join(ACTIVATIONS)}."
        )
    if moe.moe_parallel_config.enable_eplb:
        raise SUPAConfigError(
            "--enable-eplb is not supported on SUPA yet; serve without it."
        )
    unsupported = [
        (moe.has_bias, "MoE experts with biases"),
        (moe.swiglu_limit is not None, "clamped SwiGLU MoE experts"),
        (moe.has_hash_routing, "hash-routed MoE layers"),
        (moe.require_decomposed_backend, "MoE expert substitution or simulation"),
    ]
    for present, what in unsupported:
        if present:
            raise SUPAConfigError(
                f"{what} are not supported on SUPA yet; serve a model and "
                "settings without them."
            )


def route(layer, x: torch.Tensor, router_logits: torch.Tensor):
    """The routing vLLM's router factory would pick (router_factory.py)."""
    if layer.custom_routing_function is not None:  # CustomRoutingRouter
        weights, ids = layer.custom_routing_function(
            hidden_states=x,
            gating_output=router_logits,
            topk=layer.top_k,
            renormalize=layer.renormalize,
        )
        return weights.float(), ids
    bias = layer.e_score_correction_bias
    num_experts = router_logits.shape[-1]
    groups = layer.num_expert_group
    if layer.use_grouped_topk:
        if num_experts > groups and num_experts % groups == 0:  # GroupedTopKRouter
            return get_op("grouped_topk")(
                router_logits, layer.top_k, layer.renormalize, groups,
                layer.topk_group, layer.scoring_func, bias,
                layer.routed_scaling_factor,
            )  # fmt: skip
        if bias is None:
            # As GroupedTopKRouter's fallback: plain softmax top-k, unscaled.
            return get_op("fused_topk")(router_logits, layer.top_k, layer.renormalize)
    if bias is None:
        # FusedTopKRouter: it does not apply routed_scaling_factor.
        return get_op("fused_topk")(
            router_logits, layer.top_k, layer.renormalize, layer.scoring_func
        )
    return get_op("fused_topk")(  # FusedTopKBiasRouter
        router_logits, layer.top_k, layer.renormalize, layer.scoring_func,
        bias, layer.routed_scaling_factor,
    )  # fmt: skip
