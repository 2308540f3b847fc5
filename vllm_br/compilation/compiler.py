"""SUPACompiler: the platform's compile backend for vLLM's piecewise compilation.

vLLM's ``VllmBackend`` splits the model's FX graph at attention and hands each
piece to a ``CompilerInterface``; a platform names its own through
``get_compile_backend()``. On SUPA that is inductor with the platform's
settings: the device backend adds the inductor options its code needs (on ``cpu``,
the C++ settings of vLLM's own CPU platform), on a card torch_br's inductor device backend generates the
device code (where it registers none, the pieces run eagerly, with a
warning, as vLLM's ``EagerAdaptor``). The plugin's custom ops stay enabled (``custom_ops=["all"]``),
so their reference code is traced into the pieces and fused by inductor.
"""

from __future__ import annotations

from typing import Any

from vllm.compilation.compiler_interface import InductorAdaptor

from vllm_br.device import get_backend
from vllm_br.logger import init_logger

logger = init_logger(__name__)


class SUPACompiler(InductorAdaptor):
    name = "supa_inductor"

    def __init__(self) -> None:
        # vLLM constructs a platform compiler with no arguments; AOT artifacts
        # are a CUDA-only path of vLLM's standalone compile.
        super().__init__(use_aot_compile=False)

    def compile(
        self,
        graph: Any,
        example_inputs: list[Any],
        compiler_config: dict[str, Any],
        compile_range: Any,
        key: str | None = None,
    ) -> tuple[Any, Any]:
        backend = get_backend()
        if not backend.has_inductor_codegen():
            # As vLLM's EagerAdaptor: the piece runs as traced (graphs are
            # still captured around it), and there is nothing to cache.
            logger.warning_once(
                "Inductor has no code generator for the %s device (torch_br "
                "registers none): compiled pieces run eagerly; graphs are still "
                "captured.",
                backend.torch_device_type,
            )
            return graph, None
        config = dict(compiler_config or {})
        for option, value in get_backend().inductor_config().items():
            config.setdefault(option, value)
        return super().compile(graph, example_inputs, config, compile_range, key)
