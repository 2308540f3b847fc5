"""Quantized checkpoints on SUPA.

vLLM's quantization configs (compressed-tensors, GPTQ) read the checkpoint
and create each layer's parameters; they pick a kernel from vLLM's linear
kernel registries, where :func:`register` adds the SUPA kernels for
``PlatformEnum.OOT``:

- ``SUPAInt8ScaledMMLinearKernel`` (``kernel_type="int8"``): W8A8, int8
  weights per output channel (or per tensor), activations quantized per token
  at run time or with a static per-tensor scale;
- ``SUPAWeightOnlyLinearKernel`` (``kernel_type="mp"``): weight-only int8
  and int4, per channel or grouped, symmetric or with zero points;

and replaces vLLM's ``auto_gptq`` config with one that reaches that kernel
on SUPA (``vllm_br.quantization.gptq``), and vLLM's compressed-tensors config
with one that serves W8A8-INT8 MoE experts on the plugin's fused MoE
(``vllm_br.quantization.moe``); both give weight-only int8 / int4 experts
their SUPA methods (``vllm_br.quantization.weight_only_moe``). vLLM's
``experts_int8`` config is replaced with one
that quantizes a bf16 checkpoint's MoE experts while loading onto the same
fused MoE (``vllm_br.quantization.online_moe``).

Both compute through the ``int8_scaled_mm`` / ``weight_only_linear`` ops
(``vllm_br.ops.quant``), so a device binds its own kernels there. Which
schemes are served, and what ``VLLM_BR_QUANT_METHOD`` decides, is in
``vllm_br.quantization.scheme``.
"""

from __future__ import annotations

_registered = False


def register() -> list[str]:
    """Add the SUPA kernels to vLLM's linear kernel registries (once per
    process; the registries are lists, so a second call would add them twice)."""
    global _registered
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.platforms import PlatformEnum

    from vllm_br.quantization import gptq, moe, online_moe
    from vllm_br.quantization.int8_linear import SUPAInt8ScaledMMLinearKernel
    from vllm_br.quantization.weight_only_linear import SUPAWeightOnlyLinearKernel

    kernels = [
        (SUPAInt8ScaledMMLinearKernel, "int8"),
        (SUPAWeightOnlyLinearKernel, "mp"),
    ]
    if not _registered:
        for cls, kind in kernels:
            register_linear_kernel(cls, PlatformEnum.OOT, kernel_type=kind)
        gptq.register()
        moe.register()
        online_moe.register()
        _registered = True
    return [cls.__name__ for cls, _ in kernels]
