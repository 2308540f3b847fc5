"""SUPA graphs and compilation: the static-graph wrapper and the compile backend."""

GRAPH_WRAPPER_CLS = "vllm_br.compilation.graph_wrapper.SUPAGraphWrapper"
COMPILER_CLS = "vllm_br.compilation.compiler.SUPACompiler"
PASS_MANAGER_CLS = "vllm_br.compilation.passes.SUPAPassManager"
