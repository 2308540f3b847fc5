"""Which quantized checkpoints SUPA serves, and what ``VLLM_BR_QUANT_METHOD`` does.

A BR1xx card multiplies int8 at twice its bfloat16 rate, so int8 weights
are the native quantized path. ``VLLM_BR_QUANT_METHOD`` says how weights are
held on the device:

- ``INT8`` (default): every supported checkpoint is served. int8 weights
  stay int8; int4 weights are widened to int8 when loaded (exact: every int4
  value is an int8 value), so they run on the int8 weight path.
- ``INT4``: int4 weights stay packed two per byte (half the bytes of int8;
  for memory-bound decode). int8 checkpoints cannot be held in four bits and
  stop at start-up, naming ``INT8``.

Served, for linear layers and MoE experts alike: compressed-tensors
W8A8-INT8 (dynamic per-token or static per-tensor activations; experts:
per-channel weights, per-token activations), W8A16 and W4A16 (per channel
or grouped, symmetric or with zero points), GPTQ int8 / int4 (vLLM's
``auto_gptq`` path, symmetric), and vLLM's
online ``experts_int8`` / ``int8_per_channel_weight_only`` (a bf16 / fp16
MoE checkpoint whose experts are quantized to int8 while loading). The
checkpoint's scheme is read from its ``quantization_config`` at start-up, so
an unsupported one stops with one sentence before any weight is loaded.
"""

from __future__ import annotations

from typing import Any

from vllm_br import envs
from vllm_br.errors import SUPAConfigError

#: vLLM quantization method names this platform serves (``--quantization``
#: or the checkpoint's ``quant_method`` after vLLM's override detection).
SUPPORTED_METHODS = (
    "compressed-tensors",
    "auto_gptq",
    "gptq",
    "experts_int8",
    "int8_per_channel_weight_only",
)

SERVED = (
    "compressed-tensors W8A8-INT8, W8A16 or W4A16 checkpoints, "
    "GPTQ int8 or int4 checkpoints, the unquantized model, or it with "
    "--quantization experts_int8 (or int8_per_channel_weight_only)"
)
#: vLLM's online int8 MoE methods (one computation under two names): a
#: bf16 / fp16 checkpoint whose experts are quantized while loading
#: (vllm_br.quantization.online_moe).
ONLINE_MOE_METHODS = ("experts_int8", "int8_per_channel_weight_only")


def unsupported_method_error(method: str) -> SUPAConfigError:
    return SUPAConfigError(
        f"Quantization method {method!r} (--quantization or the checkpoint's "
        f"quant_method) is not served on SUPA; serve {SERVED}."
    )


def _ct_scheme(
    weights: dict[str, Any], inputs: dict[str, Any] | None
) -> tuple[str, int | None]:
    """(name, weight bits if SUPA serves it else None) of one compressed-tensors
    config group."""
    w_bits, w_type = weights.get("num_bits"), weights.get("type", "int")
    name = f"W{w_bits}A{16 if inputs is None else inputs.get('num_bits')}"
    if w_type != "int" or (inputs is not None and inputs.get("type", "int") != "int"):
        return f"{name}-{'FP' if w_type == 'float' else str(w_type).upper()}", None
    if inputs is None:
        return name, w_bits if w_bits in (4, 8) else None
    if w_bits == 8 and inputs.get("num_bits") == 8:
        return f"{name}-INT8", 8
    return f"{name}-INT", None


def checkpoint_weight_bits(
    method: str | None, quant_cfg: dict[str, Any] | None
) -> tuple[str, int] | None:
    """(the checkpoint's scheme in words, its weight bits) for a quantized
    checkpoint SUPA serves; None for an unquantized one. Raises
    :class:`SUPAConfigError` for one it does not serve."""
    if method is None:
        return None
    if method not in SUPPORTED_METHODS:
        raise unsupported_method_error(method)
    quant_cfg = quant_cfg or {}
    if method in ONLINE_MOE_METHODS:
        return f"{method} (MoE experts quantized to int8 while loading)", 8
    if method in ("auto_gptq", "gptq"):
        bits = int(quant_cfg.get("bits", 0))
        scheme = f"GPTQ int{bits}"
        if bits not in (4, 8) or not quant_cfg.get("sym", True):
            raise SUPAConfigError(
                f"This checkpoint is {scheme} (sym={quant_cfg.get('sym')}), which "
                f"SUPA does not serve; serve {SERVED}."
            )
        return scheme, bits
    groups = (quant_cfg.get("config_groups") or {}).values()
    found: dict[str, int] = {}
    for group in groups:
        name, bits = _ct_scheme(
            group.get("weights") or {}, group.get("input_activations")
        )
        if bits is None:
            raise SUPAConfigError(
                f"This checkpoint's compressed-tensors scheme {name} is not "
                f"served on SUPA; serve {SERVED}."
            )
        found[f"compressed-tensors {name}"] = bits
    if not found:
        raise SUPAConfigError(
            "This compressed-tensors checkpoint has no config_groups to quantize "
            f"with, which SUPA does not serve; serve {SERVED}."
        )
    # The widest weights decide: an int8 group cannot be held in four bits.
    return " + ".join(sorted(found)), max(found.values())


def check_checkpoint(model_config: Any) -> int | None:
    """Stop a checkpoint that ``VLLM_BR_QUANT_METHOD`` cannot serve with one
    sentence; return its weight bits (None: unquantized)."""
    method = getattr(model_config, "quantization", None)
    hf_cfg = getattr(model_config, "hf_config", None)
    quant_cfg = getattr(hf_cfg, "quantization_config", None)
    if quant_cfg is not None and not isinstance(quant_cfg, dict):
        quant_cfg = quant_cfg.to_dict()
    found = checkpoint_weight_bits(method, quant_cfg)
    if found is None:
        return None
    scheme, bits = found
    if bits == 8 and envs.VLLM_BR_QUANT_METHOD == "INT4":
        raise SUPAConfigError(
            f"This checkpoint is {scheme} (int8 weights), which "
            "VLLM_BR_QUANT_METHOD=INT4 cannot hold in four bits; set "
            "VLLM_BR_QUANT_METHOD=INT8 (the default)."
        )
    return bits


def stored_weight_bits(checkpoint_bits: int) -> int:
    """Bits per weight as held on the device (see the module docstring)."""
    if checkpoint_bits == 4 and envs.VLLM_BR_QUANT_METHOD == "INT4":
        return 4
    if checkpoint_bits == 8 and envs.VLLM_BR_QUANT_METHOD == "INT4":
        raise SUPAConfigError(
            "An int8-weight layer cannot be held in four bits under "
            "VLLM_BR_QUANT_METHOD=INT4; set VLLM_BR_QUANT_METHOD=INT8 (the default)."
        )
    return 8
