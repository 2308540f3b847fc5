"""The patch ledger: every monkey patch the plugin applies, why, and when it goes.

Patches are the last resort; each entry names what it replaces, why no
public extension point serves, and what would let it be removed. ``apply_all``
runs in every vLLM process from the general plugin; worker-only patches are
applied by the worker and listed here too.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass

from vllm_br.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class Patch:
    name: str
    target: str
    why: str
    remove_when: str
    scope: str  # "every process" | "worker" | "cli"
    # The upstream code the patch works around (vLLM 0.33 file:line, or the
    # library it patches), to re-read when vLLM changes.
    upstream: str


LEDGER: list[Patch] = [
    Patch(
        name="cpu-torch-accelerator",
        target="torch.accelerator.{synchronize,empty_cache,get_memory_info,...}",
        why=(
            "vLLM 0.33 calls torch.accelerator.* on every non-CPU platform; on the "
            "cpu emulation backend there is no accelerator and PyTorch raises. "
            "Routed to the cpu device backend (vllm_br/device/cpu_accelerator.py)."
        ),
        remove_when=(
            "vLLM routes these calls through current_platform, or the emulation "
            "registers a real PrivateUse1 accelerator."
        ),
        scope="every process (cpu backend only)",
        upstream="vllm/v1/worker/gpu_worker.py:302 (torch.accelerator.synchronize and get_memory_info in the worker)",
    ),
    Patch(
        name="worker-cuda-stream-event-aliases",
        target="torch.cuda.{Stream,Event,current_stream,stream,default_stream}, torch.Event",
        why=(
            "GPUModelRunner (Model Runner V1) builds streams and events through "
            "torch.cuda names; in a SUPA worker they are aliased to the device "
            "layer's (torch.supa on a card, no-op emulation on cpu), as vLLM's own "
            "XPU and CPU runners do (vllm_br/worker/model_runner.py)."
        ),
        remove_when="vLLM's runner uses torch.Stream/torch.Event or current_platform.",
        scope="worker",
        upstream="vllm/v1/worker/gpu_model_runner.py:286, 428, 753 (torch.cuda.Event / torch.cuda.Stream)",
    ),
    Patch(
        name="supernode-tp-groups",
        target="vllm.distributed.parallel_state.initialize_model_parallel",
        why=(
            "VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE=1 must keep every TP group "
            "inside one supernode (VLLM_BR_SUPERNODE_ID per host), but vLLM builds "
            "its group grid from torch.arange(world_size) inline, with no "
            "extension point. The worker wraps the function: with the variable "
            "set, every rank's supernode id is gathered over the world group and, "
            "when the order from vllm_br/distributed/tp_groups.py is not "
            "range(world_size), that one torch.arange call yields it, for that "
            "call only (vllm_br/distributed/supernode_groups.py). Unset, the "
            "wrapper only calls vLLM's function."
        ),
        remove_when=(
            "vLLM takes the rank order (or a group layout hook) from the platform, "
            "or the executor assigns global ranks supernode by supernode."
        ),
        scope="worker",
        upstream="vllm/distributed/parallel_state.py:2079 (initialize_model_parallel builds TP groups from consecutive ranks)",
    ),
    Patch(
        name="slot-mapping-kernel",
        target="vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel",
        why=(
            "A Triton kernel launched every step; SUPA has no Triton. Replaced "
            "through vLLM's public vllm.triton_utils.dispatcher.register_kernels "
            "(not a monkey patch, listed because it swaps core code)."
        ),
        remove_when="never needed once vLLM ships a torch fallback for it.",
        scope="worker",
        upstream="vllm/v1/worker/block_table.py:305 (ComputeSlotMappingKernel, a Triton kernel)",
    ),
    Patch(
        name="cli-config-error-hook",
        target="sys.excepthook",
        why=(
            "A SUPAConfigError (or a known vLLM user error such as an unknown "
            "architecture) raised while `vllm serve` builds its config would print "
            "a long traceback; the hook prints its one sentence instead and the "
            "process exits 1. Other exceptions keep the default hook."
        ),
        remove_when="vLLM's CLI reports ValueError from platform checks without a traceback.",
        scope="every process",
        upstream="vllm/entrypoints/cli/main.py:117 (args.dispatch_function(args), no handler)",
    ),
    Patch(
        name="ray-executor-supa-devices",
        target=(
            "vllm.v1.executor.ray_executor_v2.RayWorkerProc (module global), "
            "vllm.v1.executor.ray_utils._wait_until_pg_ready"
        ),
        why=(
            "vLLM's Ray worker reads get_accelerator_ids()[ray_device_key] (no "
            "platform hook), and Ray lists only accelerators it knows, so 'SUPA' "
            "raises KeyError. The executor creates its actors from the module's "
            "RayWorkerProc; it is replaced by SUPARayWorkerProc, which reads the "
            "worker's instance ids of the custom SUPA resource "
            "(vllm_br/executor/ray_worker.py). The "
            "placement-group wait stops with one sentence when the cluster has no "
            "SUPA resource instead of waiting 30 minutes. Installed where vLLM's "
            "Ray executor is used: by the platform for a config that asks for Ray, "
            "and in a process that has loaded the executor (the engine core)."
        ),
        remove_when=(
            "vLLM asks the platform for its Ray device ids, or Ray lists custom "
            "unit-instance resources in get_accelerator_ids()."
        ),
        scope="engine core (every process that loaded vLLM's Ray executor)",
        upstream="vllm/v1/executor/ray_executor_v2.py:79, 152 (RayWorkerProc, get_accelerator_ids()[device_key]); vllm/v1/executor/ray_utils.py:201",
    ),
    Patch(
        name="torch-layer-norms",
        target="torch.nn.LayerNorm modules of a loaded model (their __class__)",
        why=(
            "vLLM's vision towers (Qwen-VL, GLM-4V, InternViT), like its BERT-style "
            "encoders, build plain torch.nn.LayerNorm, which is no CustomOp and has "
            "no out-of-tree entry. After loading, the model runner re-classes each such module "
            "to SUPATorchLayerNorm, an nn.LayerNorm subclass that runs the "
            "layer_norm op (vllm_br/layers/vision.py); weights and state are "
            "untouched and no vLLM code changes."
        ),
        remove_when="vLLM's models build its LayerNorm CustomOp.",
        scope="worker",
        upstream="vllm/model_executor/models/qwen2_vl.py:407; vllm/model_executor/models/glm4_1v.py:394; vllm/model_executor/models/interns1_vit.py:28 (nn.LayerNorm)",
    ),
    Patch(
        name="online-int8-moe-method",
        target=(
            "vllm.model_executor.layers.quantization.online.base."
            "_ONLINE_MOE_METHODS[kInt8StaticChannelSym]"
        ),
        why=(
            "--quantization int8_per_channel_weight_only builds vLLM's "
            "OnlineQuantizationConfig (by an identity check on that class, so a "
            "registered config cannot stand in), whose MoE method "
            "Int8OnlineMoEMethod asks the int8 MoE oracle for a kernel, which "
            "offers Triton and CPU only. The table entry names "
            "SUPAInt8OnlineMoEMethod instead: vLLM's loading and quantization, "
            "the plugin's fused MoE (vllm_br/quantization/online_moe.py). Set "
            "when the SUPA platform registers its quantization kernels."
        ),
        remove_when=(
            "vLLM's int8 MoE oracle (or the online method table) takes kernels "
            "for out-of-tree platforms."
        ),
        scope="every process that registers the SUPA quantization kernels",
        upstream=(
            "vllm/model_executor/layers/quantization/online/base.py:104 "
            "(_ONLINE_MOE_METHODS); vllm/model_executor/model_loader/"
            "weight_utils.py:324 (quant_cls is OnlineQuantizationConfig); "
            "vllm/model_executor/layers/fused_moe/oracle/int8.py:102"
        ),
    ),
    Patch(
        name="pil-decompression-bomb-limit",
        target="PIL.Image.MAX_IMAGE_PIXELS (set to None)",
        why=(
            "vLLM refuses an image over VLLM_MAX_IMAGE_PIXELS (default 178,956,970 "
            "pixels, PIL's own bomb limit) with a 400 that names the setting, but "
            "PIL's check runs first, inside Image.open, and raises "
            "DecompressionBombError, which vLLM's image loader does not catch: "
            "the request ends in a 500. With PIL's check off, vLLM's check (the "
            "same limit unless the user sets it) answers. Applied where the "
            "variable is above 0, so a limit always remains."
        ),
        remove_when="vLLM's ImageMediaIO.load_bytes catches DecompressionBombError.",
        scope="every process",
        upstream="vllm/multimodal/media/image.py:83, 98 (open_image before the pixel check; OSError only)",
    ),
]


def _cpu_torch_accelerator() -> None:
    from vllm_br.device import get_backend

    get_backend().install_torch_accelerator()


def _pil_decompression_bomb_limit() -> None:
    import vllm.envs

    if vllm.envs.VLLM_MAX_IMAGE_PIXELS > 0:
        from PIL import Image

        Image.MAX_IMAGE_PIXELS = None


def _causes(exc: BaseException | None):
    """The exception, what it chains to, and what pydantic wrapped inside it."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        err = stack.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        stack += [err.__cause__, err.__context__]
        errors = getattr(err, "errors", None)
        if callable(errors) and type(err).__name__ == "ValidationError":
            try:
                stack += [e.get("ctx", {}).get("error") for e in errors()]
            except Exception:
                pass


