"""Everything that depends on the vLLM version lives here.

The supported version is written once, in ``vllm_br._version``.
"""

from __future__ import annotations

import re
from importlib import metadata

from vllm_br._version import SUPPORTED_VLLM_VERSION
from vllm_br.logger import init_logger

logger = init_logger(__name__)


def installed_vllm_version() -> str:
    try:
        return metadata.version("vllm").split("+")[0]
    except metadata.PackageNotFoundError:  # pragma: no cover
        import vllm

        return vllm.__version__.split("+")[0]


def check_vllm_version() -> bool:
    """Warn once when the installed vLLM is not the supported release."""
    installed = installed_vllm_version()
    if installed != SUPPORTED_VLLM_VERSION:
        logger.warning(
            "vllm-br supports vLLM %s but vLLM %s is installed; install vllm==%s.",
            SUPPORTED_VLLM_VERSION,
            installed,
            SUPPORTED_VLLM_VERSION,
        )
        return False
    return True


# vLLM 0.33 has only the V1 engine; VLLM_USE_V1 is read nowhere by vLLM.
HAS_V0_ENGINE = False

# vLLM 0.33 GPUModelRunner (Model Runner V1) builds its own streams/events
# through these torch.cuda names; the worker aliases them to the device layer.
CUDA_STREAM_EVENT_NAMES = (
    "Stream",
    "Event",
    "current_stream",
    "stream",
    "default_stream",
)

# Triton kernels of vLLM 0.33 core that the runner launches on every step and
# that need a plain-torch implementation on SUPA (no Triton for SUPA).
SLOT_MAPPING_KERNEL = "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel"

# vLLM 0.33's Ray executor (distributed_executor_backend="ray", RayExecutorV2):
# the module that creates the worker actors from its global RayWorkerProc, and
# ray_utils' wait for the workers' placement group (both looked up at call time).
RAY_EXECUTOR_MODULE = "vllm.v1.executor.ray_executor_v2"
RAY_WORKER_CLASS = "RayWorkerProc"
RAY_UTILS_MODULE = "vllm.v1.executor.ray_utils"
RAY_PLACEMENT_GROUP_WAIT = "_wait_until_pg_ready"


# vLLM 0.33's ModelRegistry error for an architecture it does not know; its
# message lists every supported architecture (thousands of characters).
_UNKNOWN_ARCH = re.compile(
    r"Model architectures (\[[^\]]*\]) are not supported for now"
)


def known_vllm_user_error(err: BaseException) -> str | None:
    """One sentence for a vLLM error a user caused, where vLLM's own is long."""
    match = _UNKNOWN_ARCH.search(str(err))
    if match:
        return (
            f"Model architecture {match.group(1)} is not one vLLM "
            f"{SUPPORTED_VLLM_VERSION} can serve; use a model whose config.json "
            "names a supported architecture."
        )
    return None
