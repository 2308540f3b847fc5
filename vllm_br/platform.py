"""SUPAPlatform: vLLM's out-of-tree platform for Biren SUPA devices.

The device-facing attributes (torch device type, dispatch key, distributed
backend) come from the device layer's backend: ``supa`` on a card, ``cpu`` in
host emulation. Every SUPA policy below is the same on both.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from vllm_br import device, envs
from vllm_br.attention import (
    SUPA_BLOCK_SIZE,
    SUPA_FLASH_ATTN_PATH,
    SUPA_FLASH_MLA_PATH,
    SUPA_FLASH_MLA_SPARSE_PATH,
    SUPA_SPARSE_INDEXER_OP,
    SUPA_SPARSE_MLA_MAX_TOPK,
)
from vllm_br.errors import SUPAConfigError
from vllm_br.logger import init_logger
from vllm_br.quantization import scheme as quant_scheme
from vllm_br.spec_decode.config import check_speculative_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend
    from vllm.v1.attention.backends.mla.prefill.selector import (
        MLAPrefillSelectorConfig,
    )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

logger = init_logger(__name__)

SUPA_DTYPES = (torch.bfloat16, torch.float32)
WORKER_CLS = "vllm_br.worker.worker.SUPAWorker"


def _backend_for_class_attributes() -> device.DeviceBackend:
    # A bad VLLM_BR_* value must not break importing this class: vLLM would
    # hide that error. Fall back to cpu here; check_and_update_config raises
    # the one-sentence error.
    try:
        return device.get_backend()
    except SUPAConfigError:
        from vllm_br.device.cpu import CpuBackend

        return CpuBackend()


_BACKEND = _backend_for_class_attributes()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class SUPAPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = _BACKEND.torch_device_type
    device_type: str = _BACKEND.torch_device_type
    dispatch_key: str = _BACKEND.dispatch_key
    dist_backend: str = _BACKEND.dist_backend
    device_control_env_var: str = "SUPA_VISIBLE_DEVICES"
    ray_device_key: str = "SUPA"
    ray_noset_device_env_vars = ["RAY_EXPERIMENTAL_NOSET_SUPA_VISIBLE_DEVICES"]
    simple_compile_backend: str = "eager"
    # What vllm_br.quantization serves; vLLM refuses other methods.
    supported_quantization: list[str] = list(quant_scheme.SUPPORTED_METHODS)
    additional_env_vars = envs.names()

    #: "supa" or "cpu": which device backend serves this platform
    backend_name: str = _BACKEND.name

    @classmethod
    def log_warnings(cls) -> None:
        # Called by vLLM once logging is configured in a process.
        from vllm_br.entry_points import activation_reason

        reason = activation_reason()
        if reason:
            logger.info_once(reason)

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        # The first entry is what --dtype auto falls back to (float16 -> bf16).
        return list(SUPA_DTYPES)

    # ---- device queries (through the device layer) ------------------------
    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return device.get_backend().get_device_properties(device_id).name

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return device.get_backend().get_device_properties(device_id).total_memory

    @classmethod
    def get_current_memory_usage(cls, device: torch.device | None = None) -> float:
        # `device` (the argument) shadows the device-layer module here.
        from vllm_br.device import get_backend

        return float(get_backend().memory_allocated())

    @classmethod
    def set_device(cls, dev: torch.device) -> None:
        device.get_backend().set_device(dev.index or 0)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        device.get_backend().manual_seed_all(seed)

    @classmethod
    def num_compute_units(cls, device_id: int = 0) -> int:
        return device.get_backend().get_device_properties(device_id).spc_count

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        # On a card torch_br pins host memory, and vLLM's runner then copies
        # its inputs without blocking; in emulation there is nothing to pin.
        # vLLM asks while importing (PIN_MEMORY): the class-attribute backend
        # answers, so a bad VLLM_BR_DEVICE still ends in its one sentence.
        return _BACKEND.pinned_host_memory

    @classmethod
    def verify_quantization(cls, quant: str) -> None:
        if quant not in cls.supported_quantization:
            raise quant_scheme.unsupported_method_error(quant)

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        if dtype not in SUPA_DTYPES:
            raise SUPAConfigError(
                f"--dtype {_dtype_name(dtype)} is not supported on SUPA; use "
                "--dtype bfloat16, --dtype float32 or --dtype auto."
            )

    @classmethod
    def validate_environ(cls, hard_fail: bool) -> None:
        # vLLM flags every unknown VLLM_* variable; the plugin's own are known
        # here and validated by vllm_br.envs.
        from vllm import envs as vllm_envs

        plugin_vars = set(envs.names())
        for name in os.environ:
            if (
                name.startswith("VLLM_")
                and name not in vllm_envs.environment_variables
                and name not in plugin_vars
            ):
                if hard_fail:
                    raise ValueError(
                        f"Unknown vLLM environment variable detected: {name}"
                    )
                logger.warning("Unknown vLLM environment variable detected: %s", name)

    @classmethod
    def import_kernels(cls) -> None:
        # vllm._C does not exist for SUPA; the plugin's kernels are in vllm_br.ops.
        return

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        from vllm_br.worker.kernel_overrides import register_kernel_overrides

        register_kernel_overrides()

    # ---- attention ---------------------------------------------------------
    @classmethod
    def get_attn_backend_cls(
        cls,
        selected_backend: AttentionBackendEnum,
        attn_selector_config: AttentionSelectorConfig,
        num_heads: int | None = None,
    ) -> str:
        if getattr(attn_selector_config, "use_mla", False):
            if getattr(attn_selector_config, "use_sparse", False):
                _warn_unavailable(
                    selected_backend,
                    "SUPA_FLASH_MLA_SPARSE",
                    "SupaFlashMLASparseBackend",
                )
                return SUPA_FLASH_MLA_SPARSE_PATH
            _warn_unavailable(selected_backend, "SUPA_FLASH_MLA", "SupaFlashMLABackend")
            return SUPA_FLASH_MLA_PATH
        _warn_unavailable(
            selected_backend, "SUPA_FLASH_ATTN", "SUPAFlashAttentionBackend"
        )
        return SUPA_FLASH_ATTN_PATH

    @classmethod
    def get_mla_prefill_backend_cls(
        cls, mla_selector_config: MLAPrefillSelectorConfig
    ) -> type[MLAPrefillBackend]:
        # One fixed MLA prefill path on SUPA: the plugin's ragged attention.
        from vllm_br.attention.mla import SupaMLAPrefillBackend

        return SupaMLAPrefillBackend

    @classmethod
    def get_supported_vit_attn_backends(cls) -> list[AttentionBackendEnum]:
        """Vision encoders attend in vLLM's TORCH_SDPA layout (packed images
        with cu_seqlens, nothing else precomputed), which the plugin's
        ``MMEncoderAttention`` runs on its ``attention_varlen`` op
        (``vllm_br.layers.mm_encoder``)."""
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        return [AttentionBackendEnum.TORCH_SDPA]

    @classmethod
    def get_vit_attn_backend(
        cls,
        head_size: int,
        dtype: torch.dtype,
        backend: AttentionBackendEnum | None = None,
    ) -> AttentionBackendEnum:
        supported = cls.get_supported_vit_attn_backends()
        if backend is not None and backend not in supported:
            raise SUPAConfigError(
                f"--mm-encoder-attn-backend {backend.name} is not available on "
                "SUPA, whose vision encoders run on the plugin's attention op; "
                f"leave it unset or use {supported[0].name}."
            )
        return supported[0]

    # ---- configuration -----------------------------------------------------
    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        """Before vLLM parses arguments or builds a config: the V1 model
        runner, unless the user asked otherwise (check_and_update_config
        then refuses it in one sentence). vLLM turns on its breakable CUDA
        graphs for some architectures (DeepSeek V3.2 among them) unless the
        variable is set; they capture torch.cuda graphs, and SUPA captures
        through its own graph wrapper (docs/graphs.md)."""
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        os.environ.setdefault("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        """Apply SUPA policies; idempotent (vLLM calls it on every VllmConfig)."""
        envs.validate_all()
        # Resolves VLLM_BR_DEVICE=auto: a card whose torch_br cannot be
        # imported stops here with its one sentence.
        device.backend_name()
        _check_engine_version()
        _apply_parallel_policy(vllm_config)
        _apply_cache_policy(vllm_config)
        _apply_model_policy(vllm_config)
        _apply_compilation_policy(vllm_config)
        _apply_sparse_mla_policy(vllm_config)
        _apply_scheduler_policy(vllm_config)
        check_speculative_config(vllm_config)

    @classmethod
    def update_block_size_for_backend(cls, vllm_config: VllmConfig) -> None:
        # The block size is fixed by the kernel, not chosen per backend.
        vllm_config.cache_config.block_size = SUPA_BLOCK_SIZE

    @classmethod
    def apply_config_platform_defaults(cls, vllm_config: VllmConfig) -> None:
        """The measured default compilation and graph modes of this backend,
        where the user chose none (vLLM resolves its own defaults after)."""
        from vllm_br.compilation.defaults import (
            apply_graph_defaults,
            cap_moe_capture_size,
        )

        apply_graph_defaults(vllm_config, _BACKEND.default_graph_modes)
        cap_moe_capture_size(vllm_config)

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return True

    @classmethod
    def check_runner_kv_caches_multi_layer(cls) -> None:
        # A draft model's layers share layer indices with the target's. The
        # runner's flat list of caches is only walked whole (KV block copies);
        # SUPAModelRunner zeroes blocks through the forward context's layers.
        return

    @classmethod
    def get_static_graph_wrapper_cls(cls) -> str:
        from vllm_br.compilation import GRAPH_WRAPPER_CLS

        return GRAPH_WRAPPER_CLS

    @classmethod
    def get_compile_backend(cls) -> str:
        from vllm_br.compilation import COMPILER_CLS

        return COMPILER_CLS

    @classmethod
    def get_pass_manager_cls(cls) -> str:
        from vllm_br.compilation import PASS_MANAGER_CLS

        return PASS_MANAGER_CLS

    @classmethod
    def graph_pool_handle(cls) -> object:
        """A new graph memory pool (vLLM keeps one, shared by all captures)."""
        return device.get_backend().graph_pool_handle()

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def use_custom_allreduce(cls) -> bool:
        return False

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        # SCCL on a card, gloo on the cpu backend; applies the allreduce strategy.
        return "vllm_br.distributed.communicator.SUPACommunicator"

    @classmethod
    def opaque_attention_op(cls) -> bool:
        return True

    @classmethod
    def get_punica_wrapper(cls) -> str:
        raise SUPAConfigError(
            "LoRA is not supported on SUPA; serve the model without --enable-lora."
        )

    @classmethod
    def is_sleep_mode_available(cls) -> bool:  # type: ignore[override]
        return False


def _warn_unavailable(
    selected_backend: AttentionBackendEnum | None, ours: str, cls_name: str
) -> None:
    if selected_backend is not None and selected_backend.name not in ("CUSTOM", ours):
        logger.warning(
            "Attention backend %s does not serve this model on SUPA; using %s.",
            selected_backend.name,
            cls_name,
        )


def _check_engine_version() -> None:
    if os.environ.get("VLLM_USE_V1", "").strip() == "0":
        raise SUPAConfigError(
            "VLLM_USE_V1=0 asks for the V0 engine, which vLLM 0.33 no longer has; "
            "unset VLLM_USE_V1 to use the V1 engine."
        )
    _use_v1_model_runner()


def _use_v1_model_runner() -> None:
    """SUPAWorker serves with vLLM's V1 model runner (SUPAModelRunner); Model
    Runner V2 is written in Triton. A user's request for V2 stops here; else
    V1 is set for this process and the engine processes it spawns, which
    spares them vLLM's "Model Runner V2 requires Triton" warning
    (vllm/config/vllm.py:753). pre_register_and_update sets it earlier, before
    vLLM first reads it while building a config."""
    v2 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip()
    if v2 not in ("", "0"):
        raise SUPAConfigError(
            f"VLLM_USE_V2_MODEL_RUNNER={v2} asks for vLLM's Model Runner V2, which "
            "SUPA does not have; unset it to serve with SUPA's V1 model runner."
        )
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def _apply_parallel_policy(vllm_config: VllmConfig) -> None:
    parallel_config = vllm_config.parallel_config
    if parallel_config.worker_cls == "auto":
        parallel_config.worker_cls = WORKER_CLS
    # A SUPA device cannot be re-initialised in a forked child.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if parallel_config.enable_dbo:
        logger.warning("Dual-batch overlap is not supported on SUPA; disabled.")
        parallel_config.enable_dbo = False
    parallel_config.disable_custom_all_reduce = True
    if parallel_config.use_ray:
        # vLLM's Ray worker asks Ray for device ids it has no SUPA entry for
        # (patch ledger: ray-executor-supa-devices).
        from vllm_br.patches import install_ray_executor

        install_ray_executor()


def _apply_cache_policy(vllm_config: VllmConfig) -> None:
    cache_config = vllm_config.cache_config
    if (
        cache_config.user_specified_block_size
        and cache_config.block_size != SUPA_BLOCK_SIZE
    ):
        raise SUPAConfigError(
            f"--block-size {cache_config.block_size} is not supported on SUPA; "
            f"the paged-attention kernel needs --block-size {SUPA_BLOCK_SIZE} "
            "(or leave it unset)."
        )
    cache_config.block_size = SUPA_BLOCK_SIZE
    if cache_config.cache_dtype not in ("auto", "bfloat16", "float32"):
        raise SUPAConfigError(
            f"--kv-cache-dtype {cache_config.cache_dtype} is not supported on SUPA; "
            "use --kv-cache-dtype auto."
        )
    if getattr(cache_config, "enable_sleep_mode", False):
        raise SUPAConfigError(
            "Sleep mode is not supported on SUPA; serve without --enable-sleep-mode."
        )


def _apply_model_policy(vllm_config: VllmConfig) -> None:
    model_config = vllm_config.model_config
    if model_config is None:
        return
    SUPAPlatform.check_if_supports_dtype(model_config.dtype)
    quant_scheme.check_checkpoint(model_config)
    if vllm_config.lora_config is not None:
        SUPAPlatform.get_punica_wrapper()


def _apply_compilation_policy(vllm_config: VllmConfig) -> None:
    from vllm.config import CompilationMode

    compilation_config = vllm_config.compilation_config
    model_config = vllm_config.model_config
    if model_config is not None and model_config.enforce_eager:
        # --enforce-eager: no graphs (vLLM) and no compilation (here).
        compilation_config.mode = CompilationMode.NONE
    if compilation_config.mode not in (
        CompilationMode.NONE,
        CompilationMode.VLLM_COMPILE,
    ):
        raise SUPAConfigError(
            f"Compilation mode {compilation_config.mode.name} is not supported on "
            "SUPA; use -cc.mode=VLLM_COMPILE (piecewise compile) or --enforce-eager."
        )
    from vllm import envs as vllm_envs

    if vllm_envs.VLLM_USE_BREAKABLE_CUDAGRAPH:
        raise SUPAConfigError(
            "VLLM_USE_BREAKABLE_CUDAGRAPH=1 (vLLM's breakable CUDA graphs) is not "
            "supported on SUPA; unset it and choose graphs with -cc.cudagraph_mode."
        )
    _check_moe_capture_sizes(vllm_config)
    # vLLM's AOT-compiled model artifacts do not survive a save/load round
    # trip with the SUPA compile backend (the save fails with "'NoneType'
    # object is not callable" and a later engine of the same config fails to
    # load); compile through vLLM's per-piece cache instead. Spawned engine
    # processes inherit it; a user's own setting wins.
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    # vLLM's fusion passes rewrite graphs into CUDA/ROCm fused kernels
    # (quant, allreduce+norm, rope+KV cache) that SUPA does not have, and
    # their pass classes are only imported on those platforms; inductor's own
    # fusion still runs.
    pass_config = compilation_config.pass_config
    for name in type(pass_config).__dataclass_fields__:
        if name.startswith("fuse_") or name.endswith("_fusion"):
            setattr(pass_config, name, False)
    # The plugin's kernels run through CustomOp.forward_oot: keep them enabled
    # (compiled pieces trace their reference code, which inductor fuses).
    if "all" not in compilation_config.custom_ops:
        compilation_config.custom_ops = ["all"] + [
            op for op in compilation_config.custom_ops if op.startswith("-")
        ]


def _check_moe_capture_sizes(vllm_config: VllmConfig) -> None:
    """Graph sizes the user chose above what a MoE graph can capture stop
    here (defaults are capped in ``apply_config_platform_defaults``)."""
    from vllm_br.compilation.defaults import moe_capture_limit

    limit = moe_capture_limit(vllm_config)
    sizes = vllm_config.compilation_config.cudagraph_capture_sizes or []
    if limit is not None and sizes and max(sizes) > limit:
        raise SUPAConfigError(
            f"A graph of {max(sizes)} tokens cannot be captured for this MoE model "
            "on SUPA, whose graphs hold at most VLLM_BR_STATIC_MOE_DECODER_MAX_LEN="
            f"{limit} tokens; lower -cc.max_cudagraph_capture_size (and "
            "-cc.cudagraph_capture_sizes) to at most that, or raise the variable."
        )


def _apply_sparse_mla_policy(vllm_config: VllmConfig) -> None:
    """DeepSeek Sparse Attention (a model config with ``index_topk``, vLLM's
    own test): the top-k must fit the SUPA kernels, the indexer op splits the
    compiled graph (it reads the step's metadata, as vLLM's indexer op does),
    and the MTP draft layers (vLLM's FP8 indexer) are not served."""
    from vllm.config import CompilationMode

    model_config = vllm_config.model_config
    if model_config is None or not hasattr(model_config.hf_text_config, "index_topk"):
        return
    topk = model_config.hf_text_config.index_topk
    if not isinstance(topk, int) or not 0 < topk <= SUPA_SPARSE_MLA_MAX_TOPK:
        raise SUPAConfigError(
            f"index_topk={topk!r} in the model's config.json is not supported by "
            "SUPA's sparse MLA; it needs an index_topk from 1 to "
            f"{SUPA_SPARSE_MLA_MAX_TOPK}."
        )
    spec = vllm_config.speculative_config
    if spec is not None and spec.method == "mtp":
        raise SUPAConfigError(
            "Speculative decoding with method 'mtp' is not supported on SUPA for "
            "sparse-attention (DeepSeek V3.2) models; use method 'ngram' or serve "
            "without --speculative-config."
        )
    cc = vllm_config.compilation_config
    if cc.mode != CompilationMode.VLLM_COMPILE:
        return
    if cc.splitting_ops is None:
        # vLLM's default list (it would fill it after this hook), plus ours.
        cc.set_splitting_ops_for_v1(
            all2all_backend=vllm_config.parallel_config.all2all_backend,
            data_parallel_size=vllm_config.parallel_config.data_parallel_size,
        )
    if cc.splitting_ops is not None and SUPA_SPARSE_INDEXER_OP not in cc.splitting_ops:
        cc.splitting_ops.append(SUPA_SPARSE_INDEXER_OP)


def _apply_scheduler_policy(vllm_config: VllmConfig) -> None:
    if device.get_backend().synchronous_execution:
        # A backend that runs every step synchronously (host emulation) gives
        # async scheduling nothing to overlap; it only adds a thread hop.
        vllm_config.scheduler_config.async_scheduling = False
