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

from vllm_br.layers._oot import register_oot
from vllm_br.ops import get_op, reference_op
from vllm_br.ops.moe_layer import check_supported, route


class SUPAUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    def __init__(self, moe) -> None:
        super().__init__(moe)
        check_supported(moe)

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
