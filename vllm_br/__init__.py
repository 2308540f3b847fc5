"""vllm-br: the vLLM hardware plugin for Biren SUPA accelerators.

Importing this package does no hardware work and imports no vendor SDK.
"""

from vllm_br._version import SUPPORTED_VLLM_VERSION, __version__

__all__ = ["SUPPORTED_VLLM_VERSION", "__version__", "register", "register_plugin"]


def register() -> str | None:
    """``vllm.platform_plugins`` entry point: the SUPAPlatform class path, or None."""
    from vllm_br.entry_points import platform_class_path

    return platform_class_path()


def register_plugin() -> None:
    """``vllm.general_plugins`` entry point: register ops, models and patches
    in every vLLM process (API server, engine core, each worker)."""
    from vllm_br.entry_points import register_everything

    register_everything()
