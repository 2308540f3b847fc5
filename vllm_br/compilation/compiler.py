"""SUPACompiler: the platform's compile backend for vLLM's piecewise compilation.

vLLM's ``VllmBackend`` splits the model's FX graph at attention and hands each
piece to a ``CompilerInterface``; a platform names its own through
``get_compile_backend()``. On SUPA that is inductor with the platform's
settings: on the ``cpu`` backend inductor generates C++ (the options vLLM's own
CPU platform uses), on a card torch_br's inductor device backend generates the
device code. The plugin's custom ops stay enabled (``custom_ops=["all"]``),
so their reference code is traced into the pieces and fused by inductor.
"""

from __future__ import annotations

from typing import Any

from vllm.compilation.compiler_interface import InductorAdaptor

from vllm_br.device import get_backend

# vLLM's CPU platform settings for inductor's C++ code generation
# (vllm/platforms/cpu.py): no runtime shape/NaN asserts in the generated code,
# and an OpenMP thread count read at run time (the worker sets it after load).
CPU_INDUCTOR_CONFIG: dict[str, Any] = {
    "dce": True,
    "size_asserts": False,
    "nan_asserts": False,
    "epilogue_fusion": True,
    "cpp.dynamic_threads": True,
}


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
        config = dict(compiler_config or {})
        if get_backend().name == "cpu":
            for option, value in CPU_INDUCTOR_CONFIG.items():
                config.setdefault(option, value)
        return super().compile(graph, example_inputs, config, compile_range, key)