def user_error_sentence(exc: BaseException) -> str | None:
    """The one sentence to show for an error the user caused, else None."""
    from vllm_br import compat
    from vllm_br.errors import SUPAConfigError
    from vllm_br.spec_decode.config import vllm_error_sentence

    for err in _causes(exc):
        if isinstance(err, SUPAConfigError):
            return str(err)
    for err in _causes(exc):
        sentence = compat.known_vllm_user_error(err) or vllm_error_sentence(err)
        if sentence is not None:
            return sentence
    return None


def _cli_config_error_hook() -> None:
    previous = sys.excepthook
    if getattr(previous, "_vllm_br", False):
        return

    def hook(exc_type, exc, tb):
        sentence = user_error_sentence(exc)
        if sentence is not None:
            # The interpreter exits with status 1 after the hook returns.
            print(f"Error: {sentence}", file=sys.stderr)
            return
        previous(exc_type, exc, tb)

    hook._vllm_br = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def install_ray_executor() -> None:
    """vLLM's Ray executor on SUPA devices (a config that asks for Ray)."""
    if importlib.util.find_spec("ray") is None:
        return  # vLLM stops with its own "requires installation of ray"
    from vllm_br.executor import ray_worker

    ray_worker.install()


def _ray_executor_supa_devices() -> None:
    # Only where vLLM's Ray executor is loaded (a spawned engine core gets the
    # executor class from the frontend): importing it imports Ray (~0.3 s).
    from vllm_br import compat

    if compat.RAY_EXECUTOR_MODULE in sys.modules:
        install_ray_executor()


_APPLY: dict[str, Callable[[], None]] = {
    "cpu-torch-accelerator": _cpu_torch_accelerator,
    "cli-config-error-hook": _cli_config_error_hook,
    "ray-executor-supa-devices": _ray_executor_supa_devices,
    "pil-decompression-bomb-limit": _pil_decompression_bomb_limit,
}


def apply_all() -> None:
    """Apply the every-process patches (idempotent)."""
    for name, fn in _APPLY.items():
        try:
            fn()
        except Exception as e:  # a bad VLLM_BR_* value surfaces in the platform
            logger.debug("patch %s not applied: %s", name, e)
