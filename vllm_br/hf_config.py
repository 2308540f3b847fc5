"""Facts about a model read from its Hugging Face config."""

from __future__ import annotations

from typing import Any

# hf_config attributes that count routed experts, by family.
_EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts")


def routes_to_experts(hf_config: Any) -> bool:
    """Whether the model (or its text model) has routed MoE experts."""
    cfgs = [hf_config, getattr(hf_config, "text_config", None)]
    return any(
        isinstance(getattr(c, name, None), int) and getattr(c, name) > 0
        for c in cfgs
        for name in _EXPERT_COUNTS
    )
