"""Model registry: only models whose structure must differ on SUPA go here.

Every architecture vLLM ships runs unchanged on the plugin's ops; none needs a
SUPA-specific structure yet, so nothing is registered.
"""

from __future__ import annotations

# architecture -> "module:Class", registered with vLLM's ModelRegistry
SUPA_MODELS: dict[str, str] = {}


def register_models() -> None:
    from vllm import ModelRegistry

    for arch, path in SUPA_MODELS.items():
        ModelRegistry.register_model(arch, path)
