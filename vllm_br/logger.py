"""Loggers under vLLM's ``vllm`` namespace, so vLLM's handlers and
``VLLM_LOGGING_LEVEL`` apply to plugin messages too."""

from vllm.logger import init_logger as _vllm_init_logger


def init_logger(name: str):
    return _vllm_init_logger(name if name.startswith("vllm.") else f"vllm.{name}")
