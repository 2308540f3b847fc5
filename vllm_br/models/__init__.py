"""Model registry: only models whose structure must differ on SUPA go here.

Every other architecture vLLM ships runs unchanged on the plugin's ops.

* ``DeepseekV32ForCausalLM``: vLLM's generic DeepSeek V3.2 model keeps the
  lightning indexer's queries and keys in FP8; SUPA keeps them in the model's
  dtype (``deepseek_v32.py`` says why).
"""

from __future__ import annotations

# architecture -> "module:Class", registered with vLLM's ModelRegistry
SUPA_MODELS: dict[str, str] = {
    "DeepseekV32ForCausalLM": "vllm_br.models.deepseek_v32:SupaDeepseekV32ForCausalLM",
}


def register_models() -> None:
    from vllm import ModelRegistry

    for arch, path in SUPA_MODELS.items():
        ModelRegistry.register_model(arch, path)
