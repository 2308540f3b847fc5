"""The post-grad pass manager of the SUPA platform.

vLLM's ``PostGradPassManager`` always ends with ``FixFunctionalizationPass``,
which turns functionalized calls of vLLM's compiled ``_C`` kernels back into
in-place calls and looks ``torch.ops._C.rotary_embedding`` up to do so. SUPA
runs none of those kernels (the plugin's ops are plain PyTorch that inductor
lowers itself), and vLLM built without ``_C`` has no such op, so on SUPA the
pass has nothing to fix and is skipped. Every other pass runs as on CUDA.
"""

from __future__ import annotations

import torch
from vllm.compilation.passes.pass_manager import PostGradPassManager
from vllm.compilation.passes.utility.fix_functionalization import (
    FixFunctionalizationPass,
)


def _has_vllm_c_ops() -> bool:
    try:
        torch.ops._C.rotary_embedding  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


class SUPAFixFunctionalizationPass(FixFunctionalizationPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        if _has_vllm_c_ops():
            super().__call__(graph)


class SUPAPassManager(PostGradPassManager):
    def configure(self, config) -> None:
        super().configure(config)
        self.fix_functionalization = SUPAFixFunctionalizationPass(config)
