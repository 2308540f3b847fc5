"""vLLM's unquantized FusedMoE on ``vllm_br.ops.moe``.

How vLLM 0.33 runs such a layer: ``FusedMoEFactory`` builds a ``MoERunner``
(a router plus ``RoutedExperts``); ``RoutedExperts`` creates
``UnquantizedFusedMoEMethod``, a CustomOp. On an out-of-tree platform its
kernel oracle (``fused_moe/oracle/unquantized.py``) picks
``UnquantizedMoeBackend.OOT`` and builds nothing ("OOT handles internally"):
weights stay ``w13 [E, 2I, H]`` / ``w2 [E, H, I]``, there is no modular
kernel, and vLLM's own routers call compiled ``_moe_C`` top-k kernels that
SUPA does not have.

So we register :class:`SUPAUnquantizedFusedMoEMethod` for that CustomOp
(``RoutedExperts`` then builds ours) and make it *monolithic*: ``MoERunner``
then skips its router and passes the router logits to ``apply_monolithic``,
which routes with our ``fused_topk`` / ``grouped_topk`` ops and runs our
``fused_experts`` op through the CustomOp's ``forward_oot``. No monkey patch.

Not served (a one-sentence error at load, or vLLM's own): EPLB, hash
routing (DeepSeek V4), expert substitution, routed-experts capture, zero
experts (LongCat), biased experts and activations outside ``ACTIVATIONS``.
"""

from __future__ import annotations

import torch
from vllm.model_executor import custom_op
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)

from vllm_br.errors import SUPAConfigError
from vllm_br.layers._oot import register_oot
from vllm_br.ops import get_op, reference_op
from vllm_br.ops.moe import ACTIVATIONS


def _check_supported(moe) -> None:
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


class SUPAUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    def __init__(self, moe) -> None:
        super().__init__(moe)
        _check_supported(moe)

    @property
    def is_monolithic(self) -> bool:
        # Routing happens here, not in vLLM's router (its kernels are CUDA).
        return True

    @property
    def supports_eplb(self) -> bool:
        return False

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        topk_weights, topk_ids = route(layer, x, router_logits)
        return self.forward(layer, x, topk_weights, topk_ids, None, None)

    def _experts(self, op, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        return op(
            x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
            layer.activation.value, layer.apply_router_weight_on_input,
            layer.expert_map,
        )  # fmt: skip

    def forward_oot(self, layer, x, topk_weights, topk_ids, *_shared):
        return self._experts(get_op("fused_experts"), layer, x, topk_weights, topk_ids)

    def forward_native(self, layer, x, topk_weights, topk_ids, *_shared):
        # vLLM's native path needs the modular kernel OOT platforms never
        # build; "native" here is our plain-PyTorch reference.
        op = reference_op("fused_experts")
        return self._experts(op, layer, x, topk_weights, topk_ids)


def register() -> list[str]:
    base = UnquantizedFusedMoEMethod
    if register_oot(base, SUPAUnquantizedFusedMoEMethod, custom_op.op_registry_oot):
        return [f"{base.__module__}.{base.__name__}"]
    return []
