"""vLLM's entry points into the plugin: when the SUPA platform activates
(``vllm.platform_plugins``), and what the general plugin registers
(``vllm.general_plugins``).

``platform_class_path()`` backs the ``vllm.platform_plugins`` entry point.
vLLM calls it (at least twice) in every process and treats an exception as
"plugin inactive", so it never raises and is idempotent.
"""

from __future__ import annotations

import threading

from vllm_br.logger import init_logger

logger = init_logger(__name__)

PLATFORM_CLASS_PATH = "vllm_br.platform.SUPAPlatform"

_lock = threading.Lock()
_decision: str | None = None
_decided = False
_registered = False
# Why the platform is active, in one line. vLLM configures logging after
# platform detection, so SUPAPlatform.log_warnings() prints it then.
_reason: str | None = None


def activation_reason() -> str | None:
    return _reason


def _active(reason: str) -> str:
    global _reason
    _reason = reason
    logger.debug("%s", reason)
    return PLATFORM_CLASS_PATH


def _other_vllm_platform() -> str | None:
    """Name of a built-in vLLM platform that would serve here (cuda, rocm...)."""
    try:
        from vllm.platforms import builtin_platform_plugins
    except Exception:  # pragma: no cover - vLLM always has it
        return None
    for name, detect in builtin_platform_plugins.items():
        try:
            if detect() is not None:
                return name
        except Exception:
            continue
    return None


def _decide() -> str | None:
    from vllm_br import envs
    from vllm_br.device import supa_present
    from vllm_br.errors import SUPAConfigError

    try:
        choice = envs.VLLM_BR_DEVICE
    except SUPAConfigError as e:
        # Activate anyway so the platform stops start-up with this sentence,
        # instead of vLLM silently falling back to another platform.
        logger.error("%s", e)
        return _active(f"SUPA platform active with an invalid setting: {e}")
    if choice in ("supa", "cpu"):
        return _active(
            f"SUPA platform active on the {choice} backend (VLLM_BR_DEVICE={choice})."
        )
    if supa_present():
        return _active(
            "SUPA platform active on the supa backend: a Biren SUPA device was found."
        )
    other = _other_vllm_platform()
    if other is not None:
        logger.info(
            "SUPA platform inactive: no SUPA device and vLLM's %s platform serves "
            "here (set VLLM_BR_DEVICE=cpu to use the SUPA emulation instead).",
            other,
        )
        return None
    return _active(
        "SUPA platform active on the cpu emulation backend: no SUPA device and "
        "no other vLLM platform here (VLLM_BR_DEVICE=cpu makes this explicit)."
    )


def platform_class_path() -> str | None:
    global _decision, _decided
    with _lock:
        if not _decided:
            try:
                _decision = _decide()
            except Exception:  # never raise into vLLM's plugin loader
                logger.exception("SUPA platform detection failed; plugin inactive.")
                _decision = None
            _decided = True
        return _decision


def reset_for_tests() -> None:
    global _decided, _decision, _reason
    with _lock:
        _decided = False
        _decision = None
        _reason = None


def register_everything() -> None:
    """Register the plugin's ops, attention backends, models and patches.

    Runs in every vLLM process; idempotent. Does nothing when the SUPA
    platform is not the active one, so installing the plugin next to a CUDA
    vLLM changes nothing there.
    """
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
    if platform_class_path() is None:
        return
    from vllm_br import compat
    from vllm_br.attention import register_attention_backends
    from vllm_br.layers import register_all as register_layers
    from vllm_br.models import register_models
    from vllm_br.patches import apply_all as apply_patches
    from vllm_br.quantization import register as register_quant_kernels

    compat.check_vllm_version()
    register_attention_backends()
    register_layers()
    register_quant_kernels()
    register_models()
    apply_patches()
